"""A data-parallel training script that survives preemption with muster.

Run it under muster (any number of nodes and ranks); send SIGTERM to any agent, or
`curl -X POST http://<pod>:8000/checkpoint`, and every rank on every node saves at the same
step, the checkpoint is committed, and the job exits. Started again, it resumes from the last
committed checkpoint.

    muster --nproc-per-node 2 examples/train_checkpoint.py --steps 200 --ckpt-dir /shared/ckpt

Checkpoint layout (a shared directory for multi-node jobs):
    <ckpt-dir>/step_<T>/rank_<r>.pt   what each rank saved at step T
    <ckpt-dir>/LATEST                 "T", written by rank 0 only after muster committed step T

A step directory without LATEST pointing at it is an aborted checkpoint and is never loaded.

With `muster --snapshot-every N`, every N steps each rank also hands its state to its agent's
memory (`muster_launcher.snapshot`), and a restart within the job resumes from the newest such
step when it is newer than LATEST: a crash then costs at most N steps, not the steps since the
last save to storage.
"""

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

import muster_checkpoint  # put on PYTHONPATH by muster; or vendor python/muster_launcher/ with it
from muster_launcher import snapshot


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--ckpt-dir", default=os.environ.get("CKPT_DIR", "/tmp/muster-example-ckpt"))
    p.add_argument("--step-seconds", type=float, default=0.02, help="simulated work per step")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--save-every", type=int, default=0,
                   help="also save every N steps (0: only when muster asks, on preemption), so a "
                        "crash costs at most N steps")
    return p.parse_args()


def last_committed(ckpt_dir):
    try:
        with open(os.path.join(ckpt_dir, "LATEST")) as f:
            return int(f.read().strip())
    except (FileNotFoundError, ValueError):
        return None


def commit_pointer(ckpt_dir, step):
    tmp = os.path.join(ckpt_dir, "LATEST.tmp")
    with open(tmp, "w") as f:
        f.write(str(step))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(ckpt_dir, "LATEST"))


def main():
    args = parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)

    start = 0
    resumed = last_committed(args.ckpt_dir)
    if resumed is not None:
        state = torch.load(os.path.join(args.ckpt_dir, f"step_{resumed}", f"rank_{rank}.pt"))
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = resumed + 1
        print(f"resumed from committed step {resumed}", flush=True)
    restored = snapshot.restore()  # None unless muster holds a newer in-memory snapshot
    if restored is not None and restored[0] + 1 > start:
        step, state = restored
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = step + 1
        print(f"resumed from snapshot step {step}", flush=True)

    ckpt = muster_checkpoint.Checkpointer()
    for step in range(start, args.steps):
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step * world + rank))
        loss = ddp(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(args.step_seconds)
        if step % args.log_every == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
        snapshot.save(step, lambda: {"model": model.state_dict(), "opt": opt.state_dict()})

        if args.save_every and step > start and step % args.save_every == 0:
            # A periodic save, without muster's barrier: every rank saves, the collective
            # barrier says they all did, and only then rank 0 points LATEST at it.
            step_dir = os.path.join(args.ckpt_dir, f"step_{step}")
            os.makedirs(step_dir, exist_ok=True)
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step},
                       os.path.join(step_dir, f"rank_{rank}.pt"))
            dist.barrier()
            if rank == 0:
                commit_pointer(args.ckpt_dir, step)

        if ckpt.should_save(step):
            step_dir = os.path.join(args.ckpt_dir, f"step_{step}")
            os.makedirs(step_dir, exist_ok=True)
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step},
                       os.path.join(step_dir, f"rank_{rank}.pt"))
            if ckpt.saved(step):
                if ckpt.committed and rank == 0:
                    commit_pointer(args.ckpt_dir, step)
                print(f"checkpoint at step {step}: "
                      f"{'committed' if ckpt.committed else 'aborted: ' + str(ckpt.aborted_reason)}",
                      flush=True)
                break
    else:
        print(f"finished {args.steps} steps", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
