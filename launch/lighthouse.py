"""The torchft lighthouse of an FT=1 job (training.distributed.replicas): the one process every
replica group's manager reports to and gets its quorum from. The launcher runs it where no
single node's loss takes it down (the controller) for the job's length, and stops it whatever
happens; torchft installs it beside its Python package (`torchft_lighthouse`, Rust)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from torch_multinode.cluster.errors import UserError
from torch_multinode.cluster.versions import TORCHFT_VERSION

BINARY = "torchft_lighthouse"
# Its script imports torchft, and so torch: 2.5 s on this idle machine, many times that on a
# loaded one.
START_SECONDS = 90.0
# A group whose manager sent no heartbeat for this long is out of the next quorum.
HEARTBEAT_TIMEOUT_MS = 5000
# How long a quorum waits for groups that heartbeat but have not asked to join yet (every group
# at the start; a group that came back): past it, the quorum forms without them.
JOIN_TIMEOUT_MS = 5000
QUORUM_TICK_MS = 100
LISTENING = "Lighthouse listening on"  # what it logs once bound (torchft 0.2.0)


def binary() -> str:
    """torchft_lighthouse beside this Python (its venv's bin/), else on PATH."""
    here = Path(sys.executable).parent / BINARY
    found = str(here) if here.exists() else shutil.which(BINARY)
    if found is None:
        raise UserError(
            f"{BINARY} is not installed on this machine, which runs the replica groups' lighthouse",
            hint=f"pip install torchft=={TORCHFT_VERSION} (make venv installs it)",
        )
    return found


def command(address: str, port: int, min_groups: int) -> list[str]:
    return [
        binary(),
        "--min_replicas",
        str(min_groups),
        "--bind",
        f"{address}:{port}",
        "--quorum_tick_ms",
        str(QUORUM_TICK_MS),
        "--join_timeout_ms",
        str(JOIN_TIMEOUT_MS),
        "--heartbeat_timeout_ms",
        str(HEARTBEAT_TIMEOUT_MS),
    ]


@contextmanager
def running(address: str, port: int, min_groups: int, log: Path) -> Iterator[str]:
    """The lighthouse listening on `address`:`port` until the block ends (its output in `log`);
    the URL the groups' managers are given (TORCHFT_LIGHTHOUSE)."""
    with log.open("ab") as out:
        since = out.tell()
        process = subprocess.Popen(
            command(address, port, min_groups),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C reaches the launcher, which stops it itself
        )
    try:
        _wait_listening(process, address, port, log, since)
        yield f"http://{address}:{port}"
    finally:
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _wait_listening(process: subprocess.Popen, address: str, port: int, log: Path, since: int):
    """Until the lighthouse says it listens (a line in `log` past offset `since`): a port in use
    makes it exit, with the reason as its last line."""
    deadline = time.monotonic() + START_SECONDS
    while time.monotonic() < deadline:
        said = log.read_bytes()[since:].decode(errors="replace")
        if LISTENING in said:
            return
        if process.poll() is not None:
            lines = said.strip().splitlines() or ["no output"]
            raise UserError(
                f"the torchft lighthouse on {address}:{port} exited ({process.returncode}): "
                f"{lines[-1]}",
                hint=f"the port is free on this machine (ss -ltnp | grep {port}), or another "
                "lighthouse port",
            )
        time.sleep(0.1)
    raise UserError(
        f"the torchft lighthouse on {address}:{port} was not listening after "
        f"{START_SECONDS:.0f} s (its output: {log})"
    )
