"""A user's script, written the way the PyTorch DDP tutorial teaches: everything from the env."""

import gc
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(100 + rank)
    for _ in range(5):
        x = torch.randn(16, 8, generator=generator)
        loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    checksum = torch.tensor([sum(p.sum().item() for p in model.parameters())])
    gathered = [torch.zeros(1) for _ in range(world_size)]
    dist.all_gather(gathered, checksum)
    assert all(torch.equal(g, gathered[0]) for g in gathered), gathered
    print(
        f"rank {rank}/{world_size} local {local_rank} on {os.uname().nodename}: "
        f"params checksum {checksum.item():.6f} identical on all ranks (python {sys.executable})"
    )
    # Every rank leaves together: gloo torn down under a peer still finishing its last
    # collective can abort that peer ("terminate called without an active exception", seen in
    # CI once in several runs with torch 2.14.1), as training.distributed.parallel.stop says.
    dist.barrier()
    dist.destroy_process_group()
    # The DDP model's reducer sits in a reference cycle that keeps the gloo group and its
    # threads alive until the interpreter's final collection, where ending them can abort the
    # process all the same (pytorch/pytorch#179291; seen in CI once in ~20 runs even after the
    # barrier): collect while the interpreter is whole, as training.distributed.parallel.stop does.
    del model, optimizer
    gc.collect()


if __name__ == "__main__":
    main()
