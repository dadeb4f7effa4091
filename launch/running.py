"""What a run's threads share while it runs on the nodes: the node runners, the watchers
(launch.watch) and the stop (launch.stop) read and record here, and nowhere else.

A run (launch.job's Launcher, or launch.slurm's attempt) makes one RunningJob and hands it to
the others. They record what they see through its methods (a node failed, with why), under its
lock; the run alone decides what happens next from it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from torch_multinode.cluster.execution import Nodes, Session
from torch_multinode.cluster.inventory import Host
from torch_multinode.launch.progress import Progress
from torch_multinode.launch.spec import Emit, JobSpec, NodeOutcome


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
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        self.outcomes = self.outcomes or {host.name: NodeOutcome(host.name) for host in self.hosts}
        self.progress = Progress(self.spec.stall)

    def session(self, host: Host) -> Session:
        """A connection of its own to `host` (the caller closes it)."""
        return self.nodes.session(host)

    def fail(self, name: str, error: str | None = None, unreachable: bool = False) -> None:
        """`name` failed (why: `error`, if given; `unreachable`: it stopped answering): the run
        ends."""
        with self._lock:
            outcome = self.outcomes[name]
            if error is not None:
                outcome.error = error
            outcome.unreachable = outcome.unreachable or unreachable
            if self.first_failure is None:
                self.first_failure = name
            self.failures.append(name)
        self.done.set()

    def restart_clock(self) -> None:
        """The stall clock, started again: the job's processes start now."""
        self.progress = Progress(self.spec.stall)
