"""Remote against an SSH server on loopback whose behaviour the test controls."""

from __future__ import annotations

import ipaddress
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import paramiko
import pytest

from torch_multinode.cluster.errors import UserError
from torch_multinode.cluster.inventory import Host
from torch_multinode.cluster.remote import Remote


class _Server(paramiko.ServerInterface):
    def __init__(self, authorized: paramiko.PKey, release: threading.Event, slow: bool):
        self.authorized = authorized
        self.release = release
        self.slow = slow

    def get_allowed_auths(self, username):
        return "publickey"

    def check_auth_publickey(self, username, key):
        if self.slow:
            self.release.wait(30)  # slower than any client's patience
        if key.get_base64() == self.authorized.get_base64():
            return paramiko.AUTH_SUCCESSFUL
        return paramiko.AUTH_FAILED


def _listener() -> socket.socket:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    return listener


def _local_host(port: int, key_file: Path | None = None) -> Host:
    return Host(
        "node1", "127.0.0.1", port, "root", key_file, ipaddress.IPv4Address("10.0.0.1"), "eth0", 0
    )


@pytest.fixture
def ssh_server(tmp_path):
    """Start(slow=, authorize=) -> a Host for an SSH server on 127.0.0.1 and its known_hosts."""
    host_key = paramiko.ECDSAKey.generate()
    client_key = paramiko.ECDSAKey.generate()
    key_file = tmp_path / "id_ecdsa"
    client_key.write_private_key_file(str(key_file))
    listener = _listener()
    port = listener.getsockname()[1]
    release = threading.Event()
    transports: list[paramiko.Transport] = []
    behaviour = {}

    def handshake(sock):
        transport = paramiko.Transport(sock)
        transports.append(transport)
        transport.add_server_key(host_key)
        authorized = client_key if behaviour["authorize"] else paramiko.ECDSAKey.generate()
        try:
            transport.start_server(server=_Server(authorized, release, behaviour["slow"]))
        except (paramiko.SSHException, EOFError, OSError):
            transport.close()  # the client gave up or refused the host key

    def serve():
        while True:
            try:
                sock, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=handshake, args=(sock,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()

    def start(slow=False, authorize=True, known="same"):
        behaviour.update(slow=slow, authorize=authorize)
        known_hosts = tmp_path / "known_hosts"
        listed = {"same": host_key, "changed": paramiko.ECDSAKey.generate()}.get(known)
        known_hosts.write_text(
            f"[127.0.0.1]:{port} {listed.get_name()} {listed.get_base64()}\n" if listed else ""
        )
        return _local_host(port, key_file), known_hosts

    yield start
    release.set()
    listener.close()
    for transport in transports:
        transport.close()


def _open_client_transports(port: int) -> list[paramiko.Transport]:
    """This process's live SSH connections to the test server (other tests may hold theirs)."""
    found = []
    for thread in threading.enumerate():
        if isinstance(thread, paramiko.Transport) and not thread.server_mode and thread.active:
            try:
                if thread.sock.getpeername()[1] == port:
                    found.append(thread)
            except OSError:
                pass  # closed meanwhile
    return found


def test_a_connection_that_opens_is_closed_by_close(ssh_server):
    host, known_hosts = ssh_server()
    remote = Remote(host, known_hosts=known_hosts, connect_timeout=5)
    assert remote.connection.is_connected
    assert len(_open_client_transports(host.ssh_port)) == 1
    remote.close()
    assert _open_client_transports(host.ssh_port) == []


@pytest.mark.parametrize(
    ("behaviour", "message"),
    [
        ({"slow": True}, "cannot SSH to root@127.0.0.1"),
        ({"authorize": False}, "cannot SSH to root@127.0.0.1"),
        ({"known": "none"}, "SSH host key of 127.0.0.1 is not in"),
        ({"known": "changed"}, r"is not the one in .*known_hosts: the node was reinstalled"),
    ],
    ids=[
        "auth-slower-than-the-timeout",
        "key-not-authorized",
        "host-key-unknown",
        "host-key-changed",
    ],
)
def test_a_failed_connection_leaves_nothing_open(ssh_server, behaviour, message):
    """Each failed attempt is closed at once. Left open, a node slow to answer under load holds
    every retry as an unauthenticated connection until its LoginGraceTime (2 min), and once 10 are
    held sshd drops every new one (MaxStartups): CI saw 'Connection reset by peer' for minutes."""
    host, known_hosts = ssh_server(**behaviour)
    for _ in range(3):
        remote = Remote(host, known_hosts=known_hosts, connect_timeout=0.5)
        with pytest.raises(UserError, match=message):
            remote.run("true")
        remote.close()
    deadline = time.monotonic() + 5
    while _open_client_transports(host.ssh_port) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _open_client_transports(host.ssh_port) == []


_NO_BANNER = """
import ipaddress, socket, sys
from pathlib import Path
from torch_multinode.cluster.errors import UserError
from torch_multinode.cluster.inventory import Host
from torch_multinode.cluster.remote import Remote
listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen(4)
host = Host("node1", "127.0.0.1", listener.getsockname()[1], "root", None,
            ipaddress.IPv4Address("10.0.0.1"), "eth0", 0)
try:
    Remote(host, known_hosts=Path(sys.argv[1]), connect_timeout=0.5).run("true")
except UserError as exc:
    print(exc)
"""


def test_a_node_that_never_sends_its_banner_is_one_error_with_no_traceback(tmp_path):
    """paramiko logs the failure with a traceback, which Python prints when no logging is set
    up, as in our CLIs (a test run sets logging up, hence the separate process)."""
    proc = subprocess.run(
        [sys.executable, "-c", _NO_BANNER, str(tmp_path / "known_hosts")],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).parents[2],
    )
    # whichever of paramiko's banner and handshake timeouts (both 0.5 s) fires first
    assert re.search(r"protocol banner|handshake was cut short", proc.stdout), proc.stdout
    assert proc.stderr == ""


def test_a_handshake_that_stalls_after_the_banner_says_so(tmp_path):
    listener = _listener()
    held = []

    def serve():
        sock, _ = listener.accept()
        sock.sendall(b"SSH-2.0-OpenSSH_9.2\r\n")  # then nothing, as from a starved sshd
        held.append(sock)

    threading.Thread(target=serve, daemon=True).start()
    host = _local_host(listener.getsockname()[1])
    try:
        with pytest.raises(UserError) as failure:
            Remote(host, known_hosts=tmp_path / "known_hosts", connect_timeout=0.5).run("true")
    finally:
        listener.close()
        for sock in held:
            sock.close()
    assert str(failure.value).endswith(
        "the SSH handshake was cut short (closed by the node, or not finished within 0.5 s)"
    )
