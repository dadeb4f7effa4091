"""Which nodes a restart runs on (launch.restarts' policy asks): every node of the job waited
for until it answers over SSH (answering, wait_for_nodes), or, with spares or MIN_NODES, the
nodes that answer within the wait, a spare in each lost node's place and a node that cannot
reach the master's compute IP dropped (survivors); too few is a UserError naming the lost
nodes."""

from __future__ import annotations

import time
from dataclasses import dataclass

from torch_multinode.cluster.errors import UserError
from torch_multinode.cluster.execution import Nodes, SshNodes
from torch_multinode.cluster.inventory import Host, Inventory
from torch_multinode.cluster.remote import on_all
from torch_multinode.launch.commands import link_probe_command
from torch_multinode.launch.spec import RESTART_POLL, Emit


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
