"""Run by test_each_comm_hook_is_registered_and_compresses in a process of its own: one DDP
rank on a real gloo group, its gradients against a plain model's. Prints the relative error.

A process of its own, as every workload runs: in a pytest worker the group's threads share the
process with whatever ran before, and a gloo group torn down there aborted the worker twice in CI.
"""

from __future__ import annotations

import copy
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.training.conftest import free_port
from torch_multinode.training.distributed import parallel
from torch_multinode.training.distributed.parallel import DistEnv, wrap_ddp
from torch_multinode.training.modeling.models import build_model
from torch_multinode.training.settings.config import DDPConfig


def relative_error(hook: str) -> float:
    torch.manual_seed(0)
    model = build_model("tiny", 10)
    plain = copy.deepcopy(model)
    wrapped = wrap_ddp(
        model,
        DistEnv(launched=True, backend="gloo"),
        DDPConfig(comm_hook=hook, powersgd_start_step=2),
    )
    images, labels = torch.randn(8, 3, 16, 16), torch.randint(10, (8,))
    F.cross_entropy(plain(images), labels).backward()
    for _ in range(3 if hook == "powersgd" else 1):  # powersgd compresses from its start step
        wrapped.zero_grad()
        F.cross_entropy(wrapped(images), labels).backward()
    exact = torch.cat([p.grad.flatten() for p in plain.parameters()])
    reduced = torch.cat([p.grad.flatten() for p in model.parameters()])
    return (exact - reduced).abs().max().item() / exact.abs().max().item()


if __name__ == "__main__":
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        print(f"relative error {relative_error(sys.argv[1])!r}", flush=True)
    finally:
        parallel.stop()
    # Measured and printed: leave without the interpreter's teardown, where a gloo thread still
    # joinable once aborted the probe (SIGABRT, "terminate called without an active
    # exception") after its line, under load.
    os._exit(0)
