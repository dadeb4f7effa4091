"""What every stage of the pre-flight run shares: the run's Options (and their defaults), one
command on one node under a wall-clock limit (`attempt`: its Attempt holds what the command
printed, or why it did not succeed, an exception of the link included, and how long it took),
that on many nodes at once (`parallel`), and the standard-library probes sent to a node as
source, `python -c` (sockprobe, softprobe), with the interpreter that runs them there.

netcheck.preflight orders the stages; netcheck.stages holds the ones that start listeners and
workers on the nodes. Nothing here prints or judges.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from torch_multinode.cluster.execution import Nodes, python_command
from torch_multinode.cluster.inventory import Host
from torch_multinode.cluster.remote import Result, on_all

HERE = Path(__file__).resolve().parent
SOCKPROBE = (HERE / "sockprobe.py").read_text()
SOFTPROBE = (HERE / "softprobe.py").read_text()
NODE_PYTHON = "python3"  # what Ansible needs on every node anyway; runs the stdlib probes

PORTS_TIMEOUT = 15.0
DEFAULT_TIMEOUT = 30.0
DEFAULT_SWEEP_TIMEOUT = 120.0
TCP_BYTES = 128 << 20
PAIRWISE_BYTES = 64 << 20


@dataclass(frozen=True)
class Options:
    nnodes: int | None = None
    """How many hosts, in inventory order (default: all)."""
    sweep: bool = False
    """Message sizes up to 64 MiB, and raw TCP around the ring to compare against."""
    pairwise: bool = False
    """Raw TCP between every pair of nodes, one pair at a time: finds the slow link."""
    timeout: float | None = None
    """Wall-clock seconds for each torch stage on a node (default 30, with the sweep 120)."""
    ft: bool = False
    """Whether every node reaches this machine on the lighthouse port (FT=1 jobs)."""
    tcp_bytes: int = TCP_BYTES
    pairwise_bytes: int = PAIRWISE_BYTES

    @property
    def stage_timeout(self) -> float:
        if self.timeout is not None:
            return self.timeout
        return DEFAULT_SWEEP_TIMEOUT if self.sweep else DEFAULT_TIMEOUT


@dataclass(frozen=True)
class Attempt:
    result: Result | None
    error: str | None
    seconds: float

    @property
    def ok(self) -> bool:
        return self.error is None and self.result is not None and self.result.ok

    @property
    def stdout(self) -> str:
        """What the command printed; asked of one that ran (`ok`)."""
        assert self.result is not None, "the command did not run"
        return self.result.stdout

    def why(self) -> str:
        """Why the command did not succeed, in one line."""
        if self.error is not None:
            return self.error
        assert self.result is not None
        return f"exit {self.result.exit_code}: {self.result.last_line or 'no output'}"

    def json(self, prefix: str = "") -> dict | None:
        """The last JSON line of stdout (after `prefix`), or None."""
        found = self.json_lines(prefix)
        return found[-1] if found else None

    def json_lines(self, prefix: str = "") -> list[dict]:
        """Every JSON object line of stdout that starts with `prefix`, in order."""
        found = []
        for line in self.result.stdout.splitlines() if self.result is not None else []:
            if line.startswith(prefix) and line[len(prefix) :].lstrip().startswith("{"):
                try:
                    found.append(json.loads(line[len(prefix) :]))
                except json.JSONDecodeError:
                    continue
        return found


def attempt(nodes: Nodes, host: Host, command: str, timeout: float) -> Attempt:
    started = time.monotonic()
    try:
        result = nodes.run(host, command, timeout)
    except Exception as exc:  # noqa: BLE001 - UserError, or anything else a dead link throws
        message = str(exc) or type(exc).__name__
        return Attempt(
            None, message.removeprefix(f"host '{host.name}': "), time.monotonic() - started
        )
    return Attempt(result, None, time.monotonic() - started)


def parallel(hosts: list[Host], work: Callable[[Host], Attempt]) -> dict[str, Attempt]:
    return on_all(hosts, work) if hosts else {}


def sockprobe(*args: str) -> str:
    return python_command(NODE_PYTHON, SOCKPROBE, *args)
