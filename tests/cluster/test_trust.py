"""cluster.trust: where host keys are recorded, the options every SSH client of ours connects
with, and what an unknown or changed host key is reported as."""

from __future__ import annotations

import ipaddress
import socket
import threading
from pathlib import Path

import paramiko
import pytest

from tests.helpers import inventory_text, node
from torch_multinode.cluster import trust
from torch_multinode.cluster.errors import UserError
from torch_multinode.cluster.inventory import Host
from torch_multinode.cluster.inventory_read import parse


def _host(port: int = 22, key: Path | None = None, address: str = "10.1.0.1") -> Host:
    return Host(
        "node1", address, port, "trainer", key, ipaddress.IPv4Address("10.7.0.1"), "eth1", 0
    )


# --- the known_hosts file ------------------------------------------------------------------------


def test_the_default_known_hosts_is_openssh_s_own(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert trust.known_hosts_file(None) == tmp_path / ".ssh" / "known_hosts"
    assert trust.known_hosts_file(Path("~/keys/kh")) == tmp_path / "keys" / "kh"
    assert trust.known_hosts_file(Path("/etc/kh")) == Path("/etc/kh")
    bare = parse(inventory_text({"n1": node(1)}), "/nonexistent/inv.yml")
    assert bare.known_hosts is None
    assert bare.known_hosts_file == tmp_path / ".ssh" / "known_hosts"
    named = parse(
        inventory_text({"n1": node(1)}, ssh_known_hosts_file="/keys/kh"), "/nonexistent/inv.yml"
    )
    assert named.known_hosts_file == Path("/keys/kh")


def test_known_hosts_names_a_node_by_address_with_its_port_off_22():
    assert trust.known_hosts_entry("10.1.0.1") == "10.1.0.1"
    assert trust.known_hosts_entry("10.1.0.1", 2222) == "[10.1.0.1]:2222"
    assert trust.host_entry(_host(2222)) == "[10.1.0.1]:2222"
    assert trust.forget_command(Path("/k/kh"), _host(2222)) == (
        "ssh-keygen -f /k/kh -R '[10.1.0.1]:2222'"
    )


def test_a_confirmed_key_is_appended_and_read_back(tmp_path):
    known_hosts = tmp_path / "new" / "known_hosts"
    key = paramiko.ECDSAKey.generate()
    host = _host(2222)
    assert trust.recorded_keys(known_hosts, host) == {}  # no file: nothing known
    trust.add_known_host(known_hosts, trust.host_entry(host), key)
    assert known_hosts.read_text() == f"[10.1.0.1]:2222 {key.get_name()} {key.get_base64()}\n"
    assert (known_hosts.parent.stat().st_mode & 0o777) == 0o700
    assert trust.recorded_keys(known_hosts, host) == {key.get_name(): key}
    assert trust.recorded_keys(known_hosts, _host(22)) == {}  # another port, another entry
    # a file whose last line has no newline still gets one line per key
    known_hosts.write_text(known_hosts.read_text().rstrip("\n"))
    other = paramiko.ECDSAKey.generate()
    trust.add_known_host(known_hosts, "10.1.0.2", other)
    assert known_hosts.read_text().splitlines()[1] == (
        f"10.1.0.2 {other.get_name()} {other.get_base64()}"
    )


def test_an_unreadable_known_hosts_is_said_so(tmp_path):
    known_hosts = tmp_path / "known_hosts"
    known_hosts.mkdir()  # a directory where the file should be
    with pytest.raises(UserError, match=rf"^{known_hosts} cannot be read: "):
        trust.recorded_keys(known_hosts, _host())


def test_a_known_hosts_written_whole(tmp_path):
    known_hosts = tmp_path / "known_hosts"
    trust.write_known_hosts(known_hosts, [("10.1.0.1", "ssh-ed25519 AAAA1"), ("10.1.0.2", "x y")])
    assert known_hosts.read_text() == "10.1.0.1 ssh-ed25519 AAAA1\n10.1.0.2 x y\n"
    trust.write_known_hosts(known_hosts, [])
    assert known_hosts.read_text() == ""


# --- clients -------------------------------------------------------------------------------------


def test_the_openssh_client_checks_host_keys_with_the_inventory_s_key_and_file():
    inventory = parse(
        inventory_text(
            {"n1": node(1, ansible_port=2222)},
            ansible_user="trainer",
            ansible_ssh_private_key_file="/keys/id",
            ssh_known_hosts_file="/keys/known_hosts",
        ),
        "/nonexistent/inv.yml",
    )
    assert trust.openssh_command(inventory, inventory.hosts[0]) == [
        "ssh",
        "-p",
        "2222",
        "-o",
        "BatchMode=yes",
        "-o",
        "StrictHostKeyChecking=yes",
        "-o",
        "UserKnownHostsFile=/keys/known_hosts",
        "-o",
        "ConnectTimeout=10",
        "-o",
        "ServerAliveInterval=5",
        "-o",
        "ServerAliveCountMax=3",
        "-i",
        "/keys/id",
        "-o",
        "IdentitiesOnly=yes",
    ]


def test_without_a_key_openssh_picks_its_own_but_still_checks_host_keys(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    inventory = parse(inventory_text({"n1": node(1)}), "/nonexistent/inv.yml")
    command = trust.openssh_command(inventory, inventory.hosts[0])
    assert "-i" not in command and "IdentitiesOnly=yes" not in command
    assert command[:3] == ["ssh", "-p", "22"]
    assert f"UserKnownHostsFile={tmp_path}/.ssh/known_hosts" in command
    assert "StrictHostKeyChecking=yes" in command and "BatchMode=yes" in command


def test_ansible_and_a_person_check_host_keys_against_the_same_file():
    assert trust.ansible_ssh_args(Path("/sim/known_hosts")) == (
        "-o UserKnownHostsFile=/sim/known_hosts -o StrictHostKeyChecking=yes"
    )
    assert trust.login_line(Path("/sim/kh"), Path("/sim/id"), "root@10.1.0.1") == (
        "ssh -i /sim/id -o UserKnownHostsFile=/sim/kh root@10.1.0.1"
    )


@pytest.mark.parametrize(
    "args, found",
    [
        ("-o StrictHostKeyChecking=no", "StrictHostKeyChecking=no"),
        ("-oStrictHostKeyChecking=accept-new", "StrictHostKeyChecking=accept-new"),
        ("-o 'StrictHostKeyChecking off'", "StrictHostKeyChecking off"),
        ("-o UserKnownHostsFile=/dev/null", "UserKnownHostsFile=/dev/null"),
        ("-o GlobalKnownHostsFile=/dev/null", "GlobalKnownHostsFile=/dev/null"),
        (trust.ansible_ssh_args(Path("/k/kh")), None),
        ("-o ControlMaster=auto", None),
    ],
)
def test_ssh_options_that_stop_host_key_checks_are_found(args, found):
    assert trust.host_keys_turned_off(args) == found


def test_a_paramiko_client_rejects_keys_it_does_not_know(tmp_path):
    client = trust.checking_client(tmp_path / "absent")  # no file: no key is known
    assert isinstance(client._policy, paramiko.RejectPolicy)
    assert len(client.get_host_keys()) == 0
    known_hosts = tmp_path / "known_hosts"
    key = paramiko.ECDSAKey.generate()
    trust.add_known_host(known_hosts, "[10.1.0.1]:2222", key)
    client = trust.check_host_keys(paramiko.SSHClient(), known_hosts)
    assert isinstance(client._policy, paramiko.RejectPolicy)
    assert client.get_host_keys().lookup("[10.1.0.1]:2222") == {key.get_name(): key}


# --- refusals ------------------------------------------------------------------------------------


def _refused_by_a_server(known: paramiko.PKey | None, tmp_path: Path) -> tuple[Host, Exception]:
    """What a trust.checking_client's connect raises against a loopback sshd whose host key is
    not `known` (None: known_hosts holds no key for it)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    server_key = paramiko.ECDSAKey.generate()

    def serve():
        sock, _ = listener.accept()
        transport = paramiko.Transport(sock)
        transport.add_server_key(server_key)
        try:
            transport.start_server(server=paramiko.ServerInterface())
            transport.accept(5)
        except (paramiko.SSHException, EOFError, OSError):
            pass
        finally:
            transport.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    known_hosts = tmp_path / "known_hosts"
    host = _host(port, address="127.0.0.1")
    if known is not None:
        trust.add_known_host(known_hosts, trust.host_entry(host), known)
    client = trust.checking_client(known_hosts)
    try:
        client.connect("127.0.0.1", port=port, username="x", password="y", timeout=5)
    except Exception as exc:  # noqa: BLE001 (the refusal is what the test looks at)
        refused = exc
    else:
        raise AssertionError("the connection was not refused")
    finally:
        client.close()
        listener.close()
        thread.join(5)
    return host, refused


def test_an_unknown_host_key_is_refused_with_how_to_add_it(tmp_path):
    host, refused = _refused_by_a_server(None, tmp_path)
    assert trust.is_unknown_key(refused) and not trust.is_changed_key(refused)
    error = trust.key_refused(refused, host, tmp_path / "known_hosts")
    assert error.exit_code == 1
    assert error.line() == (
        f"Error: host 'node1': the SSH host key of 127.0.0.1 is not in {tmp_path}/known_hosts "
        f"(try ssh-keyscan -H -p {host.ssh_port} 127.0.0.1 >> {tmp_path}/known_hosts after "
        "checking the fingerprint)"
    )


def test_a_changed_host_key_is_refused_with_how_to_replace_it(tmp_path):
    host, refused = _refused_by_a_server(paramiko.ECDSAKey.generate(), tmp_path)
    assert trust.is_changed_key(refused) and not trust.is_unknown_key(refused)
    error = trust.key_refused(refused, host, tmp_path / "known_hosts")
    assert error.exit_code == 1
    assert error.line() == (
        f"Error: host 'node1': the SSH host key of 127.0.0.1 is not the one in "
        f"{tmp_path}/known_hosts: the node was reinstalled, or this is not the node (try if the "
        f"node was reinstalled: ssh-keygen -f {tmp_path}/known_hosts -R "
        f"'[127.0.0.1]:{host.ssh_port}', then check the new key's fingerprint and add it)"
    )


def test_on_port_22_the_remedies_name_the_bare_address():
    unknown = paramiko.SSHException("Server '10.1.0.1' not found in known_hosts")
    assert trust.key_refused(unknown, _host(), Path("/k/kh")).hint == (
        "ssh-keyscan -H 10.1.0.1 >> /k/kh after checking the fingerprint"
    )
    changed = paramiko.BadHostKeyException(
        "10.1.0.1", paramiko.ECDSAKey.generate(), paramiko.ECDSAKey.generate()
    )
    assert (
        "ssh-keygen -f /k/kh -R '10.1.0.1',"
        in trust.key_refused(changed, _host(), Path("/k/kh")).hint
    )


def test_other_failures_are_not_host_key_refusals():
    for exc in (
        paramiko.SSHException("No existing session"),
        paramiko.AuthenticationException("Authentication failed."),
        ConnectionRefusedError("connection refused"),
        EOFError(),
    ):
        assert trust.key_refused(exc, _host(), Path("/k/kh")) is None
        assert not trust.is_unknown_key(exc) and not trust.is_changed_key(exc)
