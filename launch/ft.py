"""FT=1 at the command line (`--ft`, make's FT=1): the flag, what it accepts of the rest of the
job (checked before any node is touched), and what the job's first lines say of it. The run
itself, each node one replica group: launch.replicated."""

from __future__ import annotations

import argparse
from dataclasses import replace

from torch_multinode.cluster.errors import UserError
from torch_multinode.cluster.inventory import Host
from torch_multinode.launch.spec import DEFAULT_RESTART_WAIT, JobSpec

# The workloads of ours that take FT=1 (a user's own script gets the environment and decides).
WORKLOADS = ("training.ddp", "training.fsdp")


def add_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ft",
        action="store_true",
        help="per-step fault tolerance (torchft): each node is one replica group with its own "
        "torchrun; a node that dies is dropped at the next step and the others go on, with "
        "fewer samples per step while it is out (at least --min-nodes groups, default 1); the "
        "lighthouse runs on this machine on the inventory's lighthouse_port",
    )


def check(
    ft: bool,
    spec: JobSpec,
    scheduler: str | None,
    restarts: int,
    min_nodes: int | None,
    restart_wait: float = DEFAULT_RESTART_WAIT,
) -> JobSpec:
    """FT=1 against the rest of the job (`scheduler` None: no inventory): the job's spec with
    its replica groups' settings (RESTARTS: a lost group's, started again in the same job), or
    one error line."""
    if not ft:
        return spec
    if scheduler is None:
        raise UserError(
            "FT=1 needs an inventory: its replica groups are nodes",
            hint="INVENTORY=path.yml, or 'make sim-up' for a simulated cluster",
        )
    if scheduler == "slurm":
        raise UserError(
            "FT=1 runs over SSH, not under Slurm: each node's group would need a job step of "
            "its own that Slurm does not end with another's, and the lighthouse a place outside "
            "the allocation",
            hint="scheduler: ssh for FT=1, or RESTARTS=N with --checkpoint-dir under Slurm",
        )
    if spec.script is None and spec.module not in WORKLOADS:
        raise UserError(
            f"FT=1 runs {', '.join(WORKLOADS)} or your own script, not {spec.module}",
            hint="MODULE=training.ddp (or training.fsdp), or without FT=1 RESTARTS=N",
        )
    return replace(
        spec,
        fault_tolerant=True,
        min_groups=min_nodes or 1,
        group_restarts=restarts,
        restart_wait=restart_wait,
    )


def describe(count: int, min_groups: int) -> str:
    """An FT=1 job's first line about its groups, and what a loss does to the batch."""
    return (
        f"FT=1: {count} replica groups, one per node (torchft): a group lost is dropped at the "
        f"next step and the others go on while at least {min_groups} are left; while one is "
        "out each step sees fewer samples (the planned share of the groups that train it), "
        "its gradients averaged over them"
    )


def restart_note(spec: JobSpec, spares: tuple[Host, ...] = ()) -> str:
    where = f"on a spare at once ({', '.join(h.name for h in spares)}), then " if spares else ""
    return (
        f"up to {spec.group_restarts} restart(s) of a lost group: {where}once its node answers "
        f"again (within --restart-wait {spec.restart_wait:g} s), its group starts again and "
        "heals from a live peer; the others never stop"
    )
