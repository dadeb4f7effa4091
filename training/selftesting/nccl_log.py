"""NCCL's own log in `make selftest`: one file per rank, kept in the run directory, read back
for the nccl-transport check and for a failed check's row, and echoed to the console.

The nccl-transport check needs NCCL's INFO lines (the network it chose, the HCAs, GPUDirect
RDMA) from a file: NCCL_DEBUG_FILE. NCCL then writes every line of every level to that file and
nothing to the console (NCCL 2.30.7's src/debug.cc: one destination, standard output unless
NCCL_DEBUG_FILE names another). So that nothing it says is lost:
- the file is `nccl-rank<RANK>.log` in the run directory (TMN_RUN_DIR), which the launcher
  copies home from the master (the other nodes keep theirs in the same directory); a rank run
  without the launcher keeps it in its temporary directory, removed at the end;
- a check that fails carries NCCL's WARN lines written while it ran in its row and `Error:`
  line (the cause behind torch's "unhandled system error"), or torch's "Last error:" where the
  file has none; the launcher's table of known failures then reads NCCL's own words there;
- a thread copies the file to standard output, where NCCL itself writes: its WARN lines always
  (what NCCL_DEBUG=WARN, the training image's setting, would print), every line where the job
  asked for NCCL's log (DEBUG=1, or NCCL_DEBUG=INFO or TRACE of its own).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import MutableMapping
from pathlib import Path
from typing import TextIO

from torch_multinode.cluster import nccl_transport
from torch_multinode.cluster.jobenv import RUN_DIR_VARIABLE

FILE_NAME = "nccl-rank{rank}.log"
ECHO_SECONDS = 0.25  # how often the thread looks for new lines
VERBOSE = ("INFO", "TRACE")  # an NCCL_DEBUG that asks for more than warnings


def subsystems(theirs: str | None) -> str:
    """NCCL_DEBUG_SUBSYS with INIT and NET, which the transport check reads, added to the job's
    own ("^..." excludes what it names: kept as it is)."""
    wanted = nccl_transport.NCCL_TRANSPORT_ENV["NCCL_DEBUG_SUBSYS"]
    if not theirs or not theirs.strip():
        return wanted
    if theirs.startswith("^"):
        return theirs
    names = [name.strip() for name in f"{theirs},{wanted}".split(",") if name.strip()]
    return ",".join(dict.fromkeys(name.upper() for name in names))


class NcclLog:
    """One rank's NCCL log file: its WARN lines since a mark, and its echo to `out`."""

    def __init__(self, path: Path, echo_all: bool, out: TextIO | None = None):
        self.path, self.echo_all = path, echo_all
        self.out = out if out is not None else sys.stdout
        self._echoed = 0  # bytes of the file already looked at by the echo
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def mark(self) -> int:
        """Where the file ends now: warnings_since(mark) gives what NCCL wrote after it."""
        try:
            return self.path.stat().st_size
        except OSError:
            return 0

    def _bytes(self, start: int) -> bytes:
        try:
            with open(self.path, "rb") as file:
                file.seek(start)
                return file.read()
        except OSError:
            return b""

    def read(self, start: int = 0) -> str:
        """The file from byte `start` on ("" while NCCL has written nothing)."""
        return self._bytes(start).decode(errors="replace")

    def warnings_since(self, mark: int) -> list[str]:
        return nccl_transport.nccl_warnings(self.read(mark))

    def explain(self, detail: str, mark: int, error: BaseException | None = None) -> str:
        """A failed check's `detail` with NCCL's own words: its WARN lines since `mark`, else
        the "Last error:" torch's NCCL error carries."""
        said = self.warnings_since(mark)
        if not said and error is not None:
            last = nccl_transport.last_error(str(error))
            said = [last] if last else []
        said = [line for line in said if line not in detail]
        return nccl_transport.with_nccl_words(detail, said)

    def echo(self) -> None:
        """Copy the complete lines NCCL added since the last call to `out`: all of them, or
        only its WARN lines."""
        data = self._bytes(self._echoed)
        complete = data[: data.rfind(b"\n") + 1]
        if not complete:
            return
        self._echoed += len(complete)
        lines = [
            line
            for line in complete.decode(errors="replace").splitlines()
            if line.strip() and (self.echo_all or nccl_transport.WARN_MARK in line)
        ]
        if lines:
            self.out.write("".join(f"{line}\n" for line in lines))
            self.out.flush()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._follow, name="nccl-log-echo", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the echo after a last look: nothing NCCL wrote before this call is left out."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.echo()

    def _follow(self) -> None:
        while not self._stop.wait(ECHO_SECONDS):
            self.echo()


def place(
    device_type: str,
    rank: int,
    scratch: Path,
    environ: MutableMapping[str, str] = os.environ,
) -> NcclLog | None:
    """This rank's NCCL log (None on the CPU: no NCCL), its variables set in `environ` before
    the first communicator exists (NCCL reads them once, at its first log line)."""
    if device_type != "cuda":
        return None
    run_dir = environ.get(RUN_DIR_VARIABLE)
    directory = Path(run_dir) if run_dir else scratch
    asked = environ.get("NCCL_DEBUG", "").strip().upper()
    path = directory / FILE_NAME.format(rank=rank)
    with contextlib.suppress(OSError):  # NCCL opens the file but makes no directory
        directory.mkdir(parents=True, exist_ok=True)
    environ["NCCL_DEBUG"] = "TRACE" if asked == "TRACE" else "INFO"
    environ["NCCL_DEBUG_SUBSYS"] = subsystems(environ.get("NCCL_DEBUG_SUBSYS"))
    environ["NCCL_DEBUG_FILE"] = str(path)
    return NcclLog(path, echo_all=asked in VERBOSE)
