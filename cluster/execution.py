"""How the controller reaches the nodes: one layer for netcheck and the launcher, so both are
plain code that tests drive with one fake (tests/fakes.py).

`Nodes` is the seam:
- `run(host, command, timeout)`: a short command over a pooled connection; a cluster.remote
  Result, or a UserError when the node cannot be reached or the command does not finish.
- `session(host)`: a connection of its own (cluster.remote.Remote: connect, run, stream,
  close), for what must not wait behind other commands: a job's torchrun, a watcher, a stop.
- `answers(host, timeout)`: whether the node's SSH port accepts a TCP connection at all, cheap
  enough for a liveness watcher and never held for SSH's whole connect timeout.
- `ship_code(hosts)`, `close()`.
`SshNodes` is the real one (batch mode, host keys verified).

`Context` says where the training stack lives on a node, as the inventory's launch_mode says:
on the host itself (`HostContext`, training_python) or inside the training image
(`ContainerContext`, started as the launcher starts a job: cluster.containers writes both).
"""

from __future__ import annotations

import shlex
import socket
import threading
from typing import Protocol

from torch_multinode.cluster.containers import probe_container_command
from torch_multinode.cluster.inventory import Host, Inventory
from torch_multinode.cluster.remote import Remote, Result

SSH_CONNECT_TIMEOUT = 5.0


class Session(Protocol):
    """One connection to one node (cluster.remote.Remote is the real one)."""

    @property
    def host(self) -> Host:
        """The node it connects to."""
        ...

    def connect(self) -> None: ...

    def run(
        self,
        command: str,
        timeout: float | None = 60,
        check: bool = False,
        stdin: str | None = None,
    ) -> Result: ...

    def stream(self, command: str, out) -> int:
        """Run `command` on a terminal, its output written to `out` as it comes; its exit
        status, -1 when the session ended without one."""
        ...

    def close(self) -> None: ...

    def __enter__(self) -> Session: ...

    def __exit__(self, *exc) -> None: ...


class Nodes(Protocol):
    def run(self, host: Host, command: str, timeout: float) -> Result: ...

    def session(self, host: Host) -> Session: ...

    def answers(self, host: Host, timeout: float) -> bool: ...

    def ship_code(self, hosts: list[Host]) -> str | None:
        """netcheck's own code onto every node: the directory it is in there, or None where
        the nodes already import it (a fake cluster)."""
        ...

    def close(self) -> None: ...


class SshNodes:
    """SSH connections to the nodes. `run`'s are opened on first use and reused: each node
    keeps a small pool, as two stages may run on one node at once (netcheck's software probe
    runs beside its network checks), each on its own connection. A connection that failed is
    closed, not reused. `session` opens one of its own, which its caller closes.
    """

    def __init__(self, inventory: Inventory, connect_timeout: float = SSH_CONNECT_TIMEOUT):
        self.inventory = inventory
        self.connect_timeout = connect_timeout
        self._idle: dict[str, list[Remote]] = {}
        self._all: list[Remote] = []
        self._lock = threading.Lock()

    def _checkout(self, host: Host) -> Remote:
        with self._lock:
            idle = self._idle.setdefault(host.name, [])
            if idle:
                return idle.pop()
            remote = Remote.for_inventory(
                self.inventory, host, connect_timeout=self.connect_timeout
            )
            self._all.append(remote)
            return remote

    def run(self, host: Host, command: str, timeout: float) -> Result:
        remote = self._checkout(host)
        try:
            result = remote.run(command, timeout=timeout)
        except BaseException:
            close_quietly(remote)
            raise
        with self._lock:
            self._idle[host.name].append(remote)
        return result

    def session(self, host: Host) -> Remote:
        return Remote.for_inventory(self.inventory, host, connect_timeout=self.connect_timeout)

    def answers(self, host: Host, timeout: float) -> bool:
        """Whether `host` accepts a TCP connection to its SSH port within `timeout` seconds."""
        try:
            socket.create_connection((host.ssh_address, host.ssh_port), timeout=timeout).close()
        except OSError:
            return False
        return True

    def ship_code(self, hosts: list[Host]) -> str | None:
        """netcheck's collective workers import netcheck, and the training image holds no project
        code: send it with rsync. A node that cannot take it is reported by the checks: ssh
        when it does not answer, else the software check (netcheck not importable there)."""
        from torch_multinode.cluster import sync

        tree = sync.tool_tree()
        destination = sync.tool_destination(self.inventory)
        quiet = lambda line: None  # noqa: E731 - progress lines would interleave with the report
        sync.push_each(self.inventory, hosts, tree, destination, quiet)
        return destination

    def close(self) -> None:
        with self._lock:
            for remote in self._all:
                close_quietly(remote)
            self._all.clear()
            self._idle.clear()


