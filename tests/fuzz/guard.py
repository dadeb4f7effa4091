"""The net under every fuzzed call: it may not reach a host, start a process, signal one, or
change a file outside its own directory.

Python's audit hooks see each of those just before it happens (an `open` for writing, a
`socket.connect`, a DNS lookup, `subprocess.Popen`, ...). While a call is watched, the guard
records the attempt and raises Stopped in its place, so the attempt never takes effect; the test
then says whether that attempt was allowed. The hook is added once per process and does nothing
while no call is watched.

Seams (the launcher, netcheck's pre-flight, docker) raise Reached: the call got as far as real
work, which means its input was accepted.
"""

from __future__ import annotations

import io
import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from dataclasses import dataclass, field
from pathlib import Path

PROCESS_EVENTS = {
    "subprocess.Popen",
    "os.system",
    "os.posix_spawn",
    "os.exec",
    "os.spawn",
    "os.fork",
    "os.forkpty",
    "pty.spawn",
}
NETWORK_EVENTS = {
    "socket.connect",
    "socket.bind",
    "socket.sendto",
    "socket.sendmsg",
    "socket.getaddrinfo",
    "socket.gethostbyname",
    "socket.gethostbyname_ex",
    "socket.gethostbyaddr",
    "socket.getnameinfo",
    "http.client.connect",
    "urllib.Request",
    "ftplib.connect",
    "smtplib.connect",
}
SIGNAL_EVENTS = {"os.kill", "os.killpg", "signal.pthread_kill"}
# Events whose arguments name files they change: (event, indices of the path arguments).
CHANGE_EVENTS = {
    "os.mkdir": (0,),
    "os.remove": (0,),
    "os.rmdir": (0,),
    "os.rename": (0, 1),
    "os.chmod": (0,),
    "os.chown": (0,),
    "os.utime": (0,),
    "os.truncate": (0,),
    "os.link": (0, 1),
    "os.symlink": (1,),
    "shutil.rmtree": (0,),
    "shutil.copyfile": (1,),
    "shutil.copymode": (1,),
    "shutil.copystat": (1,),
    "shutil.move": (0, 1),
    "tempfile.mkstemp": (0,),
    "tempfile.mkdtemp": (0,),
    "os.mkfifo": (0,),
    "os.mknod": (0,),
}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


class Stopped(BaseException):
    """Raised in place of something a watched call must not do. A BaseException, so that no
    `except Exception` in the code under test can swallow it."""


class Reached(BaseException):
    """Raised by a seam: the call got as far as real work (SSH, docker, a launch)."""


@dataclass(frozen=True)
class Attempt:
    kind: str  # process, network, signal or write
    event: str
    detail: str


_ANSIBLE_LOCAL_TEMP = os.path.abspath(
    os.path.expanduser(os.environ.get("ANSIBLE_LOCAL_TEMP", "~/.ansible/tmp"))
)


class Guard:
    def __init__(self) -> None:
        self.allowed: tuple[str, ...] = ()
        self.watching = False
        self.attempts: list[Attempt] = []
        self.opened: list[str] = []
        """Every file the watched call opened, read or write (the security tests use it)."""
        self._local = threading.local()

    def __call__(self, event: str, args: tuple) -> None:
        if not self.watching or getattr(self._local, "busy", False):
            return
        self._local.busy = True  # what the hook itself does must not call it again
        try:
            attempt = self._classify(event, args)
        finally:
            self._local.busy = False
        if attempt is not None:
            self.attempts.append(attempt)
            raise Stopped(f"{attempt.kind}: {attempt.event} {attempt.detail}")

    def _classify(self, event: str, args: tuple) -> Attempt | None:
        if event in PROCESS_EVENTS:
            return Attempt("process", event, _short(args))
        if event in NETWORK_EVENTS:
            return Attempt("network", event, _short(args))
        if event in SIGNAL_EVENTS:
            return Attempt("signal", event, _short(args))
        if event == "open":
            path, mode, flags = args
            if not isinstance(path, int):
                self.opened.append(os.path.abspath(os.fsdecode(path)))
            writes = (
                any(c in mode for c in "wax+")
                if isinstance(mode, str)
                else (mode is None and isinstance(flags, int) and flags & _WRITE_FLAGS)
            )
            if writes and not self._inside(path):
                return Attempt("write", event, f"{path!r} mode {mode!r} flags {flags!r}")
            return None
        if event in CHANGE_EVENTS:
            for index in CHANGE_EVENTS[event]:
                if index < len(args) and not self._inside(args[index]):
                    return Attempt("write", event, _short(args))
        return None

    def _inside(self, path: object) -> bool:
        if isinstance(path, int) or path is None:  # a file descriptor: opened and checked before
            return True
        try:
            text = os.fsdecode(path)
        except TypeError:
            return False
        absolute = os.path.abspath(text)
        if f"{os.sep}__pycache__{os.sep}" in absolute + os.sep:
            return True  # Python caching the bytecode of a module imported on first use
        if absolute.startswith(_ANSIBLE_LOCAL_TEMP + os.sep):
            return True  # ansible's own scratch directory, made on its first inventory read
        return any(absolute == root or absolute.startswith(root + os.sep) for root in self.allowed)

    @contextmanager
    def watch(self, *allowed: Path) -> Iterator[list[Attempt]]:
        """Watch the calls made inside the block; yields the list of what was stopped."""
        self.allowed = tuple(os.path.abspath(p) for p in allowed)
        self.attempts = []
        self.opened = []
        self.watching = True
        try:
            yield self.attempts
        finally:
            self.watching = False


