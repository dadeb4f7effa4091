"""Stopping a job on every node."""

from __future__ import annotations

import threading
import time

from torch_multinode.cluster.errors import UserError
from torch_multinode.cluster.inventory import Host
from torch_multinode.launch.commands import stop_command, unlock_command
from torch_multinode.launch.running import RunningJob
from torch_multinode.launch.spec import LOST_NODE_PROBE, STOP_TIMEOUT


def everywhere(job: RunningJob, master: Host | None = None) -> dict[str, float | str]:
    """Kill the run's processes on every node that still answers, in parallel, one SSH
    session each; on `master` the same session frees the rendezvous port. Per node: the
    seconds its stop took, or why it was not confirmed."""
    job.stopping.set()
    stopped: dict[str, float | str] = {
        h.name: f"not confirmed within {STOP_TIMEOUT:g} s" for h in job.hosts
    }
    unlock = unlock_command(job.spec.run_id, job.rendezvous_port)
    started = time.monotonic()

    def stop(host: Host) -> None:
        on_master = master is not None and host.name == master.name
        command = stop_command(job.spec.run_id, then=unlock if on_master else "")
        if job.outcomes[host.name].lost and not job.nodes.answers(host, LOST_NODE_PROBE):
            job.silent.add(host.name)
            stopped[host.name] = "unreachable"
            return
        with job.session(host) as remote:
            try:
                remote.connect()
            except UserError:
                stopped[host.name] = "unreachable"
                return
            try:
                remote.run(command, timeout=STOP_TIMEOUT, check=True)
                stopped[host.name] = time.monotonic() - started
            except UserError:
                pass  # not confirmed: the command failed or outlasted its limit

    threads = [threading.Thread(target=stop, args=(h,), daemon=True) for h in job.hosts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(0.0, started + STOP_TIMEOUT + 2 - time.monotonic()))
    return dict(stopped)


def said(stopped: dict[str, float | str]) -> str:
    """The launcher's line of what `everywhere` found: each node's stop time, or why not."""
    return "[launcher] stopped: " + ", ".join(
        f"{name} in {done:.1f} s" if isinstance(done, float) else f"{name} {done}"
        for name, done in stopped.items()
    )
