"""A job with restarts: after a failure, wait until every node answers over SSH again, stop what
the failed run left, and start it again."""

from __future__ import annotations

import time
from dataclasses import replace

from torch_multinode.cluster.errors import UserError
from torch_multinode.cluster.execution import Nodes, SshNodes
from torch_multinode.cluster.inventory import Host, Inventory
from torch_multinode.cluster.remote import on_all
from torch_multinode.launch import staging, stop
from torch_multinode.launch.ending import bring_back, summary
from torch_multinode.launch.job import Launcher
from torch_multinode.launch.spec import DEFAULT_RESTART_WAIT, RESTART_POLL, Emit, JobResult, JobSpec
from torch_multinode.launch.staging import Project


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


def run_job(
    inventory: Inventory,
    spec: JobSpec,
    emit: Emit = print,
    restarts: int = 0,
    restart_wait: float = DEFAULT_RESTART_WAIT,
    project: Project | None = None,
    nodes: Nodes | None = None,
) -> JobResult:
    """The job, started again after a failure up to `restarts` times, each time once every node
    answers again (for at most `restart_wait` seconds). Each run has its own run ID (the first
    one's with -r1, -r2...) and rendezvous; the node logs go on in the same files. Before a
    restart, whatever the failed run left (on a node that was cut off rather than down) is
    stopped and its rendezvous port freed. Ctrl-C and refusals are never restarted."""
    if project is None:
        project = staging.plan(inventory, spec.script, spec.workdir, spec.workdir_limit)
    nodes = nodes or SshNodes(inventory)
    attempt = spec
    for restart in range(restarts + 1):
        result = Launcher(inventory, attempt, emit, project=project, nodes=nodes).run()
        result.restart, result.restarts = restart, restarts
        bring_back(inventory, inventory.master, attempt, result, emit)
        if result.exit_code != 1 or restart == restarts:
            return result
        for line in summary(result, inventory.hosts):
            emit(line)
        emit(
            f"[launcher] restart {restart + 1} of {restarts}: waiting up to {restart_wait:g} s "
            "for every node to answer..."
        )
        waited = wait_for_nodes(inventory, restart_wait, emit, nodes)
        stop.everywhere(Launcher(inventory, attempt, emit, nodes=nodes), inventory.master)
        attempt = replace(spec, run_id=f"{spec.run_id}-r{restart + 1}")
        emit(
            f"[launcher] job {attempt.run_id}: every node answers (waited {waited:.0f} s); "
            f"restart {restart + 1} of {restarts}"
        )
    raise AssertionError("unreachable")  # the loop returns on its last turn
