"""One run of a job on the nodes (Launcher), its skeleton written once whichever way it goes
(launch.way's Way): prepared, started (one runner per node, the watchers), followed, concluded
(blame, stop) and wound down into what became of it. Over SSH: launch.over_ssh's OverSsh, the
way unless one is given. Through Slurm: launch.slurm's SlurmAttempt.

Either way, a job whose ranks stop making progress without failing is a hang (--stall, launch.progress):
every rank's stacks are read with py-spy and the rank holding the others up is named
(launch.hang) before the job is stopped.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from torch_multinode.cluster import sync
from torch_multinode.cluster.errors import Terminated, UserError
from torch_multinode.cluster.execution import Nodes, Session, SshNodes, close_quietly
from torch_multinode.cluster.inventory import Host, Inventory
from torch_multinode.cluster.remote import on_all
from torch_multinode.launch import blame, paces, staging, stop, stragglers, watch
from torch_multinode.launch.commands import remote_command, run_dir
from torch_multinode.launch.environment import node_settings
from torch_multinode.launch.groups import Groups
from torch_multinode.launch.node_output import NodeOutput
from torch_multinode.launch.nodes import job_backend, nproc_for
from torch_multinode.launch.over_ssh import OverSsh
from torch_multinode.launch.prepare import prepare_nodes
from torch_multinode.launch.replicated import Replicated
from torch_multinode.launch.running import RunningJob
from torch_multinode.launch.spec import (
    BLAME_GRACE,
    INTERRUPTED_RUNNER_GRACE,
    RUNNER_GRACE,
    Emit,
    JobResult,
    JobSpec,
)
from torch_multinode.launch.staging import Project
from torch_multinode.launch.way import Way


class Launcher:
    """One run of the job on its nodes, over SSH unless `way` says otherwise (launch.slurm's
    SlurmAttempt): what every way shares, and the one skeleton of a run (`run`)."""

    def __init__(
        self,
        inventory: Inventory,
        spec: JobSpec,
        emit: Emit = print,
        connect_timeout: float = 5.0,
        project: Project | None = None,
        nodes: Nodes | None = None,
        way: Way | None = None,
        spares: tuple[Host, ...] = (),
    ):
        self.inventory, self.spec, self.emit = inventory, spec, emit
        self.hosts = inventory.hosts  # already narrowed to the job's nodes (Inventory.first)
        self.spares = spares  # an FT=1 job's: one takes a lost group's place (launch.replicated)
        self.project = project
        self.nodes = nodes or SshNodes(inventory, connect_timeout)
        self.way: Way = way if way is not None else self._ssh_way()
        # what the runners, watchers and the stop share (launch.running)
        self.job = RunningJob(
            spec,
            self.hosts,
            self.nodes,
            emit,
            inventory.rendezvous_port,
            inventory.launch_mode == "container",
            project.workdir if project is not None else None,
        )
        self.outcomes = self.job.outcomes
        if spec.fault_tolerant:
            names = tuple(host.name for host in self.hosts)
            self.job.groups = Groups(names, spec.min_groups, emit)
        self.remotes: dict[str, Session] = {}  # each node's session, once connected (`connect`)
        self._writers: list[NodeOutput] = []  # each node's output, ticked for progress lines
        # one per node's command, and one more for a group an FT=1 job starts again (start_runner)
        self.runners: list[threading.Thread] = []
        self.backend = job_backend(self.hosts)[0]  # one for the whole job
        # each node's versions as prepared, and what changed since the lock (allow_drift)
        self.versions: dict[str, dict[str, str]] = {}
        self.drift: dict[str, list[str]] = {}
        # a slow rank's node, probed for its cause (launch.stragglers)
        self.stragglers = stragglers.Stragglers(
            self.job.probe, self.job.interface, emit, ours=not stragglers.watched(self.spec)
        )

    def _ssh_way(self) -> Way:
        """Over SSH: one world (launch.over_ssh), or one replica group per node for FT=1
        (launch.replicated)."""
        return Replicated(self) if self.spec.fault_tolerant else OverSsh(self)

    def remote_for(self, host: Host) -> Session:
        """A connection of its own to `host` (the caller closes it)."""
        return self.nodes.session(host)

    def connect(self, host: Host) -> None:
        """The run's session to `host` (in `remotes`), connected."""
        remote = self.remote_for(host)
        self.remotes[host.name] = remote
        remote.connect()

    def command(self, host: Host, master: Host, nnodes: int, env: dict[str, str]) -> str:
        """What runs the job on `host`: torchrun, in the job's container or on the host."""
        inventory = self.inventory
        assert self.project is not None  # planned (send_project) before any command
        return remote_command(
            host,
            master,
            nnodes,
            self.spec,
            inventory.rendezvous_port,
            env,
            inventory.launch_mode,
            staging.job_image(inventory, self.project),
            inventory.container_memlock,
            self.project,
            tuple(staging.mounts(inventory, self.project, run_dir(self.spec))),
        )

    def parallel(self, work: Callable[[Host], object]) -> None:
        """`work` on every host at once (what it returns unused); the first UserError raised,
        after all have ended."""
        errors: list[UserError] = []

        def guarded(host: Host) -> None:
            try:
                work(host)
            except UserError as exc:
                errors.append(exc)

        on_all(self.hosts, guarded)
        if errors:
            raise errors[0]

    def send_project(self) -> None:
        """The project onto every node (only what changed), then each node's copy, image and
        directories checked (`prepare_node`). Only once no other job of ours runs on the nodes."""
        if self.project is None:
            self.project = staging.plan(
                self.inventory, self.spec.script, self.spec.workdir, self.spec.workdir_limit
            )
        self.job.workdir = self.project.workdir
        for tree, destination in self.project.trees:
            sent = sync.push(self.inventory, self.hosts, tree, destination, self.emit)
            self.emit("[launcher] " + sync.summary_line(tree, destination, sent))
        self.versions, self.drift = prepare_nodes(
            self.remotes,
            self.inventory,
            self.spec,
            self.project,
            self.backend,
            self.emit,
            self.parallel,
        )

    def _run_node(self, host: Host, command: str) -> None:
        outcome = self.outcomes[host.name]
        log = self.spec.log_dir / f"{host.name}.log" if self.spec.log_dir else None
        observe = self._observe
        if (groups := self.job.groups) is not None:

            def observe(line: str) -> bool:
                groups.note(host.name, line)  # the step each group has reached
                return self._observe(line)

        writer = NodeOutput(f"[{host.name}]", self.emit, outcome, log, observe=observe)
        self._writers.append(writer)
        try:
            exited = self.remotes[host.name].stream(command, writer)
            outcome.exit_code = exited
            if exited == -1 and self.job.stopping.is_set():
                outcome.exit_code = None  # killed by our stop: the summary says "stopped"
            # An error already recorded (a watcher declared the node lost) says more.
            elif exited == -1:  # closed with no exit status
                outcome.session_lost = True
                if outcome.error is None:
                    outcome.error = "the SSH session ended without an exit status: node down?"
        except Exception as exc:  # a dropped connection surfaces as several invoke/paramiko types
            # Once the stop has begun, the launcher itself may close the session: "stopped".
            if not self.job.stopping.is_set():
                outcome.session_lost = True
                if outcome.error is None:
                    outcome.error = f"lost the SSH session: {type(exc).__name__}: {exc}".strip()
        finally:
            # Whatever happened above, the launcher must hear of it: a runner that dies without
            # a word leaves the main thread waiting forever.
            try:
                writer.close()
            finally:
                if self.outcomes[host.name] is not outcome:
                    pass  # an FT=1 job's group started again since: this session's end is old news
                elif not outcome.ok:
                    self.job.fail(host.name)
                elif self.job.ended():
                    self.job.done.set()

    def _setup(self, announce: bool = True) -> dict[str, dict[str, str]]:
        """What needs no node: each node's process count checked (a GPU the node lacks stops
        us before any SSH), the job's backend said; each node's environment (interface settings
        and the backend). The log directory is made only when the job starts (`make_log_dir`):
        a job refused before that leaves no empty .runs/JOB-ID behind."""
        envs, network = node_settings(self.inventory, self.spec.env_file, self.backend)
        for host in self.hosts:
            nproc_for(host, self.spec)
        for note in (job_backend(self.hosts)[1], network):
            if note and announce:
                self.emit(f"[launcher] {note}")
        return envs

    def make_log_dir(self) -> None:
        """The job's log directory (.runs/JOB-ID), once the job is about to start."""
        if self.spec.log_dir:
            self.spec.log_dir.mkdir(parents=True, exist_ok=True)

    def _runners(self, commands: dict[str, str]) -> list[threading.Thread]:
        """One runner per node, streaming its command's output (not started yet)."""
        self.make_log_dir()
        return [
            threading.Thread(target=self._run_node, args=(h, commands[h.name]), daemon=True)
            for h in self.hosts
        ]

    def start_runner(self, host: Host, command: str) -> None:
        """A runner for `host` started while the job runs (an FT=1 job's group started again,
        or on a spare), followed as the others are."""
        if host not in self.hosts:  # a spare: one of the job's nodes from now on
            self.hosts = self.job.hosts = (*self.hosts, host)
        runner = threading.Thread(target=self._run_node, args=(host, command), daemon=True)
        self.runners.append(runner)
        runner.start()

    def _observe(self, line: str) -> bool:
        self.stragglers.note(line)
        return self.job.progress.note(line)

    def _follow(self, runners: list[threading.Thread]) -> None:
        """Until the job is done (a failure, or every node's exit), or every runner ended."""
        while not self.job.done.wait(0.2):
            for writer in list(self._writers):
                writer.tick()  # a progress bar's latest state, every few seconds
            if not any(runner.is_alive() for runner in runners) and (
                self.job.groups is None or self.job.ended()
            ):
                # every runner has ended: nothing is left to wait for (an FT=1 job's group
                # being started again has its outcome anew before its runner starts)
                break

    def _settle_blame(self, runners: list[threading.Thread], named: Callable[[], None]) -> None:
        """After a first failure: the others may take a moment to report their own, which can
        say more than the first (not worth waiting for once a node is known to be gone); then
        `named` (what else tells who failed) and the node to blame, said."""
        deadline = time.monotonic() + BLAME_GRACE
        while (
            time.monotonic() < deadline
            and any(runner.is_alive() for runner in runners)
            and not any(self.outcomes[name].lost for name in self.job.failures)
        ):
            time.sleep(0.1)
        named()
        self.job.first_failure = blame.blame(self.job.failures, self.outcomes, self.hosts)
        self.emit(f"[launcher] {self.job.first_failure} failed: stopping the job on every node...")

    def stop_everywhere(self, master: Host) -> dict[str, float | str]:
        stopped = stop.everywhere(self.job, master)
        self.emit(stop.said(stopped))
        return stopped

    def _wind_down(
        self,
        runners: list[threading.Thread],
        started: float,
        interrupted: bool,
        terminated: bool,
    ) -> JobResult:
        """The runners given a moment to see their sessions end, the sessions closed: what
        became of the job."""
        self.job.done.set()
        deadline = time.monotonic() + (INTERRUPTED_RUNNER_GRACE if interrupted else RUNNER_GRACE)
        for runner in runners:
            runner.join(max(0.0, deadline - time.monotonic()))
        failed = self.job.first_failure is not None and not interrupted
        # a hang's report has the traces already
        flights = (
            watch.traces_after_failure(self.job) if failed and not self.job.hang_reported else []
        )
        self.close()
        return self.job.result(
            interrupted,
            time.monotonic() - started,
            terminated,
            tuple(flights),
            self.versions,
            self.drift,
            tuple(self.stragglers.said),
        )

    def run(self) -> JobResult:
        """The run, whichever way it goes: prepared, its runners and watchers started and
        followed to the job's end, an interrupt or a first failure stopped everywhere, and what
        became of it."""
        started = time.monotonic()
        envs = self._setup(announce=self.way.announce)
        interrupted = terminated = begun = False
        runners: list[threading.Thread] = []
        try:
            runners = self.runners = self._runners(self.way.prepare(envs))
            threads = runners + self.way.watchers() + watch.stall_watcher(self.job)
            threads += paces.watcher(self.job, self.stragglers)
            begun = True
            for thread in threads:
                thread.start()
            self._follow(runners)
        except KeyboardInterrupt as signalled:
            if not (begun or self.way.queues):
                raise  # nothing runs yet: raised on as it is (Way.queues)
            interrupted = True
            terminated = isinstance(signalled, Terminated)
            why = "SIGTERM" if terminated else "Ctrl-C"
            self.emit(f"[launcher] {why}: {self.way.stopping()}...")
        except BaseException:
            if (begun or self.way.queues) and self.way.broke():
                self._conclude(runners, started, interrupted=False, terminated=False)
            raise
        return self._conclude(runners, started, interrupted, terminated)

    def _conclude(
        self,
        runners: list[threading.Thread],
        started: float,
        interrupted: bool,
        terminated: bool,
    ) -> JobResult:
        """After the job's end, an interrupt or a first failure: the node to blame settled,
        the way's conclusion (the job stopped where it must be), and what became of it."""
        if self.job.first_failure is not None and not interrupted:
            self._settle_blame(runners, self.way.name_lost)
        self.way.conclude(interrupted)
        return self._wind_down(runners, started, interrupted, terminated)

    def close(self) -> None:
        """Every session of the run's closed."""
        for remote in self.remotes.values():
            close_quietly(remote)
