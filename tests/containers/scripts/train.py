"""A worker of the container end-to-end job: tiny DDP training on gloo, launched by muster.

Every rank records what it saw under /shared (or --shared; `--shared -` prints each record as a
line `RECORD <name> <json>` instead, for a container with no writable mount), so the test can check
the gang from the outside:
  start-a<attempt>-r<rank>.json   env muster gave it (ranks, node rank, master address)
  done-a<attempt>-r<rank>.json    final loss, an all-reduce result and a parameter checksum
                                  (identical on every rank when DDP really synchronised)
Options exercise the supervisor:
  --orphans       fork a grandchild that outlives its parent (it is re-parented to PID 1 = muster)
                  and writes orphaned-a<attempt>-r<rank> once it exists
  --hold          after training, wait (bounded) until the file `release` exists before exiting
  --trap-term     an unmodified script's own SIGTERM handler: record sigterm-r<rank>.json, exit 0
  --step-seconds  pause per step, to keep training running while the test acts
"""

import argparse
import json
import os
import signal
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--shared", default="/shared")
parser.add_argument("--orphans", action="store_true")
parser.add_argument("--hold", action="store_true")
parser.add_argument("--hold-timeout", type=float, default=180)
parser.add_argument("--trap-term", action="store_true")
parser.add_argument("--step-seconds", type=float, default=0.0)
args = parser.parse_args()

shared = Path(args.shared)
rank = int(os.environ["RANK"])
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
step = -1


def record(name: str, payload: dict) -> None:
    if args.shared == "-":
        print(f"RECORD {name} {json.dumps(payload)}", flush=True)
        return
    tmp = shared / f".{name}.tmp"
    tmp.write_text(json.dumps(payload))
    tmp.rename(shared / name)  # atomic: the test never reads half a file


if args.trap_term:
    def on_term(signum, _frame):
        record(f"sigterm-r{rank}.json", {"rank": rank, "step": step, "time": time.time(),
                                          "host": socket.gethostname()})
        os._exit(0)

    signal.signal(signal.SIGTERM, on_term)

env_keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
            "ROLE_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
            "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE"]
record(f"start-a{attempt}-r{rank}.json",
       {"host": socket.gethostname(), "pid": os.getpid(), "ppid": os.getppid(),
        "uid": os.getuid(), "gid": os.getgid(), "tmpdir": os.environ.get("TMPDIR"),
        "env": {k: os.environ.get(k) for k in env_keys}})

if args.orphans:
    child = os.fork()
    if child == 0:
        if os.fork() == 0:
            # The grandchild: its parent is gone by now, so PID 1 of the container adopts it.
            time.sleep(0.3)
            record(f"orphaned-a{attempt}-r{rank}", {"ppid": os.getppid()})
            os._exit(0)
        os._exit(0)
    os.waitpid(child, 0)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

dist.init_process_group("gloo", timeout=timedelta(seconds=120))
world = dist.get_world_size()
torch.manual_seed(0)
model = DDP(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
gen = torch.Generator().manual_seed(1000 + rank)
true_w = torch.arange(8, dtype=torch.float32)
loss = torch.tensor(0.0)
for step in range(args.steps):
    x = torch.randn(32, 8, generator=gen)
    y = x @ true_w
    loss = torch.nn.functional.mse_loss(model(x).squeeze(1), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if args.step_seconds:
        time.sleep(args.step_seconds)
    if rank == 0 and step % 5 == 0:
        print(f"step {step} loss {loss.item():.4f}", flush=True)

total = torch.tensor([float(rank + 1)])
dist.all_reduce(total)
checksum = float(sum(p.detach().sum() for p in model.parameters()))
record(f"done-a{attempt}-r{rank}.json",
       {"rank": rank, "world": world, "loss": loss.item(), "all_reduce": total.item(),
        "checksum": checksum, "steps": args.steps})

if args.hold:
    deadline = time.monotonic() + args.hold_timeout
    while not (shared / "release").exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"rank {rank}: never released")
        time.sleep(0.1)
dist.barrier()
dist.destroy_process_group()
# Not the interpreter's own shutdown: torch 2.15's gloo teardown sometimes aborts there (SIGABRT,
# "terminate called without an active exception"; most likely a gloo worker thread taking the GIL
# to release a tensor while the interpreter finalizes), and these tests are about the launcher.
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
