"""The restart policy, in one place: a failed run (exit 1) is run again, up to RESTARTS times,
once its backend has the next run ready (launch.backends); over SSH that means every node
answers again (wait_for_nodes), or, with spares or MIN_NODES below the job's node count, the
nodes that answer within the wait, a spare in each lost node's place (survivors); under Slurm a
requeue of the same job, or with spares or MIN_NODES, once a node is lost (its slurmd silent
too), a new job on the survivors. Which nodes answer, and which survive, is launch.survivors'."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

from torch_multinode.cluster.errors import UserError, positive_number, whole_number
from torch_multinode.cluster.execution import Nodes
from torch_multinode.cluster.inventory import Host, Inventory
from torch_multinode.launch.nodes import nproc_for
from torch_multinode.launch.record import last_step_number
from torch_multinode.launch.spec import DEFAULT_RESTART_WAIT, Emit, JobResult, JobSpec
from torch_multinode.launch.survivors import survivors


class Backend(Protocol):
    """What the restart loop (run_with_restarts) asks of a way to run a job; launch.backends
    has the three (SSH, Slurm, this machine), and this module imports none of them."""

    restart_note: str
    """How a restart happens, for the job's first lines."""

    @property
    def started(self) -> Callable[[], None]:
        """Called as each run has begun (the run's record takes the code then: launch.record).
        Read-only here: a backend's own field, which nothing outside it sets."""

    def attempt(self, spec: JobSpec, restarts_left: int) -> JobResult:
        """One run of the job, to its end (its own summary not yet said)."""

    def ended(self, spec: JobSpec, result: JobResult) -> None:
        """After each run: what it left to bring back (the master's run directory)."""

    def can_restart(self) -> bool:
        """Whether a failed run can be run again at all."""

    def before_restart(
        self, first: JobSpec, failed: JobSpec, restart: int, restarts: int
    ) -> JobSpec:
        """Until the next run may start: the spec it runs with."""

    def summary(self, result: JobResult) -> list[str]:
        """Why a run ended as it did (after each failed run that is restarted, and at the end)."""

    def closing(self, result: JobResult) -> list[str]:
        """Where the job's logs and run directory are, once it is over."""


def add_options(parser: argparse.ArgumentParser) -> None:
    """The launcher's restart options: --restarts, --restart-wait, --min-nodes."""
    parser.add_argument(
        "--restarts",
        type=whole_number(0),
        default=0,
        help="after a failure (a node died, a rank crashed, the network was cut), wait for every "
        "node to answer over SSH again and start the job again, up to this many times; a node "
        "still silent after --restart-wait is replaced by a host of the inventory beyond "
        "--nnodes where there is one (see --min-nodes); the training workloads resume from "
        "--checkpoint-dir (default: %(default)s)",
    )
    parser.add_argument(
        "--restart-wait",
        type=positive_number("number of seconds"),
        default=DEFAULT_RESTART_WAIT,
        help="seconds a restart waits for every node to answer (default: %(default)g)",
    )
    parser.add_argument(
        "--min-nodes",
        type=whole_number(1),
        default=None,
        help="with --restarts: a node still silent after --restart-wait, and with no spare to "
        "take its place (a host of the inventory beyond --nnodes, taken first), is dropped, "
        "and the job goes on on the others as long as at least this many remain; the workloads "
        "keep the first run's global batch (default: every node of the job)",
    )


def check_local(restarts: int, min_nodes: int | None) -> None:
    """A job without an inventory has no node to wait for or lose: refused."""
    if restarts:
        raise UserError(
            f"--restarts={restarts} needs an inventory: a local job has no node to wait for",
            hint="INVENTORY=path.yml",
        )
    if min_nodes is not None:
        raise UserError(
            f"--min-nodes={min_nodes} needs an inventory: a local job has no node to lose",
            hint="INVENTORY=path.yml",
        )


def check_min_nodes(
    min_nodes: int | None, restarts: int, inventory: Inventory, ft: bool = False
) -> None:
    """--min-nodes against the job: it needs restarts (or FT=1, whose quorum's minimum it is),
    and no more nodes than the job has."""
    if min_nodes is None:
        return
    count = len(inventory.hosts)
    if min_nodes > count:
        raise UserError(
            f"--min-nodes={min_nodes} (MIN_NODES) but the job runs on {count} node(s)",
            hint=f"MIN_NODES={count} or fewer",
        )
    if not restarts and not ft:
        raise UserError(
            f"--min-nodes={min_nodes} (MIN_NODES) acts on a restart, and --restarts is 0",
            hint="RESTARTS=1 or more, or FT=1",
        )


