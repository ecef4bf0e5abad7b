"""A tiny DDP training job on gloo (CPU): the README's main job, run by `scripts/dry-run`.

Every rank fits y = 3x + 1 on its own shard of synthetic data; DDP averages the gradients, so all
ranks hold the same weights. Rank 0 prints the loss of each step and the learned parameters.
"""

import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS = int(os.environ.get("TRAIN_STEPS", "20"))


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(1, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(1234 + rank)
    for step in range(STEPS):
        x = torch.rand(64, 1, generator=gen)
        y = 3 * x + 1
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        avg = loss.detach().clone()
        dist.all_reduce(avg)
        if rank == 0 and (step % 5 == 4 or step == STEPS - 1):
            print(f"step {step + 1}/{STEPS} loss {avg.item() / world:.4f}", flush=True)
    w, b = model.module.weight.item(), model.module.bias.item()
    if rank == 0:
        print(f"done: world size {world}, w={w:.3f} b={b:.3f}", flush=True)
    # Every rank is past its last collective before any tears its connections down: a gloo rank
    # whose peer destroyed the group mid-exchange can abort at exit (seen once in CI as SIGABRT,
    # "terminate called without an active exception", after training had finished).
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