_GUARD: Guard | None = None


def guard() -> Guard:
    """The process's one guard (audit hooks cannot be removed, so there is only ever one)."""
    global _GUARD
    if _GUARD is None:
        _GUARD = Guard()
        sys.addaudithook(_GUARD)
    return _GUARD


def _short(args: tuple) -> str:
    text = repr(args)
    return text if len(text) < 300 else text[:297] + "..."


@dataclass
class Outcome:
    """How one CLI call ended."""

    argv: list[str]
    code: int | None
    """The exit status; None when the call reached real work instead."""
    out: str
    err: str
    reached: str | None = None
    stopped: list[Attempt] = field(default_factory=list)
    opened: list[str] = field(default_factory=list)

    def kind(self) -> str:
        """What kind of ending this was, for Hypothesis's statistics."""
        if self.reached is not None:
            return f"reached {self.reached.split(' (')[0]}"
        if self.code:
            return f"exit {self.code}: {self.err.split(':')[1].strip()[:30] if ':' in self.err else ''}"
        return "exit 0"

    def __str__(self) -> str:
        return (
            f"argv={self.argv!r} code={self.code!r} reached={self.reached!r}\n"
            f"stdout={self.out[-2000:]!r}\nstderr={self.err[-2000:]!r}\nstopped={self.stopped!r}"
        )


def call(main: Callable[[list[str]], int], argv: list[str], *allowed: Path) -> Outcome:
    """main(argv) in this process, watched, with its output captured."""
    out, err = io.StringIO(), io.StringIO()
    reached = None
    watcher = guard()
    with redirect_stdout(out), redirect_stderr(err), watcher.watch(*allowed) as stopped:
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
        except Reached as exc:
            code, reached = None, str(exc)
        except Stopped as exc:
            code, reached = None, f"stopped: {exc}"
    return Outcome(
        argv,
        0 if code is None and reached is None else code,
        out.getvalue(),
        err.getvalue(),
        reached,
        list(stopped),
        list(watcher.opened),
    )


def assert_clean(outcome: Outcome, *, processes: bool = False) -> None:
    """The contract of the project's CLIs, for any input:

    - nothing reached the network, signalled a process or changed a file outside the test's
      directory (a process start counts as accepted input only where `processes` says so);
    - no traceback, and an exit status that is an int;
    - exit 0 with nothing on stderr but `Warning: ...` lines, or exit 2 with one `Error: ...`
      line per problem found (an inventory's are all reported in one pass; warnings may stand
      beside them) and nothing on stdout; or the input was accepted and the call reached real
      work.
    """
    forbidden = [a for a in outcome.stopped if not (processes and a.kind == "process")]
    assert forbidden == [], str(outcome)
    assert "Traceback" not in outcome.out + outcome.err, str(outcome)
    if outcome.reached is not None:
        assert "Error:" not in outcome.err, str(outcome)
        return
    assert isinstance(outcome.code, int), str(outcome)
    lines = outcome.err.splitlines()
    if outcome.code == 0:
        assert all(line.startswith("Warning: ") for line in lines), str(outcome)
    else:
        assert outcome.code == 2, str(outcome)
        assert any(line.startswith("Error: ") for line in lines), str(outcome)
        assert all(line.startswith(("Error: ", "Warning: ")) for line in lines), str(outcome)
        assert outcome.err.endswith("\n") and outcome.out == "", str(outcome)
