"""What a run's threads share while it runs on the nodes: the node runners, the watchers
(launch.watch) and the stop (launch.stop) read and record here, and nowhere else.

A run (launch.job's Launcher, or launch.slurm's attempt) makes one RunningJob and hands it to
the others. They record what they see through its methods (a node failed, with why), under its
lock; the run alone decides what happens next from it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from torch_multinode.cluster.containers import container_name
from torch_multinode.cluster.errors import UserError
from torch_multinode.cluster.execution import Nodes, Session
from torch_multinode.cluster.inventory import Host
from torch_multinode.launch import causes
from torch_multinode.launch.ending import own_words
from torch_multinode.launch.groups import Groups
from torch_multinode.launch.progress import Progress
from torch_multinode.launch.spec import Emit, JobResult, JobSpec, NodeOutcome


@dataclass
class RunningJob:
    spec: JobSpec
    hosts: tuple[Host, ...]  # the job's nodes, the master first
    nodes: Nodes
    emit: Emit
    rendezvous_port: int
    container: bool  # launch_mode: container (the ranks run in the training image)
    workdir: str | None = None  # the job's directory on the nodes (Project.workdir), once known
    outcomes: dict[str, NodeOutcome] = field(default_factory=dict)
    done: threading.Event = field(default_factory=threading.Event)
    stopping: threading.Event = field(default_factory=threading.Event)  # the stop has begun
    failures: list[str] = field(default_factory=list)  # nodes that failed, in order
    first_failure: str | None = None
    silent: set[str] = field(default_factory=set)  # lost nodes that did not answer the stop
    hang_reported: bool = False  # a hang report (stacks and traces) is out for this run
    progress: Progress = field(init=False)  # the stall clock, at the job's stall setting
    groups: Groups | None = None  # an FT=1 job's replica groups (launch.groups), one per node
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        self.outcomes = self.outcomes or {host.name: NodeOutcome(host.name) for host in self.hosts}
        self.progress = Progress(self.spec.stall)

    def session(self, host: Host) -> Session:
        """A connection of its own to `host` (the caller closes it)."""
        return self.nodes.session(host)

    def node(self, name: str) -> Host:
        for host in self.hosts:
            if host.name == name:
                return host
        raise UserError(f"{name} is not one of this job's nodes by that name")

    def interface(self, name: str) -> str:
        return self.node(name).compute_interface or ""

    def probe(self, name: str) -> str:
        """causes.script's output on node `name`, over a session of its own (the job's
        container's cgroup read too where the job runs in one): a slow rank's cause."""
        host = self.node(name)
        container = container_name(self.spec.run_id, host.name) if self.container else None
        with self.session(host) as remote:
            remote.connect()
            answer = remote.run(
                causes.script(self.interface(name), container), timeout=causes.WINDOW + 30
            )
        return answer.stdout

    def fail(self, name: str, error: str | None = None, unreachable: bool = False) -> None:
        """`name` failed (why: `error`, if given; `unreachable`: it stopped answering): the run
        ends, unless it is an FT=1 job whose other groups go on without it (launch.groups)."""
        with self._lock:
            outcome = self.outcomes[name]
            if error is not None:
                outcome.error = error
            outcome.unreachable = outcome.unreachable or unreachable
            if self.groups is not None and self.first_failure is None:
                code = outcome.exit_code
                why = (
                    outcome.error
                    or own_words(list(outcome.tail))
                    or (f"exit {code}" if code not in (None, 0) else None)
                )
                if self.groups.lose(name, why):
                    if self.ended():
                        self.done.set()
                    return
            if self.first_failure is None:
                self.first_failure = name
            self.failures.append(name)
        self.done.set()

    def rejoin(self, name: str, restart: int, restarts: int) -> bool:
        """An FT=1 job's lost group `name` starting again (launch.groups): its outcome anew;
        False where the job has ended meanwhile (nothing to rejoin)."""
        assert self.groups is not None
        with self._lock:
            if self.done.is_set():
                return False
            self.groups.rejoin(name, restart, restarts)
            self.outcomes[name] = NodeOutcome(name)
            return True

    def take_over(self, lost: str, spare: str, restart: int, restarts: int) -> bool:
        """An FT=1 job's spare `spare` taking lost group `lost`'s place (launch.groups): its
        outcome; False where the job has ended meanwhile."""
        assert self.groups is not None
        with self._lock:
            if self.done.is_set():
                return False
            self.groups.take_over(lost, spare, restart, restarts)
            self.outcomes[spare] = NodeOutcome(spare)
            return True

    def ended(self) -> bool:
        """Whether every node's part has ended (an FT=1 job: every group still in it)."""
        lost = self.groups.lost if self.groups is not None else {}
        return all(
            outcome.exit_code is not None or name in lost for name, outcome in self.outcomes.items()
        )

    def restart_clock(self) -> None:
        """The stall clock, started again: the job's processes start now."""
        self.progress = Progress(self.spec.stall)

    def result(
        self,
        interrupted: bool,
        seconds: float,
        terminated: bool,
        flights: tuple[str, ...],
        versions: dict[str, dict[str, str]],
        drift: dict[str, list[str]],
        stragglers: tuple[str, ...],
    ) -> JobResult:
        """What became of the job: each node's outcome, the node to blame, how it ended, and
        what the run found on the way (each node's versions and their drift since the lock)."""
        return JobResult(
            self.spec.run_id,
            self.outcomes,
            self.first_failure,
            interrupted,
            seconds,
            terminated=terminated,
            flights=flights,
            versions=dict(versions),
            drift=dict(drift),
            stragglers=stragglers,
            nodes_changed=tuple(self.groups.changes) if self.groups is not None else (),
            groups_lost=tuple(self.groups.lost) if self.groups is not None else (),
        )
