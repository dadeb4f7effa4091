"""One node's remote output as the launcher shows it: whole lines with the node's prefix, and
progress bars redrawn with a bare carriage return (tqdm, the Hugging Face Trainer) shown every
few seconds instead of once per redraw."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from pathlib import Path

PROGRESS_EVERY = 3.0
"""Seconds between two progress states shown for one node: tqdm redraws up to ten times a
second, and eight nodes doing so would bury every other line."""

_BREAKS = re.compile(r"(\r\n|\n|\r)")


class JobLog:
    """A node's log (NODE.log in the job's log directory), written as the job's lines come, over
    SSH and from a local job alike. A log that cannot be written (a full disk) ends there, said
    once through `say`: it never stops the job nor what is shown of it."""

    def __init__(self, path: Path, say: Callable[[str], None]):
        self.path, self.say = path, say
        self.file = path.open("ab")

    @property
    def closed(self) -> bool:
        return self.file.closed

    def write(self, data: bytes) -> None:
        self._guarded(lambda: self.file.write(data))

    def flush(self) -> None:
        self._guarded(self.file.flush)

    def close(self) -> None:
        self._guarded(self.file.close)

    def _guarded(self, act: Callable[[], object]) -> None:
        if self.file.closed:
            return
        try:
            act()
        except OSError as exc:
            try:
                self.file.close()  # what its buffer held is lost with the error
            except OSError:
                pass
            self.say(
                f"[launcher] the log {self.path} stops here: {exc.strerror or exc}; the job goes "
                "on, its output still shown here"
            )


class NodeOutput:
    """A file-like that fabric writes a node's output into (with a pty, so lines end in "\\r\\n").

    Each line is emitted as `prefix line` the moment it ends, appended to `outcome.tail` and
    written to `log` without the prefix; blank lines are skipped. A line is shown as a terminal
    leaves it: the text after its last bare "\\r", or, when that is blank, the last text before
    it that was not.

    A bare "\\r" redraws the line: the text before it is the line's latest progress state. The
    latest state is emitted at most once every `progress_every` seconds (the first one at once),
    from `write` or from `tick`, which the launcher calls a few times a second so that a redraw
    followed by silence still shows: once nothing has arrived since the previous tick, the text
    after the last "\\r" counts as a state too (tqdm starts each redraw with its "\\r"). States
    replaced before they were due are never shown: the terminal replaced them too. The line's
    final text is always shown when it ends, unless it is exactly the state just shown for it.

    Lines are never reordered: everything is emitted in the order it arrived. A state that was
    not shown and is then wiped by a blank redraw (tqdm with leave=False, or tqdm.write clearing
    the bar to print a line) is emitted before whatever text follows, whether due or not: it
    may be the bar's final state, and no later line can show it in the right place.

    `flush` only flushes the log: invoke calls it after every chunk it reads, so it cannot mean
    "the line has ended". `close` ends a line left unfinished.
    """

    def __init__(
        self,
        prefix: str,
        emit: Callable[[str], None],
        outcome,
        log: Path | None = None,
        progress_every: float = PROGRESS_EVERY,
        clock: Callable[[], float] = time.monotonic,
        observe: Callable[[str], bool] | None = None,
    ):
        self.prefix, self.emit, self.outcome = prefix, emit, outcome
        self.observe = observe  # sees every line first; False: the line is not shown
        self.progress_every, self.clock = progress_every, clock
        self.log = JobLog(log, emit) if log else None
        # fabric's reader thread writes while the launcher's main loop ticks.
        self.lock = threading.Lock()
        self.held_return = False  # a chunk ended in "\r": the next one says if it was "\r\n"
        self.text = ""  # the current line since its last bare "\r"
        self.redrawn = False  # the current line has had a bare "\r"
        self.state: str | None = None  # the current line's latest progress state, never blank
        self.wiped = False  # ...which a blank redraw has since erased
        self.shown: str | None = None  # the state of the current line emitted last
        self.progress_shown_at: float | None = None
        self.quiet = False  # nothing has been written since the previous tick

    def write(self, text: str) -> int:
        with self.lock:
            chunk = ("\r" if self.held_return else "") + text
            self.held_return = chunk.endswith("\r")
            if self.held_return:
                chunk = chunk[:-1]
            if text:
                self.quiet = False
            for piece in _BREAKS.split(chunk):
                if piece in ("\r\n", "\n"):
                    self._end_line()
                elif piece == "\r":
                    self._end_state()
                else:
                    self.text += piece
            # Only states ended by a "\r" here: the text after the last one may be cut mid-chunk.
            self._show_if_due(self.state)
        return len(text)

    def tick(self) -> None:
        """Show a pending progress state that is due, even when no text arrives."""
        with self.lock:
            if self.quiet and self.held_return:
                # Nothing followed the "\r" for a whole tick: a redraw, not half of a "\r\n".
                # Were it one after all, the line would still be emitted once, when it ends.
                self.held_return = False
                self._end_state()
            if self.quiet and self.redrawn and self.text.strip() and not self._wiped_unshown():
                # Nothing has arrived since the previous tick: the text after the last "\r" is
                # whole, and it replaced the states before it.
                self.state, self.wiped = self.text, False
            self.quiet = True
            self._show_if_due(self.state)

    def flush(self) -> None:
        with self.lock:
            if self.log is not None:
                self.log.flush()

    def close(self) -> None:
        """Safe to call more than once, and from any error path."""
        with self.lock:
            try:
                self.held_return = False
                if self.text or self.state is not None:
                    self._end_line()
            finally:
                if self.log is not None:
                    self.log.close()

    def _end_state(self) -> None:
        """A bare "\\r": the text before it is the line's latest state."""
        self.redrawn = True
        if self.text.strip():
            self._show_wiped()
            self.state, self.wiped = self.text, False
        elif self.state is not None:
            self.wiped = True
        self.text = ""

    def _end_line(self) -> None:
        final: str | None
        try:
            if self.text.strip():
                self._show_wiped()
                final = self.text
            else:
                final = self.state
            if final is not None and final.strip() and final != self.shown:
                self._emit(final)
        finally:
            # Even when emitting failed: a second close must not emit the line again.
            self.text, self.redrawn, self.state, self.wiped = "", False, None, False
            self.shown = None

    def _wiped_unshown(self) -> bool:
        return self.wiped and self.state != self.shown

    def _show_wiped(self) -> None:
        """Before new text replaces a wiped state that was never shown, show it."""
        if self._wiped_unshown() and self.state != self.text:
            assert self.state is not None  # wiped: there was a state
            self._show(self.state)

    def _show_if_due(self, state: str | None) -> None:
        if state is None or state == self.shown:
            return
        now = self.clock()
        if self.progress_shown_at is None or now - self.progress_shown_at >= self.progress_every:
            self._show(state)

    def _show(self, state: str) -> None:
        self._emit(state)
        self.shown, self.progress_shown_at = state, self.clock()

    def _emit(self, line: str) -> None:
        if self.observe is not None and not self.observe(line):
            return
        self.outcome.tail.append(line)
        self.emit(f"{self.prefix} {line}")
        if self.log is not None:
            self.log.write(f"{line}\n".encode())
