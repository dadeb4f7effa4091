"""The restart policy, in one place: a failed run (exit 1) is run again, up to RESTARTS times,
once its backend has the next run ready (launch.backends); over SSH that means every node
answers again (wait_for_nodes)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from torch_multinode.cluster.errors import UserError
from torch_multinode.cluster.execution import Nodes, SshNodes
from torch_multinode.cluster.inventory import Host, Inventory
from torch_multinode.cluster.remote import on_all
from torch_multinode.launch.spec import RESTART_POLL, Emit, JobResult, JobSpec

if TYPE_CHECKING:
    from torch_multinode.launch.backends import Backend


def wait_for_nodes(
    inventory: Inventory,
    wait: float,
    emit: Emit = print,
    nodes: Nodes | None = None,
    poll: float = RESTART_POLL,
) -> float:
    """Until every host of the (narrowed) inventory answers over SSH (a command run, not only a
    port open): the seconds that took. A host that never answers within `wait` seconds is a
    UserError naming it and why."""
    nodes = nodes or SshNodes(inventory)
    started = time.monotonic()
    missing = {host.name: host for host in inventory.hosts}
    silent: dict[str, str] = {}  # host name -> why its last probe failed
    # A node that booted again answers over SSH a moment before its Docker engine does.
    command = (
        "docker info >/dev/null 2>&1 || { echo 'its Docker engine does not answer yet'; exit 1; }"
        if inventory.launch_mode == "container"
        else "true"
    )

    def probe(host: Host) -> str | None:
        try:
            with nodes.session(host) as remote:
                remote.run(command, timeout=10, check=True)
            return None
        except UserError as exc:
            return str(exc)

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
        if not missing:
            return time.monotonic() - started
        if time.monotonic() - started >= wait:
            name = next(iter(missing))
            raise UserError(
                f"{', '.join(missing)} did not answer within --restart-wait {wait:g} s: "
                f"{silent[name]}",
                hint="bringing the node back, then running the job again (it resumes from its "
                "checkpoints)",
                exit_code=1,
            )
        time.sleep(poll)


def run_with_restarts(
    backend: Backend, spec: JobSpec, restarts: int = 0, emit: Emit = print
) -> JobResult:
    """The job on `backend`, run again after a failure up to `restarts` times, each time once
    the backend has the next run ready (every node answers again, or Slurm requeued it). Each
    run's result says which restart it was; the node logs go on in the same files. Ctrl-C,
    SIGTERM and refusals are never restarted."""
    attempt = spec
    for restart in range(restarts + 1):
        result = backend.attempt(attempt, restarts - restart)
        result.restart, result.restarts = restart, restarts
        backend.ended(attempt, result)
        if result.exit_code != 1 or restart == restarts or not backend.can_restart():
            return result
        for line in backend.summary(result):
            emit(line)
        attempt = backend.before_restart(spec, attempt, restart + 1, restarts)
    raise AssertionError("unreachable")  # the loop returns on its last turn
