"""A local job's output, relayed as it comes (launch.local): to the terminal and the node's
log, its heartbeats hidden as on the nodes, from a thread of its own so that the launcher's
main thread stays free for Ctrl-C."""

from __future__ import annotations

import collections
import os
import re
import threading
from collections.abc import Callable

from torch_multinode.launch.progress import HEARTBEAT

_ENDS = re.compile(rb"(\r\n|\n|\r)")
_HEARTBEAT = HEARTBEAT.encode()


def relay(
    stream,
    out,
    tail: collections.deque,
    log=None,
    observe: Callable[[str], bool] | None = None,
) -> None:
    """Everything the job writes, to `out` as it comes (a progress bar's carriage returns
    included: the terminal redraws it) and to `log`, and its non-blank lines into `tail`. Each
    non-blank line is first given to `observe` (the hang watch's clock, launch.progress), which
    hides it by answering False (a heartbeat), as on the nodes: neither shown nor logged. So the
    start of a line that may still become a heartbeat waits until the line ends or cannot."""
    line = b""  # the current line so far
    held = b""  # its part not written yet
    after_hidden = False  # a hidden line ended in "\r": a "\n" next is its "\r\n"'s
    while chunk := os.read(stream.fileno(), 65536):
        shown: list[bytes] = []
        for piece in _ENDS.split(chunk):
            if not piece:
                continue
            if _ENDS.fullmatch(piece):
                text = line.decode(errors="replace")
                if piece == b"\n" and not line and after_hidden:
                    after_hidden = False
                    continue
                if text.strip() and observe is not None and not observe(text):
                    after_hidden = piece == b"\r"
                else:
                    shown += [held, piece]
                    after_hidden = False
                    if text.strip():
                        tail.append(text)
                line = held = b""
                continue
            after_hidden = False
            line, held = line + piece, held + piece
            if observe is None or not _HEARTBEAT.startswith(line.strip()):
                shown.append(held)
                held = b""
        _write(b"".join(shown), out, log)
    text = line.decode(errors="replace")
    if text.strip() and (observe is None or observe(text)):
        _write(held, out, log)
        tail.append(text)


class Relaying:
    """`relay` in a thread of its own while the main thread waits in short steps: a Ctrl-C or
    SIGTERM that the kernel hands to another thread (the hang watch's) is then acted on at once,
    where a main thread blocked in a read of a silent job (a rank paused or hung) would only see
    it at the job's next line."""

    def __init__(self, stream, out, tail: collections.deque, log, observe) -> None:
        self.stream = stream
        self.raised: list[BaseException] = []
        self.thread = threading.Thread(
            target=self._run, args=(stream, out, tail, log, observe), daemon=True
        )

    def _run(self, *args) -> None:
        try:
            relay(*args)
        except BaseException as raised:  # e.g. a closed terminal: raised in the main thread
            self.raised.append(raised)

    def follow(self) -> None:
        """Until the job's output ends; what relay raised, raised here."""
        self.thread.start()
        while self.thread.is_alive():
            self.thread.join(0.2)
        if self.raised:
            raise self.raised[0]

    def finish(self, seconds: float) -> None:
        """After the job was stopped: its last lines, for up to `seconds` (a rank that outlived
        torchrun may hold its output open)."""
        if self.thread.ident is not None:
            self.thread.join(seconds)

    def close(self) -> bool:
        """The job's output closed, unless the relay still reads it (then it is left to the
        exit); whether the relay is done with the log."""
        if self.thread.is_alive():
            return False
        self.stream.close()
        return True


def _write(data: bytes, out, log) -> None:
    if not data:
        return
    if log is not None:  # first: a Ctrl-C right after a line was seen finds it in the log
        log.write(data)
        log.flush()
    out.write(data)
    out.flush()
