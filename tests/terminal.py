"""A command on a pseudo-terminal of its own, typed into as a user types: for the prompts that
read the terminal (getpass opens /dev/tty, which a pipe cannot stand in for)."""

from __future__ import annotations

import fcntl
import os
import re
import select
import subprocess
import termios
import time
from pathlib import Path


def _own_terminal() -> None:
    """In the child: a session of its own whose controlling terminal is the pty (fd 0)."""
    os.setsid()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class Terminal:
    def __init__(self, argv: list[str], cwd: Path, env: dict[str, str] | None = None):
        master, slave = os.openpty()
        self.process = subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
            stdin=slave,
            stdout=slave,
            stderr=slave,
            preexec_fn=_own_terminal,
            close_fds=True,
        )
        os.close(slave)
        self.master = master
        self.transcript = ""
        self._seen = 0

    def _read(self, timeout: float) -> bool:
        ready, _, _ = select.select([self.master], [], [], timeout)
        if not ready:
            return True
        try:
            data = os.read(self.master, 65536)
        except OSError:  # EIO: the command closed its side
            return False
        if not data:
            return False
        self.transcript += data.decode(errors="replace").replace("\r\n", "\n")
        return True

    def expect(self, pattern: str, timeout: float = 120) -> re.Match:
        """Wait for `pattern` in what came since the last match; the match."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while True:
            found = regex.search(self.transcript, self._seen)
            if found:
                self._seen = found.end()
                return found
            if time.monotonic() > deadline or not self._read(0.2):
                if found := regex.search(self.transcript, self._seen):
                    self._seen = found.end()
                    return found
                raise AssertionError(
                    f"no {pattern!r} on the terminal; it shows:\n{self.transcript[-3000:]}"
                )

    def type(self, text: str) -> None:
        os.write(self.master, text.encode())

    def finish(self, timeout: float = 300) -> int:
        """Read to the end; the command's exit code."""
        deadline = time.monotonic() + timeout
        while self._read(0.2):
            if time.monotonic() > deadline:
                self.process.kill()
                raise AssertionError(f"still running after {timeout} s:\n{self.transcript[-3000:]}")
            if self.process.poll() is not None:
                while self._read(0.1) and select.select([self.master], [], [], 0)[0]:
                    pass
                break
        code = self.process.wait(timeout=30)
        os.close(self.master)
        return code
