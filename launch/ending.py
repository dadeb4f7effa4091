"""How a job ends: the summary, node by node, with the failed node's own last lines, and the
master's run directory brought back."""

from __future__ import annotations

import re

from cluster import staging
from cluster.inventory import Host, Inventory
from launch.commands import run_dir
from launch.spec import EXCERPT_LINES, Emit, JobResult, JobSpec


def summary(result: JobResult, hosts: tuple[Host, ...]) -> list[str]:
    """What happened, node by node; for a failed node, its last lines."""
    verdict = (
        ("terminated (SIGTERM)" if result.terminated else "interrupted")
        if result.interrupted
        else "succeeded"
        if result.exit_code == 0
        else f"FAILED on {result.failed_node}"
    )
    lines = [
        f"Job {result.run_id} {verdict} after {result.seconds:.1f} s on {len(hosts)} node(s)"
        + (f", restart {result.restart} of {result.restarts}." if result.restart else ".")
    ]
    for host in hosts:
        outcome = result.outcomes[host.name]
        state = (
            outcome.error
            if outcome.error
            else "stopped"
            if outcome.exit_code is None
            else f"exit {outcome.exit_code}"
        )
        if outcome.link_down and not (outcome.error or "").startswith("lost:"):
            state += f"; {outcome.link_down}"
        lines.append(f"  {host.name:<12} {state}")
    if result.failed_node and not result.interrupted:
        excerpt = failure_excerpt(list(result.outcomes[result.failed_node].tail))
        if excerpt:
            lines.append(f"Last lines from {result.failed_node}:")
            lines += [f"  | {line}" for line in excerpt]
    return lines


def bring_back(
    inventory: Inventory, master: Host, spec: JobSpec, result: JobResult, emit: Emit
) -> None:
    """The master's run directory into the job's log directory, after a job that ended by
    itself (successful or not); after Ctrl-C or SIGTERM the user wants it stopped now, so only
    how to fetch it is said."""
    if spec.log_dir is None:
        return
    where = f"{master.name}:{run_dir(spec)}"
    if result.interrupted:
        result.brought_back = f"not copied (interrupted): it stays in {where}"
        return
    if result.outcomes[master.name].lost:
        result.brought_back = f"not copied: {master.name} was lost"
        return
    files, problem = staging.fetch_run_dir(inventory, master, run_dir(spec), spec.log_dir)
    if problem is None:
        result.brought_back = f"{files} file(s) from {where}"
    else:
        result.brought_back = f"not copied from {where}: {problem}"
        emit(f"[launcher] the run directory {where} was {result.brought_back}")


def failure_excerpt(lines: list[str], limit: int = EXCERPT_LINES) -> list[str]:
    """The worker's last words, not torchrun's: a failed torchrun ends with its own traceback
    (ChildFailedError) and a report; what the worker said comes just before them."""
    cut = len(lines)
    for index in range(len(lines) - 1, -1, -1):
        if lines[index].lstrip().startswith("Traceback (most recent call last):") and any(
            "ChildFailedError" in line for line in lines[index:]
        ):
            cut = index
            break
    report = [
        line.strip() for line in lines[cut:] if re.match(r"\s*(host|rank|exitcode)\s*:", line)
    ]
    window = lines[max(0, cut - limit) : cut]
    # The worker's own one-line error can be followed by a C++ abort's stack (gloo, NCCL) longer
    # than the window; that line says what to do, so it is kept, ahead of the stack's end.
    errors = [line for line in lines[: max(0, cut - limit)] if _WORKER_ERROR.match(line)]
    if errors and not any(_WORKER_ERROR.match(line) for line in window):
        window = [errors[-1], "..."] + window[-(limit - 2) :]
    return window + report


_WORKER_ERROR = re.compile(r"\s*(\[rank\d+\]:\s*)?Error: ")
