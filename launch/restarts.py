"""The restart policy, in one place: a failed run (exit 1) is run again, up to RESTARTS times,
once its backend has the next run ready (launch.backends); over SSH that means every node
answers again (wait_for_nodes), or, with spares or MIN_NODES below the job's node count, the
nodes that answer within the wait, a spare in each lost node's place (survivors); under Slurm a
requeue of the same job, or with spares or MIN_NODES, once a node is lost (its slurmd silent
too), a new job on the survivors."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

from torch_multinode.cluster.errors import UserError, positive_number, whole_number
from torch_multinode.cluster.execution import Nodes, SshNodes
from torch_multinode.cluster.inventory import Host, Inventory
from torch_multinode.cluster.remote import on_all
from torch_multinode.launch.commands import link_probe_command
from torch_multinode.launch.nodes import nproc_for
from torch_multinode.launch.record import last_step_number
from torch_multinode.launch.spec import (
    DEFAULT_RESTART_WAIT,
    RESTART_POLL,
    Emit,
    JobResult,
    JobSpec,
)


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


def check_min_nodes(min_nodes: int | None, restarts: int, inventory: Inventory) -> None:
    """--min-nodes against the job: it needs restarts, and no more nodes than the job has."""
    if min_nodes is None:
        return
    count = len(inventory.hosts)
    if min_nodes > count:
        raise UserError(
            f"--min-nodes={min_nodes} (MIN_NODES) but the job runs on {count} node(s)",
            hint=f"MIN_NODES={count} or fewer",
        )
    if not restarts:
        raise UserError(
            f"--min-nodes={min_nodes} (MIN_NODES) acts on a restart, and --restarts is 0",
            hint="RESTARTS=1 or more",
        )


def answering(
    inventory: Inventory,
    hosts: list[Host],
    wait: float,
    emit: Emit = print,
    nodes: Nodes | None = None,
    poll: float = RESTART_POLL,
    also: tuple[str, ...] = (),
) -> tuple[list[Host], dict[str, str], float]:
    """Until every one of `hosts` answers over SSH (a command run, not only a port open; in
    container mode its Docker engine too; and each shell check of `also`, a backend's own, such
    as Slurm's slurmd), or `wait` seconds have passed (0: one look): those that answer in their
    order, why each other one's last probe failed, and the seconds taken."""
    nodes = nodes or SshNodes(inventory)
    started = time.monotonic()
    missing = {host.name: host for host in hosts}
    silent: dict[str, str] = {}  # host name -> why its last probe failed
    # A node that booted again answers over SSH a moment before its Docker engine does.
    checks = ["true"]
    if inventory.launch_mode == "container":
        checks.append(
            "docker info >/dev/null 2>&1 || { echo 'its Docker engine does not answer yet'; exit 1; }"
        )
    checks += also
    command = " && ".join(checks)

    def probe(host: Host) -> str | None:
        try:
            with nodes.session(host) as remote:
                said = remote.run(command, timeout=10)
        except UserError as exc:
            return str(exc)
        if said.ok:
            return None
        # what the check said (the engine, slurmd), not the whole command line
        return f"host '{host.name}': {said.last_line or f'its check exited {said.exit_code}'}"

    while True:
        for name, error in on_all(list(missing.values()), probe).items():
            if error is None:
                del missing[name]
                if name in silent:
                    emit(
                        f"[launcher] {name} answers again after {time.monotonic() - started:.0f} s"
                    )
                    del silent[name]
            else:
                silent[name] = error
        elapsed = time.monotonic() - started
        if not missing or elapsed >= wait:
            found = [host for host in hosts if host.name not in missing]
            return found, {name: silent[name] for name in missing}, time.monotonic() - started
        time.sleep(min(poll, wait - elapsed))


def wait_for_nodes(
    inventory: Inventory,
    wait: float,
    emit: Emit = print,
    nodes: Nodes | None = None,
    poll: float = RESTART_POLL,
) -> float:
    """Until every host of the (narrowed) inventory answers over SSH: the seconds that took. A
    host that never answers within `wait` seconds is a UserError naming it and why."""
    _, silent, waited = answering(inventory, list(inventory.hosts), wait, emit, nodes, poll)
    if silent:
        raise _not_enough(silent, wait)
    return waited


def _not_enough(silent: dict[str, str], wait: float, more: str = "") -> UserError:
    """One line naming every silent node and why each last probe failed (a reason that does
    not name its node is prefixed with it); `silent` is never empty."""
    reasons = "; ".join(
        why if why.startswith(f"host '{name}'") else f"{name}: {why}"
        for name, why in silent.items()
    )
    return UserError(
        f"{', '.join(silent)} did not answer within --restart-wait {wait:g} s{more}: {reasons}",
        hint="bringing the node back, then running the job again (it resumes from its checkpoints)",
        exit_code=1,
    )


def _unlinked(inventory: Inventory, hosts: list[Host], nodes: Nodes | None) -> dict[str, str]:
    """The hosts after the first that do not reach the first's compute IP (one ping each, all
    at once), each with what the ping said; a node without ping counts as reaching it. Fewer
    than two hosts: nothing to probe."""
    if len(hosts) < 2:
        return {}
    nodes = nodes or SshNodes(inventory)
    master, others = hosts[0], hosts[1:]
    command = link_probe_command(str(master.compute_ip))

    def probe(host: Host) -> str:
        try:
            return nodes.run(host, command, 10).stdout.strip()
        except UserError as exc:
            return f"down ({exc})"

    said = on_all(others, probe) if others else {}
    return {name: answer for name, answer in said.items() if answer.startswith("down")}


@dataclass(frozen=True)
class Survivors:
    """The nodes a restart runs on: each lost node replaced by a spare that answers, in its
    place in the rank order, or dropped while at least `min_nodes` remain."""

    hosts: list[Host]
    spares: list[Host]  # the spares still unused
    changes: list[str]  # what became of each lost node, said and kept in the job's summary
    waited: float


def survivors(
    inventory: Inventory,
    spares: list[Host],
    min_nodes: int,
    wait: float,
    emit: Emit = print,
    nodes: Nodes | None = None,
    poll: float = RESTART_POLL,
    after: str = "",
    also: tuple[str, ...] = (),
) -> Survivors:
    """The job's nodes for its next run (see Survivors): a node silent for `wait` seconds is
    lost; spares get one look each. Fewer than `min_nodes` is a UserError naming the lost nodes.
    `after` says where the failed run had got to, for the changes' lines; `also`: see answering."""
    hosts = list(inventory.hosts)
    found, silent, waited = answering(inventory, hosts, wait, emit, nodes, poll, also)
    if not silent:
        return Survivors(hosts, list(spares), [], waited)
    ready: list[Host] = []
    if spares:
        ready, _, _ = answering(inventory, list(spares), 0, emit, nodes, poll, also)
    changes, chosen = [], []
    for host in hosts:
        if host.name not in silent:
            chosen.append(host)
        elif ready:
            spare = ready.pop(0)
            chosen.append(spare)
            changes.append(f"{host.name} lost{after}: replaced by spare {spare.name}")
        else:
            changes.append(f"{host.name} lost{after}: dropped")
    # Too few before the link probe too: with no node left there is no master to ping (an
    # IndexError once, issue 49, when every node stayed silent for the whole wait).
    _enough(chosen, min_nodes, silent, wait)
    # The compute link: each chosen node reaches the (new) master's compute IP, as the job's
    # rendezvous will have to; one that cannot is dropped like a silent one. The master itself
    # is never dropped here, so chosen[0] stays the one the others were probed against.
    master = chosen[0]
    for name, why in _unlinked(inventory, chosen, nodes).items():
        chosen = [host for host in chosen if host.name != name]
        changes.append(f"{name} cannot reach {master.name}'s compute IP ({why}): dropped")
        silent[name] = f"its compute link is {why}"
    _enough(chosen, min_nodes, silent, wait)
    used = {host.name for host in chosen}
    left = [spare for spare in spares if spare.name not in used]
    if len(chosen) < len(hosts):
        changes.append(
            f"continuing on {', '.join(h.name for h in chosen)}: {len(chosen)} of "
            f"{len(hosts)} nodes (--min-nodes {min_nodes})"
        )
    return Survivors(chosen, left, changes, waited)


def _enough(chosen: list[Host], min_nodes: int, silent: dict[str, str], wait: float) -> None:
    """A UserError naming the lost nodes when fewer than `min_nodes` (and at least one) are
    left for the next run."""
    if not chosen:
        raise _not_enough(silent, wait, " (no node of the job is left to run it on)")
    if len(chosen) < min_nodes:
        raise _not_enough(
            silent, wait, f" and {len(chosen)} node(s) are fewer than --min-nodes {min_nodes}"
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
