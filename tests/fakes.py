"""The one fake of cluster.execution.Nodes: nodes answered by code, for netcheck's and the
launcher's unit tests alike. No network, no SSH.

`respond(host, command)` says what a node answers: a Result, or a string (its stdout, exit 0).
The default answers every command with exit 0 and nothing; netcheck's FakeCluster and the
launcher's tests say more by overriding it or with `responder`. `stream(host, command, out)`
is what a job's session prints and exits with (default: nothing, exit 0).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field

from torch_multinode.cluster.errors import UserError
from torch_multinode.cluster.inventory import Host
from torch_multinode.cluster.remote import Result


@dataclass
class FakeNodes:
    hosts: list[Host] = field(default_factory=list)
    down: set[str] = field(default_factory=set)
    """Nodes that do not answer at all: commands time out, the SSH port takes no connection."""
    refused: set[str] = field(default_factory=set)
    """Nodes whose SSH port is open but whose SSH connections fail at once."""
    failing_first: dict[str, int] = field(default_factory=dict)
    """Per node, how many commands time out before one works (a node coming back)."""
    responder: Callable[[Host, str], Result | str] | None = None
    streamer: Callable[[Host, str, object], int] | None = None
    """What a job's session does (it writes its output to the third argument): its exit status."""
    commands: list[tuple[str, str]] = field(default_factory=list)
    """(node, command) in the order they were sent, by `run` and by sessions."""
    probes: list[tuple[str, float]] = field(default_factory=list)
    """(node, timeout) of every `answers` call."""
    closed: bool = False

    def __post_init__(self):
        self._sent = collections.Counter()

    # --- cluster.execution.Nodes ---------------------------------------------------------

    def run(self, host: Host, command: str, timeout: float) -> Result:
        self.commands.append((host.name, command))
        self._sent[host.name] += 1
        answer = self.respond(host, command)
        if host.name in self.down or self._sent[host.name] <= self.failing_first.get(host.name, 0):
            raise UserError(
                f"host '{host.name}': cannot SSH to {host.ssh_address}:22: timed out", exit_code=1
            )
        return answer if isinstance(answer, Result) else Result(host.name, command, 0, answer, "")

    def session(self, host: Host) -> FakeSession:
        return FakeSession(self, host)

    def answers(self, host: Host, timeout: float) -> bool:
        self.probes.append((host.name, timeout))
        return host.name not in self.down

    def ship_code(self, hosts) -> str | None:
        return None  # the fake nodes import the project's code already

    def close(self) -> None:
        self.closed = True

    # --- what the nodes say ----------------------------------------------------------------

    def respond(self, host: Host, command: str) -> Result | str:
        return self.responder(host, command) if self.responder else ""

    def stream(self, host: Host, command: str, out) -> int:
        return self.streamer(host, command, out) if self.streamer else 0


class FakeSession:
    """cluster.remote.Remote's part that the launcher uses, answered by its FakeNodes."""

    def __init__(self, nodes: FakeNodes, host: Host):
        self.nodes, self.host = nodes, host

    def connect(self) -> None:
        if self.host.name in self.nodes.refused:
            raise UserError(
                f"host '{self.host.name}': cannot SSH to it: connection refused", exit_code=1
            )
        if self.host.name in self.nodes.down:
            raise UserError(f"host '{self.host.name}': cannot SSH to it: timed out", exit_code=1)

    def run(self, command: str, timeout: float | None = 60, check: bool = False, stdin=None):
        self.connect()
        result = self.nodes.run(self.host, command, timeout or 60)
        if check and not result.ok:
            raise UserError(
                f"host '{self.host.name}': {command!r} exited {result.exit_code}", exit_code=1
            )
        return result

    def stream(self, command: str, out) -> int:
        self.connect()
        self.nodes.commands.append((self.host.name, command))
        return self.nodes.stream(self.host, command, out)

    def close(self) -> None:
        pass

    def __enter__(self) -> FakeSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def autodetect_answer(
    host: Host,
    command: str,
    interfaces: dict[str, list[str]] | None = None,
    gpus: int | str | None = None,
) -> str:
    """What a node answers cluster.autodetect's probe `command` (only the parts it asks):
    `interfaces` {name: [IPv4, ...]} as `ip -o -4 addr show` lists them (default: lo, eth0 at
    the SSH address, eth1 at compute_ip); `gpus` nvidia-smi's count (None: no nvidia-smi on
    the node; a string: nvidia-smi fails, saying it)."""
    from torch_multinode.cluster.autodetect import MARK

    if interfaces is None:
        interfaces = {
            "lo": ["127.0.0.1"],
            "eth0": [host.ssh_address],
            "eth1": [str(host.compute_ip)],
        }
    lines = [MARK]
    if f"{MARK} addresses" in command:
        lines.append(f"{MARK} addresses")
        for index, (name, addresses) in enumerate(interfaces.items(), 1):
            for address in addresses:
                lines.append(
                    f"{index}: {name}    inet {address}/24 brd 10.0.0.255 scope global {name}\\"
                    "       valid_lft forever preferred_lft forever"
                )
        lines.append(f"{MARK} ip 0")
    if f"{MARK} gpus" in command:
        lines.append(f"{MARK} gpus")
        if gpus is None:
            lines.append(f"{MARK} nvidia-smi absent")
        elif isinstance(gpus, str):
            lines += [gpus, f"{MARK} nvidia-smi 9"]
        else:
            lines += [str(index) for index in range(gpus)] + [f"{MARK} nvidia-smi 0"]
    return "\n".join(lines) + "\n"


def is_autodetect_probe(command: str) -> bool:
    """Whether `command` is cluster.autodetect's probe."""
    from torch_multinode.cluster.autodetect import MARK

    return command.startswith(f"echo {MARK};")
