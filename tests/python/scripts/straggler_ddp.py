"""A plain DDP training loop on gloo, with no muster helper: muster sees its steps through the
zero-code reporter (torch's optimizer hook). Usage: straggler_ddp.py SLOW_RANK SECONDS [FACTOR]

Every rank does the same compute per step (a chain of matrix products, then the model's forward
and backward), except rank SLOW_RANK (-1: none), which does FACTOR (default 3) times as much, as a
rank on a throttled GPU or a starved host would. Rank 0 decides when SECONDS are up and tells the
others through the step's all-reduce, so every rank stops at the same step. Prints `RESULT rank=R
world=W steps=S step_ms=M`.

With SLOW_AFTER=SECS in the environment the slow rank turns slow only that long after the start
and prints `SLOWDOWN at=<unix time>` then (the bench's time-to-finding).

With STRAGGLER_THREADS=default the script leaves torch's intra-op thread count alone (one per
core, as a rank alone on its node gets it: neither muster nor torchrun sets OMP_NUM_THREADS
then); `START rank=R threads=T` says how many it has."""

import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

# One thread per rank: three ranks share a small machine, and the compute per step must be the
# script's, not the scheduler's.
if os.environ.get("STRAGGLER_THREADS") != "default":
    torch.set_num_threads(1)
slow_rank = int(sys.argv[1])
seconds = float(sys.argv[2])
factor = int(sys.argv[3]) if len(sys.argv) > 3 else 3

dist.init_process_group("gloo")
rank = dist.get_rank()
world = dist.get_world_size()
print(f"START rank={rank} threads={torch.get_num_threads()}", flush=True)
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.001)
x = torch.randn(32, 128)
# STRAGGLER_WORK=SIZE,CHAIN: the compute per step as CHAIN products of SIZE x SIZE matrices.
size, chain = (int(v) for v in os.environ.get("STRAGGLER_WORK", "256,12").split(","))
a = torch.randn(size, size)
slow_after = float(os.environ.get("SLOW_AFTER", "0"))
reps = 1
started = time.monotonic()
done = torch.zeros(1)
steps = 0
while True:
    if rank == slow_rank and reps == 1 and time.monotonic() - started >= slow_after:
        reps = factor
        if slow_after > 0:
            print(f"SLOWDOWN at={time.time():.3f}", flush=True)
    for _ in range(reps):
        b = a
        for _ in range(chain):
            b = torch.tanh(b @ a)
    loss = model(x).pow(2).mean() + b.mean() * 0
    loss.backward()
    opt.step()
    opt.zero_grad()
    steps += 1
    if rank == 0 and time.monotonic() - started >= seconds:
        done.fill_(1.0)
    dist.all_reduce(done)
    if done.item() > 0:
        break
took = time.monotonic() - started
print(f"RESULT rank={rank} world={world} steps={steps} step_ms={1000 * took / steps:.1f}", flush=True)
sys.stdout.flush()
dist.barrier()
# Not a plain exit: torch 2.15's teardown of a live gloo group sometimes aborts (SIGABRT).
os._exit(0)
