#!/usr/bin/env python3
"""A gloo worker for the end-to-end suites: joins the default process group through the store that
the environment names (env://), all-reduces and all-gathers, and checks the results.

Exits 0 and prints "allreduce ok rank=R world=W sum=S" on success; any mismatch raises.

After the barrier it prints its result and leaves with `os._exit(0)`, without
`destroy_process_group()` and without the interpreter's shutdown. Everything that involves the
store (the rendezvous in `init_process_group`, gloo's connection set-up through it) and every
collective has returned by then, so the verdict is complete. What is skipped is torch's own
teardown, where torch 2.4.1 deadlocks now and then (about 1 run in 3 of the 4-rank job on a loaded
2-CPU machine, with torch's own libuv server as with muster's): `~ProcessGroupGloo` joins a gloo
worker thread while holding the GIL, and that thread waits for the GIL to drop its last reference
to a tensor (gdb: main thread in `std::thread::join` under `ProcessGroupGloo::~ProcessGroupGloo`,
the other in `take_gil` under `ConcretePyInterpreterVTable::decref`). An upstream flake that says
nothing about the store; it hangs in `destroy_process_group()`, or at exit when that is not called.
"""

import datetime
import os
import sys

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
    print(f"allreduce ok rank={rank} world={world} sum={int(t[0].item())}", flush=True)
    sys.stderr.flush()
    # No destroy_process_group() and no interpreter shutdown: torch 2.4.1's teardown deadlock
    # (see the docstring).
    os._exit(0)


if __name__ == "__main__":
    main()
