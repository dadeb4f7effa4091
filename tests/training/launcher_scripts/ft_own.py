"""A user's own script under FT=1, as README.md shows it: torchft's Manager from the environment
the launcher gives each node's group (torchft 0.2.0). It trains a small regression and prints its
parameters' checksum, which every group ends on."""

import os

import torch
from torchft import DistributedDataParallel, Manager, ProcessGroupGloo
from torchft.optim import OptimizerWrapper

torch.manual_seed(0)  # every group starts from the same weights
model = torch.nn.Linear(8, 1)
inner = torch.optim.SGD(model.parameters(), lr=0.05)
group = int(os.environ["TMN_REPLICA_GROUP"])
manager = Manager(
    pg=ProcessGroupGloo(),
    min_replica_size=int(os.environ["TMN_REPLICA_MIN_GROUPS"]),
    load_state_dict=lambda state: (
        model.load_state_dict(state["model"]),
        inner.load_state_dict(state["optim"]),
    ),
    state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
    replica_id=f"group{group}",
    hostname=os.environ["TMN_REPLICA_ADDRESS"],  # this node; the lighthouse: TORCHFT_LIGHTHOUSE
)
ddp = DistributedDataParallel(manager, model)
optimizer = OptimizerWrapper(manager, inner)
generator = torch.Generator().manual_seed(100 + group)  # each group its own samples
while manager.current_step() < 20:
    x = torch.randn(16, 8, generator=generator)
    optimizer.zero_grad()  # this step's quorum
    (ddp(x) - x.sum(dim=1, keepdim=True)).pow(2).mean().backward()
    optimizer.step()  # only where every group's gradients were averaged
checksum = sum(p.sum().item() for p in model.parameters())
print(f"group {group}: step {manager.current_step()} checksum {checksum:.6f}", flush=True)
manager.shutdown(wait=False)
