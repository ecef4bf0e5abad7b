"""Test worker for the preemption barrier: gloo all-reduce every step, muster's helper, saves.

Prints machine-readable lines:
  STEP <rank> <step>                  every 10 steps
  SAVED <rank> <step> committed|aborted:<reason>
  RESUMED <rank> <step>
  GOT_SIGTERM <rank>                  (--trap-sigterm: an unmodified script's own handler)
"""

import argparse
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--ckpt-dir", required=True)
p.add_argument("--steps", type=int, default=100000)
p.add_argument("--step-seconds", type=float, default=0.02)
p.add_argument("--die-during-save-rank", type=int, default=-1)
p.add_argument("--save-seconds", type=float, default=0.0)
p.add_argument("--no-helper", action="store_true")
p.add_argument("--trap-sigterm", action="store_true")
args = p.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()

if args.trap_sigterm:
    def on_term(signum, frame):
        print(f"GOT_SIGTERM {rank}", flush=True)
        os._exit(0)
    signal.signal(signal.SIGTERM, on_term)

start = 0
latest = os.path.join(args.ckpt_dir, "LATEST")
if os.path.exists(latest):
    start = int(open(latest).read()) + 1
    print(f"RESUMED {rank} {start - 1}", flush=True)

if args.no_helper:
    ckpt = None
else:
    import muster_checkpoint
    ckpt = muster_checkpoint.Checkpointer()
    assert ckpt.active, "the agent's checkpoint socket is not reachable"

t = torch.zeros(1)
# An optimizer step every step, as in any training loop: without the helper, muster's zero-code
# reporter reports these steps, and the barrier must still treat the script as unable to save.
weight = torch.nn.Parameter(torch.ones(1))
optimizer = torch.optim.SGD([weight], lr=0.001)
for step in range(start, args.steps):
    t += 1
    dist.all_reduce(t)
    optimizer.zero_grad()
    (weight * t).sum().backward()
    optimizer.step()
    time.sleep(args.step_seconds)
    if step % 10 == 0:
        print(f"STEP {rank} {step}", flush=True)
    if ckpt is not None and ckpt.should_save(step):
        if rank == args.die_during_save_rank:
            os._exit(7)
        time.sleep(args.save_seconds)
        d = os.path.join(args.ckpt_dir, f"step_{step}")
        os.makedirs(d, exist_ok=True)
        torch.save({"t": t, "step": step}, os.path.join(d, f"rank_{rank}.pt"))
        stop = ckpt.saved(step)
        verdict = "committed" if ckpt.committed else f"aborted:{ckpt.aborted_reason}"
        if ckpt.committed and rank == 0:
            with open(latest + ".tmp", "w") as f:
                f.write(str(step))
            os.replace(latest + ".tmp", latest)
        print(f"SAVED {rank} {step} {verdict}".replace("\n", " "), flush=True)
        if stop:
            break
dist.destroy_process_group()
sys.exit(0)
