"""What differs between the ways one run of a job goes (Way): the points at which launch.job's
Launcher.run asks its way, over SSH (launch.over_ssh's OverSsh) or through Slurm (launch.slurm's
SlurmAttempt). The rest of a run is the same for all and is launch.job's."""

from __future__ import annotations

import threading
from typing import Protocol


class Way(Protocol):
    """What differs between the ways one run goes (launch.over_ssh's OverSsh, launch.slurm's
    SlurmAttempt). The run (Launcher.run) asks its way at each of these points; the rest is the
    same for all: the node runners, outcomes, blame, hang watcher, stop and wind-down."""

    queues: bool
    """Whether the job may be queued while it is prepared (Slurm): an interrupt or an error
    while it is prepared is then the job's, as once its nodes run it. Without (SSH), one is
    raised on as it is: `prepare` lets go of what it held."""

    @property
    def announce(self) -> bool:
        """Whether the job's backend and network are said (not again on a requeue)."""

    def prepare(self, envs: dict[str, dict[str, str]]) -> dict[str, str]:
        """Until the nodes may start (`envs`: each node's environment): each node's command."""

    def watchers(self) -> list[threading.Thread]:
        """The way's own watchers of the running job (not started yet)."""

    def stopping(self) -> str:
        """What an interrupt (Ctrl-C, SIGTERM) does, said."""

    def name_lost(self) -> None:
        """After a first failure: what else names the nodes lost, before the blame."""

    def conclude(self, interrupted: bool) -> None:
        """After the blame: the job stopped where it must be, what the way holds let go."""

    def broke(self) -> bool:
        """An unexpected error once the job is the way's: what it cleans up; True where the
        run then concludes as any other (the error raised on after that)."""
