"""The selftest's checks over all of a node's GPUs from one process (local rank 0 of the node):
nn.DataParallel, and a model split over two GPUs, each against the same network on one GPU;
then training.model_parallel itself, under a torchrun of its own, for DDP over a module that
spans two GPUs (a job's ranks are each bound to one GPU, so only a process of its own can run
that). Both need 2+ GPUs on the node; elsewhere they are SKIPPED with the reason.
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch
from torch import nn

from torch_multinode.cluster.jobenv import PLANNED_WORLD_VARIABLE, RUN_DIR_VARIABLE
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


WORKLOAD = "torch_multinode.training.model_parallel"
WORKLOAD_TIMEOUT = 300
# What the nested torchrun must not take from this rank's environment: torchrun's names (it
# sets its own), the run directory (the workload serves no trace and writes nothing of the
# job's there) and NCCL's logging to this rank's file (the nccl-transport check's).
_NOT_INHERITED = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "ROLE_RANK",
        "ROLE_NAME",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "NCCL_DEBUG_FILE",
        "NCCL_DEBUG_SUBSYS",
        "TORCH_FR_DUMP_TEMP_FILE",
        RUN_DIR_VARIABLE,
        PLANNED_WORLD_VARIABLE,
    }
)


def workload_run(environ: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """The command and environment of training.model_parallel under a torchrun of its own: one
    process, on the node's first two visible GPUs (cuda:0 and cuda:1), its rendezvous on a free
    loopback port (--standalone)."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "1",
        "-m",
        WORKLOAD,
        *("--steps", "2", "--batch-size", "4", "--image-size", "32"),
    ]
    env = {
        name: value
        for name, value in environ.items()
        if name not in _NOT_INHERITED and not name.startswith("TORCHELASTIC_")
    }
    env["NCCL_DEBUG"] = "WARN"
    return command, env


def run_workload(environ: dict[str, str]) -> str:
    """training.model_parallel's 2 steps, or Failed with the last line it said."""
    command, env = workload_run(environ)
    try:
        done = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=WORKLOAD_TIMEOUT, check=False
        )
    except subprocess.TimeoutExpired as expired:
        raise Failed(
            f"training.model_parallel under torchrun still ran after {WORKLOAD_TIMEOUT} s",
            DEBUG_REMEDY,
        ) from expired
    said = [line.strip() for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    if done.returncode != 0 or not any("parameters sha256" in line for line in said):
        raise Failed(
            f"training.model_parallel under torchrun (DDP over two GPUs) exited "
            f"{done.returncode}: {_cause(said)}",
            DEBUG_REMEDY,
        )
    return "training.model_parallel's DDP over both: 2 steps"


def _cause(said: list[str]) -> str:
    """The line that says why: a workload's `Error:` line, the worker's exception (not
    torchrun's ChildFailedError after it), or Python's own "No module named"; else the last."""
    for line in reversed(said):
        if line.startswith("Error:") or "No module named" in line:
            return line
        if "Error: " in line and "ChildFailedError" not in line:
            return line
    return said[-1] if said else "it said nothing"


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
    ran = run_workload(dict(os.environ))
    return f"cuda:0 + cuda:1, within {worst:.1g} of one GPU; {ran}"