def close_quietly(remote: Session | None) -> None:
    """`remote` closed, if any: closing a session to a dead node may raise anything, and that
    must not mask what the caller is doing."""
    try:
        if remote is not None:
            remote.close()
    except Exception:  # noqa: BLE001 - closing a dead connection must not mask results
        pass


class Context(Protocol):
    """Where the training stack runs on a node: what the software probe and workers see."""

    name: str

    def python(self, host: Host) -> str:
        """The interpreter that has torch, as seen inside the context."""
        ...

    def where(self, host: Host) -> str:
        """Where the training stack lives, for messages ("/opt/venv/bin/python")."""
        ...

    def wrap(self, host: Host, command: str, token: str) -> str:
        """The shell command that runs `command` inside the context, marked with `token`."""
        ...

    def cleanup(self, token: str) -> str | None:
        """A shell command ending whatever `wrap` started with `token`, if it needs one."""
        ...


class HostContext:
    """Jobs run directly on the node with the inventory's training_python (launch_mode: host)."""

    name = "host"

    def __init__(self, code_dir: str | None = None):
        self.code_dir = code_dir  # where netcheck's own code was sent on every node

    def python(self, host: Host) -> str:
        return host.python

    def where(self, host: Host) -> str:
        return host.python

    def wrap(self, host: Host, command: str, token: str) -> str:
        if self.code_dir:
            return f"export PYTHONPATH={shlex.quote(_import_path(self.code_dir))}; {command}"
        return command

    def cleanup(self, token: str) -> str | None:
        return None


NETCHECK_LABEL = "torch-multinode.netcheck"


class ContainerContext:
    """Jobs run in the training image (launch_mode: container), so the probes run there too,
    started exactly the way the launcher starts a job (cluster.containers'
    probe_container_command)."""

    name = "container"
    PYTHON = "python3"  # the image's PATH puts its own torch-carrying interpreter first

    def __init__(self, image: str, memlock: str = "unlimited", code_dir: str | None = None):
        self.image = image
        self.memlock = memlock
        self.code_dir = code_dir  # mounted at the same path: the image holds no project code

    def python(self, host: Host) -> str:
        return self.PYTHON

    def where(self, host: Host) -> str:
        return f"the training image {self.image}"

    def wrap(self, host: Host, command: str, token: str) -> str:
        return probe_container_command(
            host,
            self.image,
            self.memlock,
            f"{NETCHECK_LABEL}={token}",
            command,
            self.code_dir,
            _import_path(self.code_dir) if self.code_dir else None,
        )

    def cleanup(self, token: str) -> str | None:
        label = shlex.quote(f"label={NETCHECK_LABEL}={token}")
        return f"docker ps -q --filter {label} | xargs -r docker rm -f >/dev/null 2>&1; true"


def _import_path(code_dir: str) -> str:
    from torch_multinode.cluster import sync

    return sync.tool_import_path(code_dir)


def context_for(inventory: Inventory, code_dir: str | None = None) -> Context:
    """The inventory's launch_mode decides where the training stack is checked."""
    if getattr(inventory, "launch_mode", "host") == "container":
        return ContainerContext(inventory.training_image, inventory.container_memlock, code_dir)
    return HostContext(code_dir)


def python_command(python: str, source: str, *args: str) -> str:
    """`python -c SOURCE ARGS...`, quoted for the remote shell: ships a stdlib-only script."""
    return " ".join(shlex.quote(part) for part in (python, "-c", source, *args))
