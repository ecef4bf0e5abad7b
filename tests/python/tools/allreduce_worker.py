#!/usr/bin/env python3
"""A gloo worker for the end-to-end suites: joins the default process group through the store that
the environment names (env://), all-reduces and all-gathers, and checks the results.

Exits 0 and prints "allreduce ok rank=R world=W sum=S" on success; any mismatch raises.
"""

import datetime
import os

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group(
        "gloo", init_method="env://", timeout=datetime.timedelta(seconds=60)
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    assert rank == int(os.environ["RANK"]) and world == int(os.environ["WORLD_SIZE"])
    t = torch.tensor([rank + 1.0, 10.0 * rank])
    dist.all_reduce(t)
    want = torch.tensor([world * (world + 1) / 2, 10.0 * world * (world - 1) / 2])
    assert torch.equal(t, want), f"all_reduce gave {t.tolist()}, want {want.tolist()}"
    out = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(out, torch.tensor([float(rank)]))
    assert [int(x.item()) for x in out] == list(range(world)), out
    dist.barrier()
    dist.destroy_process_group()
    print(f"allreduce ok rank={rank} world={world} sum={int(t[0].item())}", flush=True)


if __name__ == "__main__":
    main()
