"""The selftest's check of FSDP2 checkpoint replicas (training.checkpointing.replicate): the code a
real job runs, on a directory of the same path on every node that each node holds on its own
disk, as --checkpoint-dir on node-local disks is.

A step is saved, and its copy to the next node runs in its background thread over the replicas'
gloo group while this thread goes on with collectives of the job's own backend (NCCL on GPUs):
the overlap a training job has. Then the last node's copy of the step is wiped, as a lost disk,
and the resume gets its files back from the node it sent them to and loads the same
parameters.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from torch_multinode.training.checkpointing import dcp, replicate
from torch_multinode.training.selftesting.checks import (
    DATA_TIMEOUT,
    DEBUG_REMEDY,
    Failed,
    Job,
    Skip,
    batch,
    sharded_net,
)

INFO = {"check": "fsdp2-replicas"}  # what a resume compares with the saved step's


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.full_tensor().cpu() for name, value in model.state_dict().items()}


def check_fsdp2_replicas(job: Job) -> str:
    env = job.env
    if not env.launched:
        raise Skip("one process, no process group")
    # The same path on every node (the scratch's name is one everywhere), on each node's own
    # disk (never the shared --checkpoint-dir).
    directory = Path(tempfile.gettempdir()) / f"{job.scratch.name}-replicas"
    directory.mkdir(parents=True, exist_ok=True)
    try:
        return _replicas(job, directory)
    finally:
        dist.barrier(group=job.control)  # every rank is done with the directory
        shutil.rmtree(directory, ignore_errors=True)


def _replicas(job: Job, directory: Path) -> str:
    env = job.env
    store = dcp.Checkpoints(directory, env, keep=1, node=job.node)
    store.replication = replication = replicate.Replication(store, 0, DATA_TIMEOUT)
    layout = store.look()
    replication.open()
    if not replication.active:
        raise Skip(
            "one node's disk: replicas go to another node"
            if len(set(job.nodes)) == 1
            else f"{tempfile.gettempdir()} is storage every node sees: nothing to copy"
        )

    model = sharded_net(job, seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = batch(job.device, seed=env.rank)
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    saved = _full(model)
    store.save(1, model, optimizer, {"rng": None}, INFO)  # its copy starts in the background
    total = torch.ones(1, device=job.device)
    for _ in range(20):  # the job's own collectives meanwhile, on its own backend
        dist.all_reduce(total)
        total /= env.world_size
    replication.wait()
    # Every node holds its own files of the step and the previous node's.
    files = store._manifest(1)["files"] if layout.owner else []
    behind = replication.ring[replication.ring.index(layout.visible) - 1]
    lacking = [
        name
        for name in replicate.written_by(files, (*layout.visible, *behind))
        if not (store.path(1) / name).is_file()
    ]
    problem = None  # each rank's, told to all at the meeting point (job.agree)
    if replication.broken:
        problem = Failed("the copy of the saved step to the next node failed", DEBUG_REMEDY)
    elif total.item() != 1.0:
        problem = Failed(f"all_reduce beside the copy gave {total.item()}, not 1.0", DEBUG_REMEDY)
    elif lacking:
        problem = Failed(f"{job.node} lacks {', '.join(lacking)} after the copy", DEBUG_REMEDY)
    job.agree(problem)

    # The last node's disk lost: the resume takes its files from the node after it.
    if layout.owner and layout.visible == replication.ring[-1]:
        shutil.rmtree(store.path(1))
    dist.barrier(group=job.control)
    loaded = sharded_net(job, seed=1)
    step, _ = store.resume(loaded, torch.optim.SGD(loaded.parameters(), lr=0.05), True, INFO)
    back = _full(loaded)  # collective: every rank, whatever it found
    if step != 1:
        problem = Failed(f"the resume found step {step}, not the saved step 1", DEBUG_REMEDY)
    elif any(not torch.equal(saved[name], back[name]) for name in saved):
        problem = Failed(
            "parameters resumed from the replicas differ from those saved", DEBUG_REMEDY
        )
    job.agree(problem)
    # The last node's files went to the first (the ring's next), which gives them back.
    lost, keeper = (job.nodes[replication.ring[i][0]] for i in (-1, 0))
    return (
        f"{len(replication.ring)} nodes' shards copied beside {env.backend}; {lost}'s wiped copy "
        f"restored from {keeper}, same parameters"
    )
