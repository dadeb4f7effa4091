"""A process's output read as it comes, each line timed: what the bench's sections and the tests
that kill or slow a node mid-job measure from (seconds from a change to the line that says it).
One reader for all of them: bench section 19's jobs (latency), section 18's node loss (nodeloss)
and the tests' launchers (tests/training/conftest.py)."""

from __future__ import annotations

import re
import subprocess
import threading
import time
from typing import TextIO


class TimedOutput:
    """A process's output (text mode, stderr merged), read from now on by a thread of its own,
    each line timed in seconds from `since` (a time.monotonic()) and, with a `log`, written to it
    after that time. Reading goes on while the caller does something slow, such as a `docker
    kill` that waits for Docker to unmount the dead container: what the process did and when is
    then measured apart from how long the caller's own step took. The caller closes `log`."""

    def __init__(self, process: subprocess.Popen, since: float, log: TextIO | None = None):
        self.process, self.since, self.log = process, since, log
        self.lines: list[tuple[float, str]] = []
        self.ended: float | None = None  # seconds from `since` to the end of the output
        self.marks: list[tuple[float, str]] = []  # what the caller did meanwhile, and when
        self._changed = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None  # stdout=PIPE
        for line in self.process.stdout:
            at = time.monotonic() - self.since
            if self.log is not None:
                self.log.write(f"{at:8.1f} {line}")
                self.log.flush()
            with self._changed:
                self.lines.append((at, line))
                self._changed.notify_all()
        with self._changed:
            self.ended = time.monotonic() - self.since
            self._changed.notify_all()

    def now(self) -> float:
        """Seconds since `since`, on the lines' clock."""
        return time.monotonic() - self.since

    @property
    def text(self) -> str:
        with self._changed:
            return "".join(line for _, line in self.lines)

    def mark(self, what: str) -> None:
        """Note that the caller did `what` now: among the lines in `stamped`, and in the log."""
        at = self.now()
        with self._changed:
            self.marks.append((at, f"--- {what} ---\n"))
        if self.log is not None and not self.log.closed:
            self.log.write(f"{at:8.1f} ---- {what}\n")
            self.log.flush()

    @property
    def stamped(self) -> str:
        """Every line after the seconds since `since` when it arrived, the marks among them."""
        with self._changed:
            timed = sorted([*self.lines, *self.marks], key=lambda entry: entry[0])
        return "".join(f"+{at:5.1f} s  {line}" for at, line in timed)

    def matching(
        self, wanted: str | re.Pattern, after: float = 0.0, timeout: float = 60
    ) -> tuple[float, str] | None:
        """The first line from `after` seconds on that contains `wanted` (a string) or matches
        it (a pattern), waited for up to `timeout` seconds or the output's end (every line read,
        not only the process ended): its time and text, or None where none came."""

        def holds(line: str) -> bool:
            return bool(wanted.search(line)) if isinstance(wanted, re.Pattern) else wanted in line

        def found() -> tuple[float, str] | None:
            return next(
                ((at, line) for at, line in self.lines if at >= after and holds(line)), None
            )

        with self._changed:
            self._changed.wait_for(
                lambda: found() is not None or self.ended is not None, max(0.0, timeout)
            )
            return found()

    def first(self, wanted: str | re.Pattern, timeout: float = 60, after: float = 0.0) -> float:
        """Seconds from `since` to the first line from `after` seconds on holding `wanted`; an
        AssertionError with the output where none came within `timeout` seconds."""
        hit = self.matching(wanted, after=after, timeout=timeout)
        if hit is None:
            raise AssertionError(f"never saw {wanted!r}; output:\n{self.stamped[-4000:]}")
        return hit[0]

    def end(self, timeout: float = 60) -> float:
        """Seconds from `since` to the end of the output; the process is waited for. Killed,
        and an AssertionError, where it runs on past `timeout`."""
        with self._changed:
            self._changed.wait_for(lambda: self.ended is not None, timeout)
            ended = self.ended
        if ended is None:
            self.process.kill()
            raise AssertionError(f"still running {timeout:g} s on, killed:\n{self.stamped[-4000:]}")
        self.process.wait()
        return ended
