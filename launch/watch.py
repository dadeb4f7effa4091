"""The watchers of a running job, each in a thread of its own: a node that stops answering over
SSH, and a node that cannot reach the master over the compute network, fail the job."""

from __future__ import annotations

import collections
import time
from typing import TYPE_CHECKING

from cluster.errors import UserError
from cluster.inventory import Host
from launch.blame import cut_off
from launch.commands import link_probe_command
from launch.spec import LINK_PROBE_INTERVAL, LINK_PROBE_WAIT, LIVENESS_FAILURES, LIVENESS_INTERVAL

if TYPE_CHECKING:
    from launch.job import Launcher


def liveness(job: Launcher) -> None:
    """A node that stops answering is failed within a few seconds, not at TCP's leisure."""
    misses = collections.Counter()
    while not job.done.wait(LIVENESS_INTERVAL):
        for host in job.hosts:
            if job.outcomes[host.name].exit_code is not None:
                continue
            if job.nodes.answers(host, 2):
                misses[host.name] = 0
            else:
                misses[host.name] += 1
                if misses[host.name] >= LIVENESS_FAILURES:
                    outcome = job.outcomes[host.name]
                    outcome.error = f"stopped answering on {host.ssh_address}:{host.ssh_port}"
                    outcome.unreachable = True
                    job.fail(host.name)
                    return


def link(job: Launcher, host: Host, master: Host) -> None:
    """Ping the master's compute IP from `host`, over an SSH session of its own; a link
    down for --network-timeout seconds fails `host`. Only a link seen up during this job
    can go down: where ICMP is blocked from the start, the check stays silent."""
    target = f"{master.name} ({master.compute_ip})"
    command = link_probe_command(str(master.compute_ip))
    outcome, down_since, seen_up = job.outcomes[host.name], None, False
    remote = job.remote_for(host)
    try:
        while not job.done.wait(LINK_PROBE_INTERVAL):
            if outcome.exit_code is not None:
                return
            probed_at = time.monotonic()
            try:
                answer = remote.run(command, timeout=LINK_PROBE_WAIT + 10).stdout.strip()
            except UserError:
                continue  # SSH itself failing is the liveness watcher's business
            if answer == "up":
                seen_up = True
                if down_since is not None:
                    job.emit(f"[launcher] {host.name} reaches {target} again")
                down_since, outcome.link_down = None, None
                continue
            if not (seen_up and answer.startswith("down")):
                continue
            reason = answer.removeprefix("down").strip() or "no answer"
            if down_since is None:
                down_since = probed_at
                job.emit(
                    f"[launcher] {host.name} cannot reach {target} over the compute network "
                    f"({reason}); the job is stopped if this lasts "
                    f"{job.spec.network_timeout:g} s"
                )
            down_for = time.monotonic() - down_since
            outcome.link_down = f"compute link to {target} down for {down_for:.0f} s ({reason})"
            if down_for >= job.spec.network_timeout:
                lost = cut_off(job.hosts, job.outcomes) or host.name
                what = (
                    f"compute link to {target} down"
                    if lost == host.name
                    else "no other node reaches it over the compute network"
                )
                job.outcomes[lost].error = (
                    f"lost: {what} for {down_for:.0f} s ({reason}; "
                    f"--network-timeout {job.spec.network_timeout:g})"
                )
                job.fail(lost)
                return
    finally:
        try:
            remote.close()
        except Exception:  # closing a session to a dead node may raise anything
            pass
