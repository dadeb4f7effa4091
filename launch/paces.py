"""The straggler watch's reader, a watcher of the running job in a thread of its own: every
node's ranks' waits in collectives (training.distributed.waits writes them in the run
directory), read every stragglers.PACE_INTERVAL seconds and given to launch.stragglers, which
judges them. Over SSH and under Slurm alike (the launcher's skeleton, launch.job, starts it)."""

from __future__ import annotations

import threading

from torch_multinode.cluster.errors import UserError
from torch_multinode.cluster.execution import Session, close_quietly
from torch_multinode.cluster.inventory import Host
from torch_multinode.launch import stragglers
from torch_multinode.launch.commands import run_dir
from torch_multinode.launch.running import RunningJob

TIMEOUT = 10  # seconds a node gets to print its ranks' waits


def watcher(job: RunningJob, watch: stragglers.Stragglers) -> list[threading.Thread]:
    """The reader of the ranks' waits (`read`, not started): none for one node, where there is
    nothing to compare."""
    if len(job.hosts) < 2:
        return []
    return [threading.Thread(target=read, args=(job, watch), daemon=True)]


def read(job: RunningJob, watch: stragglers.Stragglers) -> None:
    """Every node's ranks' waits in collectives, read every PACE_INTERVAL seconds (over a
    session per node, kept) and given to the straggler watch; a node that does not answer is
    skipped (the liveness watcher's business)."""
    command = stragglers.pace_command(run_dir(job.spec))
    remotes: dict[str, Session] = {}

    def read_node(host: Host, texts: list[str]) -> None:
        remote = remotes.get(host.name)
        try:
            if remote is None:
                remote = job.session(host)
                remotes[host.name] = remote
                remote.connect()
            texts.append(remote.run(command, timeout=TIMEOUT).stdout)
        except UserError:
            close_quietly(remotes.pop(host.name, None))  # connected afresh next time

    try:
        while not job.done.wait(stragglers.PACE_INTERVAL):
            texts: list[str] = []
            threads = [
                threading.Thread(target=read_node, args=(host, texts), daemon=True)
                for host in job.hosts
                if job.outcomes[host.name].exit_code is None
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(TIMEOUT + 15)
            if not job.done.is_set():
                watch.paces(stragglers.parse_paces(texts))
    finally:
        for remote in remotes.values():
            close_quietly(remote)
