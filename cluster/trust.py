"""SSH trust on the controller, in one place: the known_hosts file the nodes' host keys are
checked against, the options every SSH client of ours connects with (paramiko, OpenSSH for
rsync and the image stream, Ansible), what an unknown or changed key is reported as, and adding
a key once it is confirmed. Host keys are always checked: an unknown key is refused, never
trusted on first use.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from torch_multinode.cluster.errors import UserError

if TYPE_CHECKING:  # paramiko is imported where it is used: the inventory imports this module
    import paramiko

    from torch_multinode.cluster.inventory import Host, Inventory

DEFAULT_KNOWN_HOSTS = Path("~/.ssh/known_hosts")  # OpenSSH's own default
OPENSSH_CONNECT_TIMEOUT = 10
# SSH options an inventory may not hand Ansible: each turns host-key checking off, or trusts a
# key on first use.
UNCHECKED_HOST_KEYS = re.compile(
    r"StrictHostKeyChecking\s*=?\s*[\"']?(no|off|false|accept-new)\b"
    r"|(UserKnownHostsFile|GlobalKnownHostsFile)\s*=?\s*[\"']?/dev/null",
    re.IGNORECASE,
)
CHECKED_HOST_KEYS_HINT = "-o StrictHostKeyChecking=yes and each node's key in known_hosts"


# --- the known_hosts file ------------------------------------------------------------------------


def known_hosts_file(named: Path | None) -> Path:
    """The known_hosts file named, else ~/.ssh/known_hosts (OpenSSH's default), expanded."""
    return Path(os.path.expanduser(named or DEFAULT_KNOWN_HOSTS))


def known_hosts_entry(address: str, port: int = 22) -> str:
    """How known_hosts names a node: the address, or [address]:port off port 22."""
    if port == 22:
        return address
    return f"[{address}]:{port}"


def host_entry(host: Host) -> str:
    """`known_hosts_entry` of an inventory's host."""
    return known_hosts_entry(host.ssh_address, host.ssh_port)


def forget_command(known_hosts: Path, host: Host) -> str:
    """What removes the node's recorded key (after a reinstall, before adding its new one)."""
    return f"ssh-keygen -f {known_hosts} -R '{host_entry(host)}'"


def recorded_keys(known_hosts: Path, host: Host) -> dict[str, paramiko.PKey]:
    """The keys `known_hosts` holds for the node, by key type ({} when none, or no file)."""
    import paramiko

    known = paramiko.HostKeys()
    if known_hosts.exists():
        try:
            known.load(str(known_hosts))
        except (OSError, paramiko.SSHException) as exc:
            raise UserError(f"{known_hosts} cannot be read: {exc}") from None
    return dict(known.lookup(host_entry(host)) or {})


def add_known_host(known_hosts: Path, entry: str, key: paramiko.PKey) -> None:
    """Append a confirmed key to `known_hosts` (made, with its directory, if missing)."""
    known_hosts.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    existing = known_hosts.read_bytes() if known_hosts.exists() else b""
    line = f"{entry} {key.get_name()} {key.get_base64()}\n"
    with known_hosts.open("a", encoding="utf-8") as out:
        if existing and not existing.endswith(b"\n"):
            out.write("\n")
        out.write(line)


def write_known_hosts(known_hosts: Path, keys: Iterable[tuple[str, str]]) -> None:
    """A known_hosts file holding exactly `keys`: (address, 'TYPE BASE64') pairs, port 22."""
    known_hosts.write_text("".join(f"{known_hosts_entry(a)} {key}\n" for a, key in keys))


# --- clients -------------------------------------------------------------------------------------


def openssh_command(inventory: Inventory, host: Host) -> list[str]:
    """The OpenSSH client as cluster.remote connects: the inventory's key and known_hosts, host
    keys checked, never a password."""
    known_hosts = inventory.known_hosts_file
    command = [
        "ssh",
        "-p",
        str(host.ssh_port),
        "-o",
        "BatchMode=yes",
        "-o",
        "StrictHostKeyChecking=yes",
        "-o",
        f"UserKnownHostsFile={known_hosts}",
        "-o",
        f"ConnectTimeout={OPENSSH_CONNECT_TIMEOUT}",
        "-o",
        "ServerAliveInterval=5",
        "-o",
        "ServerAliveCountMax=3",
    ]
    if host.ssh_key is not None:
        command += ["-i", str(host.ssh_key), "-o", "IdentitiesOnly=yes"]
    return command


def login_line(known_hosts: Path, key: Path, target: str) -> str:
    """A shell command a person types to log in to a node, its host key checked."""
    return f"ssh -i {key} -o UserKnownHostsFile={known_hosts} {target}"


def ansible_ssh_args(known_hosts: Path) -> str:
    """An inventory's ansible_ssh_common_args: Ansible's ssh checks keys against `known_hosts`."""
    return f"-o UserKnownHostsFile={known_hosts} -o StrictHostKeyChecking=yes"


def host_keys_turned_off(ssh_args: str) -> str | None:
    """The part of SSH options `ssh_args` that would stop host keys being checked, else None."""
    found = UNCHECKED_HOST_KEYS.search(ssh_args)
    return found.group(0) if found else None


def check_host_keys(client: paramiko.SSHClient, known_hosts: Path) -> paramiko.SSHClient:
    """`client`, set to accept only the keys in `known_hosts` (none when there is no file)."""
    import paramiko

    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    if known_hosts.exists():
        client.load_host_keys(str(known_hosts))
    return client


def checking_client(known_hosts: Path) -> paramiko.SSHClient:
    """A new paramiko client that accepts only the keys in `known_hosts`."""
    import paramiko

    return check_host_keys(paramiko.SSHClient(), known_hosts)


# --- refusals ------------------------------------------------------------------------------------


def is_changed_key(exc: BaseException | None) -> bool:
    """paramiko refused the node: its key is not the one recorded for it."""
    import paramiko

    return isinstance(exc, paramiko.BadHostKeyException)


def is_unknown_key(exc: BaseException | None) -> bool:
    """paramiko refused the node: no key is recorded for it."""
    import paramiko

    return isinstance(exc, paramiko.SSHException) and "not found in known_hosts" in str(exc)


def key_refused(exc: BaseException, host: Host, known_hosts: Path) -> UserError | None:
    """The error, with its remedy, for a connection paramiko refused over the node's host key;
    None when `exc` is not such a refusal."""
    if is_changed_key(exc):
        return UserError(
            f"host '{host.name}': the SSH host key of {host.ssh_address} is not the "
            f"one in {known_hosts}: the node was reinstalled, or this is not the node",
            hint=f"if the node was reinstalled: {forget_command(known_hosts, host)}, "
            "then check the new key's fingerprint and add it",
            exit_code=1,
        )
    if is_unknown_key(exc):
        port = f" -p {host.ssh_port}" if host.ssh_port != 22 else ""
        return UserError(
            f"host '{host.name}': the SSH host key of {host.ssh_address} is not in {known_hosts}",
            hint=f"ssh-keyscan -H{port} {host.ssh_address} >> {known_hosts} "
            "after checking the fingerprint",
            exit_code=1,
        )
    return None
