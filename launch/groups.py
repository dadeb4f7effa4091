"""The replica groups of a running FT=1 job (launch.replicated), one per node: which are in,
which were lost and at what step. One node's end is not the job's: a group that dies or stops
answering is reported with the step it had reached, and the others go on as long as at least
the minimum of groups (MIN_NODES) is left. What launch.running's RunningJob asks when a node
fails in such a job."""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field

from torch_multinode.launch.spec import Emit

_STEP = re.compile(r"\bstep\s+(\d+)\s*/\s*\d+", re.IGNORECASE)


@dataclass
class Groups:
    """The replica groups of a running FT=1 job, one per node: which are in, which were lost
    and at what step, and the lines that say so (for the summary and the run's record)."""

    names: tuple[str, ...]  # the nodes, in group order
    min_groups: int
    emit: Emit
    lost: dict[str, int | None] = field(default_factory=dict)  # node -> its last step seen
    changes: list[str] = field(default_factory=list)  # each membership change, as a line
    steps: dict[str, int] = field(default_factory=dict)  # node -> the last step it printed
    started: float = field(default_factory=time.monotonic)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def note(self, name: str, line: str) -> None:
        """A line from node `name`'s ranks: the step it has reached, where it says one."""
        if found := _STEP.search(line):
            with self._lock:
                self.steps[name] = max(self.steps.get(name, 0), int(found.group(1)))

    def alive(self) -> list[str]:
        return [name for name in self.names if name not in self.lost]

    def lose(self, name: str, why: str | None) -> bool:
        """Node `name`'s group has ended badly (`why`, where known): True where the others go
        on without it (said), False where too few would be left (the job fails as any other)."""
        with self._lock:
            if name in self.lost:
                return True
            left = [other for other in self.alive() if other != name]
            if len(left) < self.min_groups:
                return False
            step = self.steps.get(name)
            self.lost[name] = step
            at = f"at step {step}" if step is not None else "before its first step"
            line = (
                f"{name} lost {at}: continuing on {', '.join(left)} "
                f"({len(left)} of {len(self.names)} groups)"
            )
            seconds = time.monotonic() - self.started
            self.changes.append(
                f"{line}, {seconds:.0f} s into the job" + (f"; {why}" if why else "")
            )
        self.emit(f"[launcher] {line}" + (f" ({why})" if why else ""))
        return True

    def rejoin(self, name: str, restart: int, restarts: int) -> None:
        """Node `name`'s group, lost, starts again (restart `restart` of `restarts`): it heals
        from a live peer and trains with the others from their next step."""
        with self._lock:
            self.lost.pop(name, None)
            self.steps.pop(name, None)
            at = self._others_step()
            line = f"{name} answers again: its group starts again"
            self._back(line, at, restart, restarts)

    def take_over(self, lost: str, spare: str, restart: int, restarts: int) -> None:
        """Spare node `spare` takes lost node `lost`'s group (its index and share of the data):
        it heals from a live peer and trains with the others from their next step."""
        with self._lock:
            self.names = tuple(spare if name == lost else name for name in self.names)
            at = self._others_step()
            self._back(f"spare {spare} takes {lost}'s group", at, restart, restarts)

    def _others_step(self) -> int | None:
        """The newest step the groups in the job have printed (None: none yet)."""
        return max((self.steps[n] for n in self.alive() if n in self.steps), default=None)

    def _back(self, what: str, at: int | None, restart: int, restarts: int) -> None:
        """A group in the job again (`what`, at the others' step `at`), kept and said."""
        line = (
            what
            + (f" at the others' step {at}" if at is not None else "")
            + f" and heals from a live peer (restart {restart} of {restarts})"
        )
        seconds = time.monotonic() - self.started
        self.changes.append(f"{line}, {seconds:.0f} s into the job")
        self.emit(f"[launcher] {line}")
