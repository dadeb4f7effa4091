"""A `docker build`'s output, shown live while the training image builds (provision.images):
each step's line, a short line while one step runs long, and on failure the output's last lines
and the line that says why. Pure reading of the builder's output, plus the thread that feeds it.
"""

from __future__ import annotations

import collections
import queue
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

Progress = Callable[[str], None]

# Both builders' output is read line by line: the legacy builder's ("Step 3/12 : RUN ...",
# then the step's own output) and BuildKit's with --progress=plain ("#5 [2/6] RUN ...",
# "#5 12.3 Collecting ...", "#5 DONE 40.1s"). A user sees each step's line, a short line every
# TICK_EVERY seconds while one step runs long (a base pulled, pip installing, a big layer
# written), and on failure the output's last lines: never the hundreds of lines pip prints.

TICK_EVERY = 10.0  # seconds between "still running" lines in a step's first minute (then 3x)
TAIL_LINES = 20  # the output's last lines shown when a build fails
SHOWN_CHARS = 100  # of one output line in a progress line

_LEGACY_STEP = re.compile(r"^Step (\d+/\d+) : (.*)$")
_BUILDKIT_LINE = re.compile(r"^#(\d+) (.*)$")
_BUILDKIT_STEP = re.compile(r"^\[(?:(\S+) )?(\d+/\d+)\] (.*)$")
_BUILDKIT_OUTPUT = re.compile(r"^\d+\.\d+ (.*)$")  # "12.3 Collecting ...": seconds, output
_BUILDKIT_END = re.compile(r"^(DONE \d+(\.\d+)?s|CACHED|CANCELED|ERROR\b.*)$")
# What the legacy builder says about its own work, not the step's output.
_LEGACY_OWN = (" ---> ", "Removing intermediate container", "Sending build context")
# The docker client's notice before a legacy build (3 lines), not part of the build.
_LEGACY_NOTICE = "DEPRECATED: The legacy builder is deprecated"
_FAILURES = re.compile(r"^(ERROR|Error|error|The command '|failed to |unable to )")


def duration(seconds: float) -> str:
    """A time as progress lines and summaries say it: "42 s", "2 min 05 s"."""
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds} s"
    return f"{seconds // 60} min {seconds % 60:02d} s"


def _clean(text: str, limit: int = SHOWN_CHARS) -> str:
    """One output line as a progress line shows it: what a carriage return left visible,
    control characters as spaces, cut to `limit` characters."""
    text = text.rstrip("\r\n").rsplit("\r", 1)[-1]
    text = "".join(c if c.isprintable() else " " for c in text).strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _said(line: str) -> str:
    """A line of output without BuildKit's vertex number and seconds ("#5 12.3 ")."""
    vertex = _BUILDKIT_LINE.match(line)
    if vertex is None:
        return line.strip()
    output = _BUILDKIT_OUTPUT.match(vertex[2])
    return (output[1] if output else vertex[2]).strip()


@dataclass
class _Phase:
    """What the build is doing: a step ("step 5/12") or BuildKit's other work ("exporting to
    image"), since when, and its latest output line."""

    name: str
    started: float
    latest: str = ""
    latest_at: float = 0.0
    next_tick: float = 0.0


