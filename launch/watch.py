"""The watchers of a running job, each in a thread of its own: a node that stops answering over
SSH, and a node that cannot reach the master over the compute network, fail the job; a job
that stops making progress is a hang, reported (every rank's stacks) before it is stopped.

When a job is stalled, and the watch that declares the hang, are launch.progress's (a local
job's too); what a hang sets off is here: the command that reads a node's stacks and traces
(`collection_command`) and the report (`tell`), also a local job's (launch.local): one report,
worded here, wherever the ranks run."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from pathlib import Path

from torch_multinode.cluster.containers import container_name
from torch_multinode.cluster.errors import UserError
from torch_multinode.cluster.execution import close_quietly
from torch_multinode.cluster.inventory import Host
from torch_multinode.launch import flight, hang, idle
from torch_multinode.launch.blame import cut_off
from torch_multinode.launch.commands import link_probe_command, run_dir
from torch_multinode.launch.progress import Progress, until_hang
from torch_multinode.launch.running import RunningJob
from torch_multinode.launch.spec import (
    LINK_PROBE_INTERVAL,
    LINK_PROBE_WAIT,
    LIVENESS_FAILURES,
    LIVENESS_INTERVAL,
    Emit,
    JobSpec,
)

TRACES_TIMEOUT = 15  # seconds a node gets to print the traces its failed ranks left
IDLE_TIMEOUT = 20  # seconds a node gets to print its ranks' counters (launch.idle)


def liveness(job: RunningJob) -> None:
    """A node that stops answering is failed within a few seconds, not at TCP's leisure (the
    run ends then, but for an FT=1 job whose other groups go on: they are watched on)."""
    misses: collections.Counter[str] = collections.Counter()
    while not job.done.wait(LIVENESS_INTERVAL):
        for host in job.hosts:
            if job.outcomes[host.name].exit_code is not None or host.name in job.failures:
                continue
            if job.groups is not None and host.name in job.groups.lost:
                continue  # an FT=1 job's group lost already: the others go on
            if job.nodes.answers(host, 2):
                misses[host.name] = 0
            else:
                misses[host.name] += 1
                if misses[host.name] >= LIVENESS_FAILURES:
                    job.fail(
                        host.name,
                        f"stopped answering on {host.ssh_address}:{host.ssh_port}",
                        unreachable=True,
                    )


def link(job: RunningJob, host: Host, master: Host) -> None:
    """Ping the master's compute IP from `host`, over an SSH session of its own; a link
    down for --network-timeout seconds fails `host`. Only a link seen up during this job
    can go down: where ICMP is blocked from the start, the check stays silent."""
    target = f"{master.name} ({master.compute_ip})"
    command = link_probe_command(str(master.compute_ip))
    outcome, down_since, seen_up = job.outcomes[host.name], None, False
    remote = job.session(host)
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
                job.fail(
                    lost,
                    f"lost: {what} for {down_for:.0f} s ({reason}; "
                    f"--network-timeout {job.spec.network_timeout:g})",
                )
                return
    finally:
        close_quietly(remote)


def stall_watcher(job: RunningJob) -> list[threading.Thread]:
    """The hang watcher (`stall`, not started), its clock started now: none with --stall 0."""
    job.restart_clock()
    if job.spec.stall == 0:
        return []
    return [threading.Thread(target=stall, args=(job,), daemon=True)]


def stall(job: RunningJob) -> None:
    """No progress for the job's stall time (progress.until_hang): a hang. Every rank's stacks are
    read and judged (`report`); then the job fails, naming the rank that holds the others up,
    or (--on-hang wait) is left running for a person to look."""

    def reported() -> hang.Verdict:
        verdict = report(job)
        job.hang_reported = True
        return verdict

    look = "py-spy dump --pid PID on a node"
    verdict = until_hang(
        job.done, lambda: job.progress, job.spec, job.emit, reported, look, lambda: idle_look(job)
    )
    if verdict is None:
        return
    node = verdict.culprits[0].node if verdict.culprits else job.hosts[0].name
    already = job.outcomes[node].error is not None  # says more than "hung"
    job.fail(node, None if already else f"hung: {verdict.cause}")


def idle_look(job: RunningJob) -> str | None:
    """Every node's ranks' counters and places, read as launch.idle.look says: what they did
    when the job is idle and stuck, else None (a rank that moved, a node that did not answer,
    the job's end)."""

    def counters(host: Host) -> str:
        container = container_name(job.spec.run_id, host.name) if job.container else None
        return idle.command(job.spec.run_id, container)

    def read() -> idle.Processes:
        texts, _ = _on_every_node(job, counters, IDLE_TIMEOUT)
        found: idle.Processes = {}
        for text in texts.values():
            found.update(idle.parse(text))
        return found

    def places() -> dict[int, str]:
        texts, _ = _on_every_node(job, lambda host: _stacks_command(job, host), hang.STACKS_TIMEOUT)
        return {
            rank.rank: hang.shown_place(rank)
            for node, text in texts.items()
            for rank in hang.parse(node, text)[0]
        }

    return idle.look(read, places, job.done.wait)


def _stacks_command(job: RunningJob, host: Host) -> str:
    """The command that prints `host`'s ranks' stacks (launch.hang), in the job's container in
    container mode."""
    return hang.stacks_command(
        job.spec.run_id,
        _py_spy(job, host),
        container_name(job.spec.run_id, host.name) if job.container else None,
        native=host.gpu_count > 0,  # a rank waiting for its GPU is in libcuda
    )


def _py_spy(job: RunningJob, host: Host) -> str:
    """py-spy where the job's ranks run: the image's, or beside the node's Python."""
    if job.container or "/" not in host.python:
        return "py-spy"
    return str(Path(host.python).parent / "py-spy")


def collection_command(
    run_id: str, directory: str, py_spy: str, container: str | None = None, native: bool = False
) -> str:
    """What one node (or this machine) runs for a hang's report: its ranks asked for their
    Flight Recorder traces first (written while py-spy reads), every rank's stacks
    (hang.stacks_command), then the traces printed."""
    stacks = hang.stacks_command(run_id, py_spy, container, native)
    return (
        f"{flight.request_command(directory)}; {stacks}; sleep {flight.WAIT:g}; "
        f"{flight.collect_command(directory)}"
    )


def _on_every_node(
    job: RunningJob,
    command: Callable[[Host], str],
    timeout: float,
    hosts: tuple[Host, ...] | None = None,
) -> tuple[dict[str, str], dict[str, str]]:
    """`command(host)` on every node (of `hosts`, if given) at once, each within `timeout`: what
    each printed, and the nodes that did not answer (why)."""
    hosts = job.hosts if hosts is None else hosts
    texts: dict[str, str] = {}
    silent: dict[str, str] = {}

    def read(host: Host) -> None:
        try:
            with job.session(host) as remote:
                remote.connect()
                answer = remote.run(command(host), timeout=timeout)
            texts[host.name] = answer.stdout + answer.stderr
        except UserError as exc:
            silent[host.name] = str(exc).splitlines()[0] if str(exc) else "did not answer"

    threads = [threading.Thread(target=read, args=(h,), daemon=True) for h in hosts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout + 15)
    for host in hosts:
        if host.name not in texts and host.name not in silent:
            silent[host.name] = f"no answer within {timeout:g} s"
    return texts, silent


def report(job: RunningJob) -> hang.Verdict:
    """Every node's ranks' stacks, read at once (each node within hang.STACKS_TIMEOUT), then
    judged, printed and saved (`tell`)."""
    container = job.container
    directory = run_dir(job.spec)  # the same path in the container

    def command(host: Host) -> str:
        return collection_command(
            job.spec.run_id,
            directory,
            _py_spy(job, host),
            container_name(job.spec.run_id, host.name) if container else None,
            native=host.gpu_count > 0,  # a rank waiting for its GPU is in libcuda
        )

    texts, silent = _on_every_node(job, command, hang.STACKS_TIMEOUT)
    workdir = str(job.workdir) if job.workdir is not None else None
    return tell(job.spec, job.progress, texts, silent, workdir, job.emit, job.spec.log_dir)


def tell(
    spec: JobSpec,
    progress: Progress,
    texts: dict[str, str],
    silent: dict[str, str],
    workdir: str | None,
    emit: Emit,
    log_dir: Path | None,
) -> hang.Verdict:
    """A hang's report, on the nodes and on this machine alike: what each node's collection
    (`collection_command`) printed (`texts`; `silent`: the nodes that did not answer, and why),
    judged (launch.hang), printed, and saved in `log_dir` as hang-report.txt, each node's
    stacks as hang-stacks-NODE.txt."""
    silent = dict(silent)
    ranks: list[hang.RankStacks] = []
    flights: dict[int, flight.Collective] = {}
    for name, text in texts.items():
        text, traced = flight.split(text)
        flights.update(traced)
        found, problem = hang.parse(name, text)
        ranks += found
        if problem is not None:
            silent[name] = problem
    verdict = hang.judge(ranks, silent, workdir, flights)
    header = f"Hang report, job {spec.run_id}: {progress.describe()}"
    for line in verdict.lines:
        emit(f"[launcher]   {line}")
    emit(f"[launcher] hang: {verdict.cause}")
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        for name, text in texts.items():
            (log_dir / f"hang-stacks-{name}.txt").write_text(text)
        saved = log_dir / "hang-report.txt"
        body = [header, *(f"  {line}" for line in verdict.lines), f"Cause: {verdict.cause}"]
        saved.write_text("\n".join(body) + "\n")
        emit(f"[launcher] hang report: {saved}; every rank's stacks: hang-stacks-NODE.txt")
    return verdict


def traces_after_failure(job: RunningJob) -> list[str]:
    """For a job that failed (not hung: its report has them): the Flight Recorder's traces its
    ranks left as they ended, read from every node at once, as the summary's lines (each
    rank's last collective, a mismatch named). Nothing where no rank left one. A node that
    stopped answering is not asked."""
    directory = run_dir(job.spec)
    answering = tuple(h for h in job.hosts if not job.outcomes[h.name].lost)
    collect = flight.collect_command(directory)
    texts, _ = _on_every_node(job, lambda _: collect, TRACES_TIMEOUT, answering)
    flights: dict[int, flight.Collective] = {}
    nodes: dict[int, str] = {}
    for name, text in texts.items():
        traced = flight.split(text)[1]
        flights.update(traced)
        nodes.update(dict.fromkeys(traced, name))
    return flight.failure_lines(flights, nodes)