class LostNodes:
    """What a restart does with a node lost for good, for the backends that run a job on the
    inventory's nodes (SSH, Slurm): with `spares` (inventory hosts the job does not use) or
    `min_nodes` below the job's node count, a node still silent after the wait is replaced by a
    spare, or dropped while at least `min_nodes` remain (survivors), the next run keeping the
    first run's world size. A backend holds one, made from its first run's nodes, and hands it
    what it runs on now at each restart: the policy keeps its own state and knows no backend.
    `also`: the shell checks a node must pass besides answering (a backend's own: answering)."""

    def __init__(
        self,
        inventory: Inventory,
        spec: JobSpec,
        restart_wait: float,
        spares: tuple[Host, ...] = (),
        min_nodes: int | None = None,
        also: tuple[str, ...] = (),
    ) -> None:
        count = len(inventory.hosts)
        self.spares = spares
        self.min_nodes = count if min_nodes is None else min_nodes
        self.also = also
        self.planned_world = sum(nproc_for(host, spec) for host in inventory.hosts)
        self.changed: list[str] = []  # what became of each lost node, restart after restart
        self.flexible = self.min_nodes < count or bool(spares)
        self.note = self._note(count, restart_wait)  # said once, in the job's first lines

    def _note(self, count: int, restart_wait: float) -> str:
        """The restart note's part about lost nodes ("" when a restart waits for every node of
        the job)."""
        if not self.flexible:
            return ""
        spare = f"a spare of {len(self.spares)} in a lost node's place" if self.spares else ""
        fewer = f"at least {self.min_nodes} of {count} nodes" if self.min_nodes < count else ""
        return (
            f"the nodes that answer within --restart-wait {restart_wait:g} s ("
            + "; ".join(filter(None, [spare, fewer]))
            + ")"
        )

    def survivors(
        self,
        inventory: Inventory,
        failed: JobSpec,
        restart: int,
        restart_wait: float,
        emit: Emit,
        nodes: Nodes | None,
    ) -> tuple[Inventory, float]:
        """The job's nodes (now `inventory`) for restart `restart`, lost ones replaced or
        dropped and said; the seconds the wait took."""
        step = last_step_number(failed.log_dir)
        after = f" after step {step}" if step is not None else ""
        found = survivors(
            inventory,
            list(self.spares),
            self.min_nodes,
            restart_wait,
            emit,
            nodes,
            after=f" at restart {restart}{after}",
            also=self.also,
        )
        for change in found.changes:
            emit(f"[launcher] {change}")
        self.changed += found.changes
        self.spares = tuple(found.spares)
        return replace(inventory, hosts=tuple(found.hosts)), found.waited

    def next_spec(self, inventory: Inventory, first: JobSpec, restart: int) -> JobSpec:
        """The next run's spec, on the nodes of `inventory`: its own run ID and, on another
        world size than the first run's, that world (TMN_PLANNED_WORLD_SIZE: the workloads keep
        its global batch)."""
        world = sum(nproc_for(host, first) for host in inventory.hosts)
        return replace(
            first,
            run_id=f"{first.run_id}-r{restart}",
            planned_world=self.planned_world if world != self.planned_world else None,
        )

    def restart_line(
        self, inventory: Inventory, attempt: JobSpec, restart: int, restarts: int, waited: float
    ) -> str:
        """What the launcher says as the restart on the nodes of `inventory` begins."""
        answers = "every node answers" if not self.changed else "the nodes answer"
        return (
            f"[launcher] job {attempt.run_id}: {answers} (waited {waited:.0f} s); "
            f"restart {restart} of {restarts}"
            + (
                f" on {len(inventory.hosts)} node(s), keeping the first run's world of "
                f"{self.planned_world} process(es)"
                if attempt.planned_world
                else ""
            )
        )


def run_with_restarts(
    backend: Backend, spec: JobSpec, restarts: int = 0, emit: Emit = print
) -> JobResult:
    """The job on `backend`, run again after a failure up to `restarts` times, each time once
    the backend has the next run ready (every node answers again, or Slurm requeued it). Each
    run's result says which restart it was; the node logs go on in the same files. Ctrl-C,
    SIGTERM and refusals are never restarted. A restart that cannot go on (too few nodes
    answer, a refusal, Ctrl-C during the wait) ends the job with its error after the failed
    run's summary and where its logs are; anything else that escapes is a bug and keeps its
    traceback, said after them too."""
    attempt, failed = spec, None
    try:
        for restart in range(restarts + 1):
            result = backend.attempt(attempt, restarts - restart)
            result.restart, result.restarts = restart, restarts
            backend.ended(attempt, result)
            if result.exit_code != 1 or restart == restarts or not backend.can_restart():
                return result
            for line in backend.summary(result):
                emit(line)
            failed = result
            attempt = backend.before_restart(spec, attempt, restart + 1, restarts)
    except BaseException:
        if failed is not None:  # its summary was said: where the failed run's logs are
            for line in backend.closing(failed):
                emit(line)
        raise
    raise AssertionError("unreachable")  # the loop returns on its last turn
