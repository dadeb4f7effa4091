"""Every SSH connection the project makes goes through here.

Fabric's default accepts any unknown host key (AutoAddPolicy). We never do: the key must
already be in the known_hosts file the inventory names (or ~/.ssh/known_hosts), otherwise the
connection is refused with a message that says how to add it (cluster.trust's policy).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import paramiko
from fabric import Connection

from torch_multinode.cluster import trust
from torch_multinode.cluster.errors import UserError
from torch_multinode.cluster.inventory import Host, Inventory

T = TypeVar("T")
DEFAULT_CONNECT_TIMEOUT = 5.0

# paramiko logs a failed connection with its traceback, which Python prints to stderr when the
# program set no logging up (our CLIs): the UserError raised here already says what failed.
logging.getLogger("paramiko").addHandler(logging.NullHandler())


@dataclass(frozen=True)
class Result:
    host: str
    command: str
    exit_code: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    @property
    def last_line(self) -> str:
        """What the command said last: its stderr's last line, else its stdout's ('' if none)."""
        said = (self.stderr.strip() or self.stdout.strip()).splitlines()
        return said[-1] if said else ""


class Remote:
    """One node reached over SSH, in batch mode: keys only, host key verified."""

    def __init__(
        self,
        host: Host,
        known_hosts: Path | None = None,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
    ):
        self.host = host
        self.known_hosts = trust.known_hosts_file(known_hosts)
        self.connect_timeout = connect_timeout
        self._connection: Connection | None = None

    @classmethod
    def for_inventory(cls, inventory: Inventory, host: Host, **kwargs) -> Remote:
        return cls(host, known_hosts=inventory.known_hosts_file, **kwargs)

    @property
    def connection(self) -> Connection:
        if self._connection is None:
            self._connection = self._connect()
        return self._connection

    def _connect(self) -> Connection:
        connect_kwargs: dict[str, object] = {
            # here, not as fabric's connect_timeout, which fabric rounds down to whole seconds
            "timeout": self.connect_timeout,
            "allow_agent": False,
            "look_for_keys": self.host.ssh_key is None,
            "banner_timeout": self.connect_timeout,
            "auth_timeout": self.connect_timeout,
        }
        if self.host.ssh_key is not None:
            connect_kwargs["key_filename"] = str(self.host.ssh_key)
        connection = Connection(
            self.host.ssh_address,
            user=self.host.ssh_user,
            port=self.host.ssh_port,
            connect_kwargs=connect_kwargs,
        )
        connection.connect_timeout = None  # not a ConnectTimeout from ~/.ssh/config either
        client = trust.check_host_keys(connection.client, self.known_hosts)
        try:
            connection.open()
        except BaseException as exc:
            # paramiko leaves a transport that failed after the handshake (authentication slow or
            # refused, host key rejected) connected, and fabric's close() skips a connection that
            # never opened: a node then holds each retry as a pending login until its
            # LoginGraceTime, and once 10 are pending its sshd drops every new connection.
            client.close()
            error = self._open_failed(exc)
            if error is None:
                raise
            raise error from None
        return connection

    def _open_failed(self, exc: BaseException) -> UserError | None:
        refused = trust.key_refused(exc, self.host, self.known_hosts)
        if refused is not None:
            return refused
        if isinstance(exc, (paramiko.SSHException, TimeoutError, OSError, EOFError)):
            return self._unreachable(exc)
        return None

    def _unreachable(self, exc: BaseException) -> UserError:
        reason = str(exc) or type(exc).__name__
        if isinstance(exc, EOFError) or reason == "No existing session":
            # paramiko's words for a key exchange cut short, by the node or by our timeout
            reason = (
                f"the SSH handshake was cut short (closed by the node, or not finished within "
                f"{self.connect_timeout:g} s)"
            )
        return UserError(
            f"host '{self.host.name}': cannot SSH to "
            f"{self.host.ssh_user + '@' if self.host.ssh_user else ''}"
            f"{self.host.ssh_address}:{self.host.ssh_port}: {reason}",
            hint="checking that the node is up and its key is authorized",
            exit_code=1,
        )

    def connect(self) -> None:
        """Open the SSH connection now rather than at the first command: a UserError here
        means the node could not be reached, one from `run` that a command failed."""
        self.connection  # noqa: B018 (the property connects)

    def run(
        self,
        command: str,
        timeout: float | None = 60,
        check: bool = False,
        stdin: str | None = None,
    ) -> Result:
        """Run a shell command; output is captured, never echoed. `stdin` is what the command
        reads on its standard input: the way to hand a node data (a secret, a file list) that
        must not appear on any command line."""
        if stdin is not None:
            return self._checked(self._run_with_input(command, stdin, timeout), check)
        try:
            out = self.connection.run(
                command, hide=True, warn=True, timeout=timeout, in_stream=False
            )
        except UserError:
            raise
        except Exception as exc:  # invoke wraps timeouts and channel errors in its own types
            raise UserError(
                f"host '{self.host.name}': command {command!r} did not finish: "
                f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}",
                exit_code=1,
            ) from None
        return self._checked(
            Result(self.host.name, command, out.exited, out.stdout, out.stderr), check
        )

    def _checked(self, result: Result, check: bool) -> Result:
        """`result`, or with `check` a UserError when the command failed."""
        if check and not result.ok:
            raise UserError(
                f"host '{self.host.name}': {result.command!r} exited {result.exit_code}: "
                f"{result.last_line}",
                exit_code=1,
            )
        return result

    def _run_with_input(self, command: str, data: str, timeout: float | None) -> Result:
        """`run` with `data` on the command's standard input, sent whole: invoke's own stdin
        handling reads a file-like one character per 10 ms (20 KB took over 3 minutes)."""
        try:
            channel = self.connection.client.get_transport().open_session()
            channel.settimeout(timeout)
            channel.exec_command(command)
            sender = threading.Thread(
                target=lambda: (channel.sendall(data.encode()), channel.shutdown_write()),
                daemon=True,
            )
            sender.start()
            with channel.makefile("rb") as out, channel.makefile_stderr("rb") as err:
                stdout, stderr = out.read(), err.read()
            sender.join(timeout)
            code = channel.recv_exit_status()
            channel.close()
        except UserError:
            raise
        except Exception as exc:  # a timeout, or the channel closed under us
            raise UserError(
                f"host '{self.host.name}': command {command[:200]!r} did not finish: "
                f"{type(exc).__name__}: {exc}",
                exit_code=1,
            ) from None
        return Result(
            self.host.name,
            command,
            code,
            stdout.decode(errors="replace"),
            stderr.decode(errors="replace"),
        )

    def stream(self, command: str, out) -> int:
        """Run `command` on a terminal (so a killed session takes its processes with it), its
        output written to `out` as it comes (stdout and stderr both); its exit status, -1 when
        the session ended without one. A dropped connection raises what fabric raises."""
        result = self.connection.run(
            command,
            pty=True,
            warn=True,
            hide=True,
            out_stream=out,
            err_stream=out,
            in_stream=False,
        )
        return result.exited

    def put(self, local: str | Path, remote: str) -> None:
        self.connection.put(str(local), remote)

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    def __enter__(self) -> Remote:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def on_all(hosts: tuple[Host, ...] | list[Host], work: Callable[[Host], T]) -> dict[str, T]:
    """Run `work(host)` for every host in parallel; results keyed by host name, in host order."""
    if not hosts:
        return {}
    with ThreadPoolExecutor(max_workers=len(hosts)) as pool:
        futures = {host.name: pool.submit(work, host) for host in hosts}
        return {name: future.result() for name, future in futures.items()}
