"""A script written for `python -m torch.distributed.launch`: its local rank comes from argparse
and it reads nothing from the environment itself (init_method env:// does, as it always did)."""

import argparse

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, required=True)
parser.add_argument("--steps", type=int, default=4)
args = parser.parse_args()

dist.init_process_group(backend="gloo", init_method="env://")
device = torch.device(f"cuda:{args.local_rank}" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Linear(4, 1).to(device))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(args.steps):
    x = torch.full((8, 4), float(dist.get_rank() + step), device=device)
    loss = model(x).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
weight = model.module.weight.detach().sum().item()
print(
    f"legacy rank {dist.get_rank()} local_rank {args.local_rank} steps {args.steps} "
    f"weight {weight:.6f}",
    flush=True,
)
dist.destroy_process_group()
