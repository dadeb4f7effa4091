"""The straggler a job names, said with its cause: what a job says of a slow rank (our
workloads' warning, `rank R on NODE is slow: ...`) starts a probe of that node (launch.causes,
the why), and the launcher's line naming the node and its cause is said once, and again only
when the node or the cause changes; every such line goes in the run's record."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable

from torch_multinode.launch import causes

# Our workloads' warning (training/loop/trainer.py's `_check_pace`).
SLOW_LINE = re.compile(
    r"warning: rank (\d+) on (\S+) is slow: ([\d.]+) s of its own work per step .*?"
    r"the other ranks' median ([\d.]+) s"
)


class Stragglers:
    """The straggler a job's output names, probed for its cause. `probe(node)`: the output of
    `script()` run on that node (raising where it cannot be reached); `interface(node)`: its
    compute interface. Each probe runs in a thread of its own, one per node at a time."""

    def __init__(
        self,
        probe: Callable[[str], str],
        interface: Callable[[str], str],
        emit: Callable[[str], None],
    ):
        self.probe, self.interface, self.emit = probe, interface, emit
        self.said: list[str] = []  # every line said, for the run's record
        self._last: tuple[str, str] | None = None  # (node, kind) last said
        self._probing: set[str] = set()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def note(self, line: str) -> None:
        """Read one line of the job's output; a slow rank's warning starts its node's probe."""
        found = SLOW_LINE.search(line)
        if found is None:
            return
        node = found.group(2)
        with self._lock:
            if node in self._probing:
                return
            self._probing.add(node)
        rank, own, others = int(found.group(1)), float(found.group(3)), float(found.group(4))
        thread = threading.Thread(target=self._look, args=(node, rank, own, others), daemon=True)
        self._threads.append(thread)
        thread.start()

    def join(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for the probes under way."""
        for thread in list(self._threads):
            thread.join(timeout)

    def _look(self, node: str, rank: int, own: float, others: float) -> None:
        try:
            try:
                cause = causes.judge(*causes.parse(self.probe(node)), self.interface(node))
            except Exception as exc:  # noqa: BLE001 - a node that cannot be probed is said
                first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                cause = causes.Cause("unknown", f"unknown (not probed: {first})")
            line = (
                f"{node} is the straggler: rank {rank}'s own work takes {own * 1000:.0f} ms a "
                f"step, the others' {others * 1000:.0f} ms, and every rank waits for it; "
                f"cause: {cause.text}"
            )
            with self._lock:
                if self._last == (node, cause.kind):
                    return
                self._last = (node, cause.kind)
                self.said.append(line)
            self.emit(f"[launcher] {line}")
        finally:
            with self._lock:
                self._probing.discard(node)
