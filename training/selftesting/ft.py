"""The selftest's check of FT=1 (training.distributed.replicas): every rank one replica group,
torchft replicating across them as it does across nodes, through the code an FT=1 job runs:
Replication's process group for the device (torchft's NCCL group on a GPU, its gloo group on
the CPU), the comm hook that carries DDP's gradient buckets across the groups, and the
optimizer that steps only on a committed step. The lighthouse runs in rank 0's process
(torchft's LighthouseServer), each group's store in its own rank's: what the launcher and each
node's torchrun give a job.

Three steps, each rank its own batch: every rank must commit each one, with every group
taking part, and end with the parameters that the average of every rank's gradient gives,
computed here on the CPU.
"""

from __future__ import annotations

import importlib.util
import os
import socket

import torch
import torch.distributed as dist
from torch import nn

from torch_multinode.training.selftesting.checks import (
    DATA_TIMEOUT,
    Failed,
    Job,
    Skip,
    batch,
    seeded_net,
)

STEPS = 3
LR = 0.05
TOLERANCE = 1e-4
# Where a group cannot reach another's ports: torchft's lighthouse, manager and store, and its
# process group, all on ports of the system's choosing between the nodes' compute addresses.
REMEDY = "every TCP port open between the nodes' compute addresses (make provision's firewall)"


def check_ft_replicas(job: Job) -> str:
    env = job.env
    if not env.launched:
        raise Skip("one process, no process group")
    if importlib.util.find_spec("torchft") is None:
        raise Skip(
            "torchft is not installed here (FT=1 jobs run in the training image, which has it)"
        )
    address = own_address()
    # DDP's process group in an FT=1 job is its node's ranks; here, its rank alone. Every rank
    # takes part in the creation of every group.
    alone = [dist.new_group([rank]) for rank in range(env.world_size)][env.rank]
    lighthouse, error = None, None
    if env.rank == 0:
        os.environ.setdefault("RUST_LOG", "warn")  # as Replication does: torchft's INFO lines off
        try:
            from torchft.coordination import LighthouseServer

            lighthouse = LighthouseServer(bind="[::]:0", min_replicas=env.world_size)
        except Exception as raised:
            error = Failed(f"torchft's lighthouse did not start: {raised}", REMEDY)
    job.agree(error)
    try:
        port = lighthouse.address().rsplit(":", 1)[1] if lighthouse is not None else None
        url = job.gather(f"http://{address}:{port}" if port else None)[0]
        return _replicate(job, url, address, alone)
    finally:
        dist.barrier(group=job.control)  # every group done before the lighthouse goes
        if lighthouse is not None:
            lighthouse.shutdown()


def own_address() -> str:
    """This node's address towards the job's master (its compute address; loopback on one
    machine), where the other groups reach this one: the address a socket aimed at the master
    would leave from. Nothing is sent."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((os.environ.get("MASTER_ADDR", "127.0.0.1"), 9))
        return probe.getsockname()[0]


def _replicate(job: Job, url: str, address: str, alone) -> str:
    from torch.distributed import TCPStore
    from torch.nn.parallel import DistributedDataParallel

    from torch_multinode.training.distributed.replicas import ReplicaGroup, Replication

    env, device = job.env, job.device
    store = TCPStore(address, 0, is_master=True, wait_for_workers=False)
    group = ReplicaGroup(
        index=env.rank,
        count=env.world_size,
        lighthouse=url,
        min_groups=env.world_size,
        timeout=DATA_TIMEOUT,
        address=address,
    )
    model = seeded_net(device)
    # find_unused_parameters=True keeps the buckets' first layout, as wrap_ddp's fixed_buckets.
    ddp = DistributedDataParallel(
        model,
        device_ids=[device.index] if job.cuda else None,
        process_group=alone,
        find_unused_parameters=True,
    )
    replication = Replication(
        group,
        device,
        state=lambda: {"model": model.state_dict()},
        load=lambda state: model.load_state_dict(state["model"]),
        store=(address, store.port),
    )
    try:
        replication.replicate(ddp)
        optimizer = replication.optimizer(torch.optim.SGD(ddp.parameters(), lr=LR))
        for step in range(STEPS):
            optimizer.zero_grad()  # this step's quorum
            x, y = batch(device, seed=_seed(step, env.rank))
            nn.functional.mse_loss(ddp(x), y).backward()
            optimizer.step()  # only where every rank of the group may commit
        committed, participants = replication.committed(), replication.participants()
    finally:
        replication.shutdown()
    if committed != STEPS or participants != env.world_size:
        raise Failed(
            f"{committed} of {STEPS} steps committed, the last with {participants} of "
            f"{env.world_size} groups",
            REMEDY,
        )
    expected = _average_steps(env.world_size)
    worst = max(
        (p.detach().cpu() - e).abs().max().item()
        for p, e in zip(model.parameters(), expected, strict=True)
    )
    if worst > TOLERANCE:
        raise Failed(
            f"the groups' parameters differ from the average gradient's by {worst:.3g}",
            "make selftest ... DEBUG=1, and the torchft version the training image pins",
        )
    return f"{STEPS} steps committed by {env.world_size} groups, within {worst:.1g}"


def _seed(step: int, rank: int) -> int:
    return 1000 + 100 * step + rank


def _average_steps(world_size: int) -> list[torch.Tensor]:
    """The parameters after STEPS of SGD on the average of every rank's gradient, on the CPU."""
    model = seeded_net(torch.device("cpu"))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        grads: list[list[torch.Tensor]] = []
        for rank in range(world_size):
            model.zero_grad()
            x, y = batch(torch.device("cpu"), seed=_seed(step, rank))
            nn.functional.mse_loss(model(x), y).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for parameter, each in zip(model.parameters(), zip(*grads, strict=True), strict=True):
            parameter.grad = torch.stack(each).mean(dim=0)
        optimizer.step()
    return [p.detach() for p in model.parameters()]
