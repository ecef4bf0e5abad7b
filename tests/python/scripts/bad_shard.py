"""A gloo training loop in which one rank raises a ValueError at a given step while every other
rank waits for it in an all-reduce (they then fail with "Connection closed by peer").

  bad_shard.py FAILING_RANK STEP [--slow-peer SECONDS]

--slow-peer: the failing rank's peers on its own node ignore SIGTERM and linger SECONDS after
their collective failed, so that node takes that long to stop its group and tell the gang, and
the other nodes' ranks certainly fail first (the side of the race where node 0 has failures of
its own to report).
"""
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

failing, at_step = int(sys.argv[1]), int(sys.argv[2])
slow_peer = float(sys.argv[4]) if len(sys.argv) > 4 and sys.argv[3] == "--slow-peer" else None

dist.init_process_group("gloo")
rank = dist.get_rank()
local_world = int(os.environ["LOCAL_WORLD_SIZE"])
lingers = slow_peer is not None and rank != failing and rank // local_world == failing // local_world
if lingers:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
for step in range(1, 1000):
    if rank == failing and step == at_step:
        raise ValueError(f"the real cause: bad shard 17 on rank {rank}")
    t = torch.ones(4)
    try:
        dist.all_reduce(t)
    except RuntimeError:
        if lingers:
            time.sleep(slow_peer)
        raise
    if step == 1:
        print(f"rank {rank} trains", flush=True)
    time.sleep(0.05)
print(f"rank {rank} finished", flush=True)
