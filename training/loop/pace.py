"""The slow-rank detector's part in each rank (launch.stragglers is the launcher's): how much of
a step is this rank's own work (OwnTime, its wait for a CPU beside it), and which ranks are slow
against the others (own_work, slow_ranks). The trainer times every step with it and, every
--log-every steps, shares each rank's two numbers (parallel.share) and names a slow one."""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

# A rank is only called slow when it also loses this much per step: on small steps, scheduling
# noise alone makes ratios of 2 between ranks.
SLOW_RANK_MIN_EXCESS = 0.02


@dataclass(frozen=True)
class SlowRank:
    rank: int
    node: str
    seconds: float  # its own time per step
    others: float  # the median of the other ranks' own time per step


def slow_ranks(
    per_rank: list[tuple[float, str]], factor: float, min_excess: float = SLOW_RANK_MIN_EXCESS
) -> list[SlowRank]:
    """The ranks whose own time per step (seconds, node) exceeds `factor` times the median of
    the other ranks' and that median by at least `min_excess` seconds; none when factor is 0.
    Of an even count of others the upper median: one fast rank does not make the rest slow."""
    if factor <= 0 or len(per_rank) < 2:
        return []
    found = []
    for rank, (seconds, node) in enumerate(per_rank):
        others = statistics.median_high(t for other, (t, _) in enumerate(per_rank) if other != rank)
        if seconds > factor * others and seconds - others >= min_excess:
            found.append(SlowRank(rank, node, seconds, others))
    return found


def own_work(per_rank: list[tuple[float, float, str]]) -> list[tuple[float, str]]:
    """Each rank's own time per step as slow_ranks compares it, from (seconds, of which waiting
    for a CPU, node). Ranks on one node share its cores: when more threads want them than there
    are (a loaded machine, two local ranks on a busy 2-core one), which rank the scheduler
    leaves waiting is chance, not that rank's own work. So a rank's own wait for a CPU counts
    as its node's ranks' median wait: a rank is still named for work of its own (computing,
    sleeping, waiting for its data), and a node whose every rank waits for a CPU (a busy node
    among idle ones) still holds the others up and is named; a rank alone on its node keeps its
    time as measured."""
    waits: dict[str, list[float]] = {}
    for _, waited, node in per_rank:
        waits.setdefault(node, []).append(waited)
    return [
        (seconds - waited + statistics.median(waits[node]), node)
        for seconds, waited, node in per_rank
    ]


_SCHEDSTAT: dict[int, int] = {}  # thread id -> its open /proc/thread-self/schedstat


def cpu_wait() -> float:
    """Seconds this thread has spent runnable but waiting for a CPU (the kernel's run-queue
    wait: /proc/thread-self/schedstat's second field); 0 where the kernel does not say. The
    file stays open, read again from its start (2 us a read where opening it took 15: four reads
    a step, a training step's whole detector cost, bench section 17)."""
    thread = threading.get_native_id()
    try:
        if thread not in _SCHEDSTAT:
            _SCHEDSTAT[thread] = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        return int(os.pread(_SCHEDSTAT[thread], 128, 0).split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


class OwnTime:
    """Seconds this rank spends on its own work: data loading, forward, optimizer step and
    everything between steps, but not the time it waits for the other ranks (DDP's buffer
    broadcast before forward, backward with its gradient all-reduce, the trainer's own
    collectives). In a synchronous job every rank's wall time per step is the slowest rank's;
    this is what tells them apart. Measured on the host: on a GPU it sees host-side slowness
    (data loading, a busy CPU), not a slow GPU's kernels. A step's own time runs from the end
    of the previous backward to the end of its forward; how much of it the rank's thread was
    runnable but waiting for a CPU is kept beside it (own_work)."""

    def __init__(
        self,
        clock: Callable[[], float] = time.perf_counter,
        waited: Callable[[], float] = cpu_wait,
    ):
        self.clock, self.waited = clock, waited
        self.steps: list[tuple[float, float]] = []  # (seconds, of which waiting for a CPU)
        self._current = self._current_wait = 0.0
        self._since: float | None = None
        self._wait_since = 0.0

    def resume(self) -> None:
        if self._since is None:
            self._since, self._wait_since = self.clock(), self.waited()

    def pause(self) -> None:
        if self._since is not None:
            self._current += self.clock() - self._since
            self._current_wait += self.waited() - self._wait_since
            self._since = None

    def end_step(self) -> None:
        self.pause()
        self.steps.append((self._current, self._current_wait))
        self._current = self._current_wait = 0.0

    def take(self) -> tuple[float, float]:
        """The median own time of the steps since the last take (one stall of the machine
        does not make a rank slow), and the median of their waits for a CPU; starts afresh."""
        seconds = statistics.median(s for s, _ in self.steps) if self.steps else 0.0
        waited = statistics.median(w for _, w in self.steps) if self.steps else 0.0
        self.steps = []
        return seconds, waited


class Untimed(OwnTime):
    """OwnTime with --slow-rank-factor 0: nothing read, nothing kept (the straggler detector
    off, as `make bench` measures it against on)."""

    def resume(self) -> None:
        pass

    def pause(self) -> None:
        pass

    def end_step(self) -> None:
        pass
