"""Stall (hang) detection: whether a running job still makes progress, and the watch that
declares a hang when it does not (`until_hang`, for a job on the nodes and one on this machine
alike). What a hang sets off, the stacks read and the report, is launch.watch's.

Progress is, in order of preference: the workloads' step lines ("step 12/100 ..."), a line a
user's script prints to say it is alive (HEARTBEAT, hidden from the output), and, for a script
that prints neither, any line at all. Once a step line or a heartbeat has been seen, only those
count: a rank waiting in a collective may go on printing warnings.

A job that prints neither step lines nor heartbeats has no default stall time, but once it has
printed nothing for launch.idle's IDLE_AFTER seconds its ranks are looked at: every rank idle
(no CPU, no bytes read or written) for IDLE_WINDOW seconds is a hang too (`until_hang`'s
`idle_look`). STALL=0 turns both off; a STALL given replaces the look.

The job is stalled after STALL seconds without progress, counted once progress has been seen:
before that, the ranks start (a container, torch's import, the rendezvous: slow on a loaded
machine) and the rendezvous and the first collective have timeouts of their own. Given
(--stall), STALL applies to any progress, output included. Left to the launcher, it applies
once a step line or a heartbeat has been seen, and is the larger of STALL_FLOOR and
STALL_STEPS times the median interval between two of them: a job that only prints now and then
(the selftest, a user's script) is never called hung by default.
"""

from __future__ import annotations

import re
import statistics
import threading
import time
from collections.abc import Callable

from torch_multinode.launch import hang, idle
from torch_multinode.launch.spec import STALL_POLL, Emit, JobSpec

HEARTBEAT = "[tmn] heartbeat"
"""A line a user's script prints (and flushes) to say it makes progress: the launcher counts it
and does not show it."""
STALL_FLOOR = 120.0
STALL_STEPS = 5
_STEP = re.compile(r"\bstep\s+\d+\s*/\s*\d+\b", re.IGNORECASE)
_INTERVALS_KEPT = 64


class Progress:
    """Fed every line the job prints (from every node's reader thread); read by the stall
    watcher. `stall`: seconds given by the user (0: never stalled), or None (the default)."""

    def __init__(self, stall: float | None = None, clock: Callable[[], float] = time.monotonic):
        self.stall, self.clock = stall, clock
        self.started = clock()
        self._lock = threading.Lock()
        self._last: float | None = None  # the last progress event
        self._marked = False  # a step line or a heartbeat has been seen
        self._intervals: list[float] = []

    def note(self, line: str) -> bool:
        """Count `line`; False when it is a heartbeat, which is not shown."""
        now = self.clock()
        heartbeat = line.strip() == HEARTBEAT
        marked = heartbeat or bool(_STEP.search(line))
        with self._lock:
            if marked and not self._marked:
                self._marked, self._last, self._intervals = True, None, []
            if marked or not self._marked:
                if self._last is not None:
                    self._intervals = [*self._intervals[-_INTERVALS_KEPT + 1 :], now - self._last]
                self._last = now
        return not heartbeat

    def threshold(self) -> float | None:
        """Seconds without progress that make a stall (None: none can be declared yet)."""
        with self._lock:
            if self._last is None:
                return None  # nothing yet: the start and the rendezvous have their own limits
            if self.stall is not None:
                return self.stall or None
            if not self._marked:
                return None  # output alone sets no default
            typical = statistics.median(self._intervals) if self._intervals else 0.0
        return max(STALL_FLOOR, STALL_STEPS * typical)

    def quiet_for(self) -> float:
        """Seconds since the last progress (since the start when there was none)."""
        with self._lock:
            last = self._last
        return self.clock() - (last if last is not None else self.started)

    def stalled(self) -> float | None:
        """Seconds without progress when that makes a stall, else None."""
        limit = self.threshold()
        if limit is None:
            return None
        quiet = self.quiet_for()
        return quiet if quiet >= limit else None

    def idle_due(self) -> bool:
        """Whether the ranks of a quiet job are to be looked at (launch.idle): a job with no
        stall time of its own (no STALL given, no step line or heartbeat seen) that has printed
        nothing for IDLE_AFTER seconds."""
        with self._lock:
            default, marked = self.stall is None, self._marked
        return default and not marked and self.quiet_for() >= idle.IDLE_AFTER

    def describe(self) -> str:
        """What counted as progress, for the report's first line."""
        with self._lock:
            marked = self._marked
        what = "step lines or heartbeats" if marked else "output"
        limit = self.threshold()
        after = f"stall after {limit:g} s" if limit is not None else "every rank idle"
        return f"no {what} for {self.quiet_for():.0f} s ({after})"


def until_hang(
    done: threading.Event,
    progress: Callable[[], Progress],
    spec: JobSpec,
    emit: Emit,
    read: Callable[[], hang.Verdict],
    look: str,
    idle_look: Callable[[], str | None] | None = None,
) -> hang.Verdict | None:
    """The stall watch of a job on the nodes and of one on this machine alike: until `done`,
    no progress for the job's stall time is a hang, and so is a quiet job whose every rank is
    idle (`idle_look`: its ranks' counters read twice, IDLE_WINDOW apart; what moved when every
    rank was idle, else None). Either is said, then `read` (every rank's stacks read and
    judged, the report printed and saved: `tell`). The verdict when the job is to be stopped
    for it; None when the job ended first, or --on-hang wait leaves it running for a person to
    look (how: `look`)."""
    while not done.wait(STALL_POLL):
        current = progress()
        if current.stalled() is not None:
            emit(f"[launcher] {current.describe()}: the job hangs; reading every rank's stacks...")
        elif idle_look is not None and current.idle_due():
            moved = idle_look()  # IDLE_WINDOW seconds
            if moved is None or done.is_set() or not current.idle_due():
                continue  # a rank did something, the job ended, or it printed meanwhile
            emit(
                f"[launcher] no output for {current.quiet_for():.0f} s and every rank idle for "
                f"{idle.IDLE_WINDOW:g} s ({moved}): the job hangs; reading every rank's stacks..."
            )
        else:
            continue
        verdict = read()
        if done.is_set():
            return None  # it ended while the stacks were read: not a hang after all
        if spec.on_hang == "wait":
            emit(
                "[launcher] --on-hang wait: the job is left running for you to look "
                f"({look}); Ctrl-C stops it"
            )
            return None
        return verdict
    return None
