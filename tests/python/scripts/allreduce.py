"""Gloo all-reduce across every rank: each rank contributes rank+1; prints the sum."""
import os

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
expected = world * (world + 1) / 2
print(f"allreduce rank={rank} world={world} sum={t.item():.0f} expected={expected:.0f}", flush=True)
dist.destroy_process_group()
assert t.item() == expected, (t.item(), expected)
assert int(os.environ["RANK"]) == rank