class BuildWatch:
    """What a `docker build`'s output shows a user, fed one (time, line) at a time; a line of
    None says only that time passed. The legacy builder's and BuildKit's plain output are both
    read, told apart by their lines, so nothing needs to know beforehand which builder runs.

    `feed` returns the lines to show: each step's line ("  Step 5/12 : RUN ..."), and while a
    step runs long, one line after `every` seconds and again every `every` seconds for its first
    minute, then every 3 x `every` ("  ... step 5/12 still running (40 s): <its latest output
    line>"). On failure `failure_lines` is the output's last lines and `reason` the line that
    says why."""

    def __init__(self, every: float = TICK_EVERY):
        self.every = every
        self.builder: str | None = None  # "legacy" or "buildkit", once a line tells
        self.phase: _Phase | None = None
        self.last_step = ""  # the step the build reached ("5/12"), for the error line
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._open: dict[str, _Phase] = {}  # BuildKit: the vertices under way, by number
        self._notice = False  # inside the client's notice about the legacy builder

    def feed(self, now: float, text: str | None) -> list[str]:
        shown = [] if text is None else self._line(now, text.rstrip("\r\n"))
        return shown + self._tick(now)

    def _line(self, now: float, text: str) -> list[str]:
        if text.startswith(_LEGACY_NOTICE):
            self._notice = True
        elif self._notice and not text[:1].isspace():
            self._notice = False
        if self._notice or not text.strip():
            return []
        self.tail.append(text)
        step = _LEGACY_STEP.match(text) if self.builder != "buildkit" else None
        if step:
            self.builder = "legacy"
            return self._begin(now, step[1], step[2])
        vertex = _BUILDKIT_LINE.match(text) if self.builder != "legacy" else None
        if vertex and (self.builder == "buildkit" or vertex[2].startswith("[")):
            self.builder = "buildkit"
            return self._buildkit(now, vertex[1], vertex[2])
        if text.startswith("Successfully built "):
            self.phase = None  # the legacy build is done; only the tag is left
        elif self.builder == "legacy" and self.phase and not text.startswith(_LEGACY_OWN):
            self._output(now, self.phase, text)
        return []

    def _begin(self, now: float, step: str, what: str, stage: str = "") -> list[str]:
        self.last_step = step
        name = f"step {step}" + (f" of {stage}" if stage else "")
        self.phase = _Phase(name, now, next_tick=now + self.every)
        return [f"  Step {step}{f' ({stage})' if stage else ''} : {_clean(what)}"]

    def _buildkit(self, now: float, number: str, rest: str) -> list[str]:
        if number not in self._open:
            if _BUILDKIT_END.match(rest):
                return []  # the end of a vertex whose start went by
            step = _BUILDKIT_STEP.match(rest)
            if step:
                shown = self._begin(now, step[2], step[3], step[1] or "")
            else:
                what = rest.removeprefix("[internal] ")
                self.phase, shown = _Phase(_clean(what), now, next_tick=now + self.every), []
            assert self.phase is not None  # begun on either branch
            self._open[number] = self.phase
            return shown
        phase = self._open[number]
        if _BUILDKIT_END.match(rest):
            del self._open[number]
            if phase is self.phase:  # the newest vertex still under way, if any, is shown next
                self.phase = next(reversed(self._open.values()), None)
            return []
        output = _BUILDKIT_OUTPUT.match(rest)
        self._output(now, phase, output[1] if output else rest)
        return []

    def _output(self, now: float, phase: _Phase, text: str) -> None:
        if _clean(text):
            phase.latest, phase.latest_at = _clean(text), now

    def _tick(self, now: float) -> list[str]:
        phase = self.phase
        if phase is None or now < phase.next_tick:
            return []
        running = now - phase.started
        while phase.next_tick <= now:  # on the schedule, not drifting with the events' times
            since = phase.next_tick - phase.started
            phase.next_tick += self.every if since < 6 * self.every else 3 * self.every
        line = f"  ... {phase.name} still running ({duration(running)})"
        if not phase.latest:
            return [f"{line}, no output yet"]
        if now - phase.latest_at >= self.every:
            quiet = duration(now - phase.latest_at)
            return [f"{line}, no output for {quiet}; last: {phase.latest}"]
        return [f"{line}: {phase.latest}"]

    def where(self) -> str:
        """' at step 5/12' once a step began, for the error line ('' before)."""
        return f" at step {self.last_step}" if self.last_step else ""

    def reason(self) -> str:
        """The output's line that says why the build failed: the builder's own error line, else
        the last line ('no output' when there was none)."""
        lines = [_said(line) for line in self.tail]
        said = [line for line in lines if _FAILURES.match(line)]
        why = (said or lines or ["no output"])[-1]
        return _clean(why.removeprefix("ERROR: "), 2 * SHOWN_CHARS)

    def failure_lines(self) -> list[str]:
        """The output's last lines (up to TAIL_LINES), indented, under one line that says so."""
        if not self.tail:
            return []
        return [f"  The build's last {len(self.tail)} lines:"] + [
            f"    {line}" for line in self.tail
        ]


def build_events(
    stream: Iterable[str], clock: Callable[[], float] = time.monotonic, poll: float = 1.0
) -> Iterator[tuple[float, str | None]]:
    """A build's output as BuildWatch reads it: (time, line) for each line as it comes, and
    (time, None) after `poll` seconds without one, so that a step silent for minutes is still
    reported. A thread reads `stream`; the events end when it does."""
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        try:
            for line in stream:
                lines.put(line)
        finally:
            lines.put(None)

    threading.Thread(target=read, name="docker-build-output", daemon=True).start()
    while True:
        try:
            line = lines.get(timeout=poll)
        except queue.Empty:
            yield clock(), None
            continue
        if line is None:
            return
        yield clock(), line


def watch(
    events: Iterable[tuple[float, str | None]], progress: Progress, every: float = TICK_EVERY
) -> BuildWatch:
    """Every event through a BuildWatch, what it shows given to `progress` as it comes; the
    watch, for the lines a failure shows."""
    watched = BuildWatch(every)
    for now, text in events:
        for line in watched.feed(now, text):
            progress(line)
    return watched
