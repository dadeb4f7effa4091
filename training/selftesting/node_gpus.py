"""The selftest's checks over all of a node's GPUs from one process (local rank 0 of the node):
nn.DataParallel, and a model split over two GPUs, each against the same network on one GPU.
Both need 2+ GPUs on the node; elsewhere they are SKIPPED with the reason.
"""

from __future__ import annotations

import torch
from torch import nn

from torch_multinode.training.selftesting.checks import (
    DEBUG_REMEDY,
    Failed,
    Job,
    Net,
    Skip,
    batch,
    seeded_net,
)


def _two_gpus(job: Job) -> None:
    count = job.local_gpus()
    if count < 2:
        raise Skip(
            "needs 2+ GPUs on the node; it has none"
            if not job.cuda
            else f"needs 2+ GPUs on the node; this process sees {count}"
        )
    if job.env.local_rank != 0:
        raise Skip("run by local rank 0 of the node, over all its GPUs")


def _reference(device: torch.device) -> tuple[Net, torch.Tensor, torch.Tensor]:
    model = seeded_net(device)
    x, _ = batch(device)
    out = model(x)
    out.sum().backward()
    return model, out, x


def check_data_parallel(job: Job) -> str:
    _two_gpus(job)
    count = job.local_gpus()
    single, out, x = _reference(torch.device("cuda", 0))
    model = seeded_net(torch.device("cuda", 0))
    parallel_model = nn.DataParallel(model, device_ids=list(range(count)))
    spread = parallel_model(x)
    spread.sum().backward()
    worst = max(
        (spread - out).abs().max().item(),
        *(
            (a.grad - b.grad).abs().max().item()
            for a, b in zip(single.parameters(), model.parameters(), strict=True)
        ),
    )
    if worst > 1e-4:
        raise Failed(f"DataParallel differs from one GPU by {worst:.3g}", DEBUG_REMEDY)
    return f"over {count} GPUs, within {worst:.1g} of one"


class _Split(nn.Module):
    """The same network, its first layer on one GPU and the rest on another."""

    def __init__(self, net: Net, first: torch.device, second: torch.device):
        super().__init__()
        self.first, self.second = first, second
        self.head = net.layers[0].to(first)
        self.tail = net.layers[1:].to(second)

    def forward(self, x):
        return self.tail(self.head(x.to(self.first)).to(self.second))


def check_model_parallel(job: Job) -> str:
    _two_gpus(job)
    first, second = torch.device("cuda", 0), torch.device("cuda", 1)
    single, out, x = _reference(first)
    split = _Split(seeded_net(torch.device("cpu")), first, second)
    spread = split(x)
    spread.sum().backward()
    worst = max(
        (spread.to(first) - out).abs().max().item(),
        *(
            (a.grad.to(first) - b.grad).abs().max().item()
            for a, b in zip(split.parameters(), single.parameters(), strict=True)
        ),
    )
    if worst > 1e-4:
        raise Failed(f"the split model differs from one GPU by {worst:.3g}", DEBUG_REMEDY)
    return f"cuda:0 + cuda:1, within {worst:.1g} of one GPU"
