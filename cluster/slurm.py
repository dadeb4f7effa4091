"""Slurm's queue, seen and changed from the controller, on an inventory with scheduler: slurm:
squeue and scancel run on the first node (Slurm's controller), over SSH."""

from __future__ import annotations

import shlex

from torch_multinode.cluster.errors import UserError
from torch_multinode.cluster.execution import Nodes
from torch_multinode.cluster.inventory import Inventory

QUEUE_TIMEOUT = 30.0
# One line per job: id|name|user|state|elapsed|nodes|where it runs, or why it waits.
SQUEUE = "squeue --noheader --format '%i|%j|%u|%T|%M|%D|%R'"
HEADER = ("JOB", "NAME", "USER", "STATE", "TIME", "NODES", "NODELIST (REASON)")


def require(inventory: Inventory) -> None:
    if inventory.scheduler != "slurm":
        raise UserError(
            f"inventory {inventory.path} does not use Slurm (scheduler: {inventory.scheduler}): "
            "there is no queue",
            hint="scheduler: slurm in the inventory, then make provision",
        )


def queue(inventory: Inventory, nodes: Nodes) -> list[str]:
    """The queue as a table, one line per job, or one line saying it is empty."""
    require(inventory)
    master = inventory.master
    answer = nodes.run(master, SQUEUE, QUEUE_TIMEOUT)
    if not answer.ok:
        raise UserError(
            f"Slurm's controller on {master.name} does not answer squeue: "
            f"{answer.last_line or 'no output'}",
            hint=f"make netcheck INVENTORY={inventory.path}, which names what is wrong",
            exit_code=1,
        )
    rows = [line.split("|", 6) for line in answer.stdout.splitlines() if line.count("|") >= 6]
    if not rows:
        return [f"No jobs in Slurm's queue on {master.name}."]
    table = [HEADER, *rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(HEADER) - 1)]
    return [
        "  ".join([*(cell.ljust(w) for cell, w in zip(row[:-1], widths, strict=True)), row[-1]])
        for row in table
    ]


def cancel(inventory: Inventory, nodes: Nodes, job: str) -> str:
    """Cancel Slurm job `job`; what happened, in one line."""
    require(inventory)
    if not job.isdigit():
        raise UserError(f"JOB={job!r} is not a Slurm job ID", hint="a number from make queue")
    master = inventory.master
    answer = nodes.run(master, f"scancel --verbose {shlex.quote(job)}", QUEUE_TIMEOUT)
    said = (answer.stderr.strip() or answer.stdout.strip()).splitlines()
    if not answer.ok or any("error" in line.lower() for line in said):
        reason = said[-1].removeprefix("scancel: error: ") if said else f"exit {answer.exit_code}"
        raise UserError(
            f"Slurm did not cancel job {job}: {reason}",
            hint="make queue, for the jobs there are",
            exit_code=1,
        )
    return f"Cancelled Slurm job {job} on {master.name}'s controller."
