"""First contact with freshly installed machines (`make bootstrap`), once, before provisioning.

A fresh Debian or Ubuntu install has a user with a password, sudo that asks for that password,
and an SSH server with password login; `make provision` needs key login, the nodes' host keys
in the inventory's known_hosts file and passwordless sudo. This module makes the one from the
other, node by node:

1. the controller's key pair (ed25519), made if there is none;
2. each node's host key, fetched and confirmed by its fingerprint (typed "yes", or a file of
   expected fingerprints), then added to the known_hosts file; host-key checking is never off;
3. one password login per node that needs it: the controller's public key into the user's
   authorized_keys, and a sudoers drop-in, validated by `visudo -c` before it takes effect;
4. key login and passwordless sudo proven with the key alone;
5. only then, if asked, SSH password login turned off (validated by `sshd -t`).

Steps 1 and 2 (the key pair, the host keys) and the terminal's questions are provision.keys'.

The password lives in this process's memory only: it goes to the node inside the SSH
connection (authentication) and on sudo's standard input, never on a command line, in a file
or in any output.
"""

from __future__ import annotations

import getpass
import re
import shlex
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

import paramiko

from torch_multinode.cluster import trust
from torch_multinode.cluster.errors import UserError, shown
from torch_multinode.cluster.inventory import Host, Inventory
from torch_multinode.cluster.remote import Remote, on_all
from torch_multinode.provision.keys import (
    CONNECT_TIMEOUT,
    NodeFailed,
    Prompter,
    Say,
    check_host_key,
    ensure_key,
    key_path,
    read_fingerprints,
)

SUDOERS_DROP_IN = "/etc/sudoers.d/torch-multinode"
# sshd takes the first value it reads for each keyword, and reads sshd_config.d/*.conf in name
# order before the main file: "00-" comes before the "50-cloud-init.conf" that turns it back on.
SSHD_DROP_IN = "/etc/ssh/sshd_config.d/00-torch-multinode.conf"
COMMAND_TIMEOUT = 60.0
RELOAD_TIMEOUT = 20.0
# What sudoers and useradd accept as a user name, and nothing that could change a sudoers line.
_USER_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,31}$")


@dataclass
class NodeReport:
    host: Host
    done: list[str] = field(default_factory=list)
    failed: str | None = None
    already: bool = False

    @property
    def ok(self) -> bool:
        return self.failed is None


@dataclass
class Outcome:
    key: Path
    key_made: bool
    known_hosts: Path
    nodes: list[NodeReport]

    @property
    def ok(self) -> bool:
        return all(node.ok for node in self.nodes)


# ---------------------------------------------------------------------------------------------
# On the node


def user_of(host: Host) -> str:
    user = host.ssh_user or getpass.getuser()
    if not _USER_NAME.match(user):
        raise UserError(f"host '{host.name}': user {shown(user)} is not a user name sudoers takes")
    return user


def sudoers_line(user: str) -> str:
    return f"{user} ALL=(ALL:ALL) NOPASSWD: ALL"


def sudoers_script(user: str) -> str:
    """Run as root: install the drop-in only once `visudo -c` has passed on it alone and with
    the whole configuration; prints 'changed' or 'unchanged'. The temporary file's name has a
    dot, which sudo's includedir skips, so it never takes effect half-written."""
    content = (
        "# torch-multinode (make bootstrap): passwordless sudo for provisioning\n"
        f"{sudoers_line(user)}\n"
    )
    final = SUDOERS_DROP_IN
    return f"""set -eu
umask 0337
directory=$(dirname {final})
mkdir -p "$directory"
staged=$(mktemp "$directory/.torch-multinode.XXXXXX")
printf '%s' {shlex.quote(content)} > "$staged"
chmod 0440 "$staged"
if ! visudo -cqf "$staged" >&2; then rm -f "$staged"; echo "visudo refused the drop-in" >&2; exit 3; fi
if [ -f {final} ] && cmp -s "$staged" {final}; then rm -f "$staged"; echo unchanged; exit 0; fi
mv -f "$staged" {final}
if ! visudo -cq >&2; then
    rm -f {final}
    echo "visudo -c failed with the drop-in in place: removed it, sudo is as it was" >&2
    exit 4
fi
echo changed
"""


def authorized_key_script(public_key: str) -> str:
    """Run as the user: the key into ~/.ssh/authorized_keys once; prints changed/unchanged."""
    quoted = shlex.quote(public_key)
    return f"""set -eu
umask 077
mkdir -p "$HOME/.ssh"
touch "$HOME/.ssh/authorized_keys"
chmod 700 "$HOME/.ssh"
chmod 600 "$HOME/.ssh/authorized_keys"
if grep -qF {quoted} "$HOME/.ssh/authorized_keys"; then echo unchanged; exit 0; fi
if [ -s "$HOME/.ssh/authorized_keys" ] && [ -n "$(tail -c1 "$HOME/.ssh/authorized_keys")" ]; then
    echo >> "$HOME/.ssh/authorized_keys"
fi
printf '%s torch-multinode\\n' {quoted} >> "$HOME/.ssh/authorized_keys"
echo changed
"""


def password_off_script() -> str:
    """Run as root: keys-only SSH through a drop-in that `sshd -t` has accepted, then sshd
    reloaded; prints changed/unchanged."""
    content = (
        "# torch-multinode (make bootstrap --disable-password-login): SSH keys only\n"
        "PasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\n"
    )
    final = SSHD_DROP_IN
    return f"""set -eu
if ! grep -qiE '^[[:space:]]*Include[[:space:]]+/etc/ssh/sshd_config\\.d/\\*\\.conf' /etc/ssh/sshd_config; then
    echo "/etc/ssh/sshd_config does not include /etc/ssh/sshd_config.d/*.conf" >&2; exit 3
fi
if [ -f {final} ] && [ "$(cat {final})" = {shlex.quote(content.rstrip(chr(10)))} ]; then
    echo unchanged; exit 0
fi
staged=$(mktemp /etc/ssh/.torch-multinode.XXXXXX)
printf '%s' {shlex.quote(content)} > "$staged"
chmod 0644 "$staged"
mv -f "$staged" {final}
if ! sshd -t >&2; then rm -f {final}; echo "sshd -t refused it: removed, sshd unchanged" >&2; exit 4; fi
if [ -d /run/systemd/system ]; then
    # A socket-activated sshd (Ubuntu 24.04) that is not running reads the file when it starts.
    for unit in ssh.service sshd.service; do
        if systemctl try-reload-or-restart "$unit" 2>/dev/null; then break; fi
    done
elif [ -s /run/sshd.pid ]; then
    kill -HUP "$(cat /run/sshd.pid)"
else
    pkill -HUP -o -x sshd
fi
echo changed
"""


def _password_session(
    host: Host, user: str, known_hosts: Path, password: str
) -> paramiko.SSHClient:
    """An SSH session logged in with the password, the host key checked against known_hosts."""
    client = trust.checking_client(known_hosts)
    try:
        client.connect(
            host.ssh_address,
            port=host.ssh_port,
            username=user,
            password=password,
            look_for_keys=False,
            allow_agent=False,
            timeout=CONNECT_TIMEOUT,
            banner_timeout=CONNECT_TIMEOUT,
            auth_timeout=CONNECT_TIMEOUT,
        )
    except paramiko.BadAuthenticationType as exc:
        client.close()
        raise NodeFailed(
            f"its sshd does not take password login (it allows {', '.join(exc.allowed_types)}): "
            f"add the controller's public key to ~{user}/.ssh/authorized_keys there by hand"
        ) from None
    except paramiko.AuthenticationException:
        client.close()
        raise
    except (paramiko.SSHException, EOFError, OSError) as exc:
        client.close()
        raise NodeFailed(f"password login to {user}@{host.ssh_address} failed: {exc}") from None
    return client


def _run(client: paramiko.SSHClient, command: str, stdin: str | None = None):
    """(exit code, stdout, stderr) of `command`; `stdin` is written to its standard input."""
    channel = client.get_transport().open_session()
    channel.settimeout(COMMAND_TIMEOUT)
    channel.exec_command(command)
    if stdin is not None:
        channel.sendall(stdin.encode())
    channel.shutdown_write()
    with channel.makefile("rb") as out, channel.makefile_stderr("rb") as err:
        stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    code = channel.recv_exit_status()
    channel.close()
    return code, stdout, stderr


def _as_root(script: str) -> str:
    """`script` under sudo, the password read from standard input (sudo -S, no prompt)."""
    return f"sudo -S -p '' sh -c {shlex.quote(script)}"


def _sudo_failure(user: str, stderr: str) -> str:
    text = stderr.lower()
    if "not in the sudoers" in text or "not allowed to" in text or "may not run sudo" in text:
        return (
            f"user {user} has no sudo there: as root on the node, 'usermod -aG sudo {user}', "
            "then run bootstrap again"
        )
    if "incorrect password" in text or "sorry, try again" in text:
        return f"sudo refused {user}'s password there (sudo asks for the user's own password)"
    last = (stderr.strip().splitlines() or ["no output"])[-1]
    return f"sudo failed there: {last}"


def _password_allowed(host: Host, user: str) -> bool | None:
    """Whether the node's sshd offers password login to `user` (none auth, nothing is sent);
    None when that cannot be told."""
    try:
        sock = socket.create_connection((host.ssh_address, host.ssh_port), timeout=CONNECT_TIMEOUT)
    except OSError:
        return None
    transport = paramiko.Transport(sock)
    try:
        transport.start_client(timeout=CONNECT_TIMEOUT)
        transport.auth_none(user)
        return None  # logged in with no authentication at all: no answer to the question
    except paramiko.BadAuthenticationType as exc:
        return bool({"password", "keyboard-interactive"} & set(exc.allowed_types))
    except (paramiko.SSHException, EOFError, OSError):
        return None
    finally:
        transport.close()


def key_login_works(host: Host, known_hosts: Path, user: str) -> tuple[bool, bool]:
    """(key login works, passwordless sudo works), with the key alone."""
    refused, sudo = probe(host, known_hosts, user)
    return refused is None, sudo


def probe(host: Host, known_hosts: Path, user: str) -> tuple[str | None, bool]:
    """(what stops key login, None where it works; passwordless sudo works): SSH in batch mode,
    the host key checked against `known_hosts`, with the inventory's key alone, then
    `sudo -n true`."""
    remote = Remote(host, known_hosts=known_hosts, connect_timeout=CONNECT_TIMEOUT)
    try:
        remote.connect()
    except UserError as error:
        remote.close()
        return _login_refused(host, known_hosts, user, error), False
    try:
        if user == "root":
            return None, True
        return None, remote.run("sudo -n true", timeout=COMMAND_TIMEOUT).ok
    except UserError:
        return None, False
    finally:
        remote.close()


def _login_refused(host: Host, known_hosts: Path, user: str, error: UserError) -> str:
    """Why key login failed, in words for a line that names the node."""
    cause = error.__context__  # what Remote turned into this one-line error
    if trust.is_changed_key(cause):
        return f"its SSH host key is not the one in {known_hosts} (reinstalled?)"
    if isinstance(cause, paramiko.AuthenticationException):
        key = host.ssh_key or "~/.ssh/id_*"
        return f"it refuses key login as {user} with {key}"
    if trust.is_unknown_key(cause):
        return f"its SSH host key is not in {known_hosts}"
    if isinstance(cause, FileNotFoundError):
        return f"the key {host.ssh_key or '~/.ssh/id_*'} does not exist on this machine"
    return str(error).split(": ", 1)[-1]  # unreachable: Remote's reason, without the host


def not_ready(inventory: Inventory, sudo_without_password: bool = True) -> dict[str, str]:
    """What each node that `make provision` cannot use yet lacks (the nodes that are ready are
    left out): its host key in the inventory's known_hosts, key login with the inventory's key
    and user, passwordless sudo (unless not `sudo_without_password`: the playbook is given
    sudo's password). `make bootstrap` gives a fresh node all three."""
    known_hosts = inventory.known_hosts_file

    def missing(host: Host) -> str | None:
        user = user_of(host)
        refused, sudo = probe(host, known_hosts, user)
        if refused is not None:
            return refused
        if not sudo and sudo_without_password:
            return f"sudo asks {user} for a password (sudo -n true fails)"
        return None

    found = on_all(list(inventory.hosts), missing)
    return {name: what for name, what in found.items() if what is not None}


# ---------------------------------------------------------------------------------------------
# The whole bootstrap


def bootstrap(
    inventory: Inventory,
    prompter: Prompter,
    say: Say,
    fingerprints: Path | None = None,
    disable_password_login: bool = False,
) -> Outcome:
    """Bootstrap every node of the inventory; a node that fails is reported and the others go on."""
    # Bad input stops here, before anything is made or asked.
    key = key_path(inventory)
    expected = read_fingerprints(fingerprints) if fingerprints is not None else None
    for host in inventory.hosts:
        user_of(host)
    public_key, key_made = ensure_key(key)
    say(
        f"Controller key: {key} ({'made now' if key_made else 'already there'}; public part {key}.pub)"
    )
    known_hosts = inventory.known_hosts_file
    reports = [NodeReport(host) for host in inventory.hosts]

    # 1. Host keys, one node at a time (a question each).
    for report in reports:
        try:
            if check_host_key(report.host, known_hosts, expected, prompter, say):
                report.done.append("host key added to known_hosts")
        except NodeFailed as failed:
            report.failed = str(failed)
    say(f"Known hosts: {known_hosts}")

    # 2. Which nodes already take the key and give passwordless sudo: they need no password.
    waiting = []
    for report in _live(reports):
        user = user_of(report.host)
        key_ok, sudo_ok = key_login_works(report.host, known_hosts, user)
        if key_ok and sudo_ok:
            report.already = not report.done
            continue
        waiting.append((report, user))

    # 3. One password for all (asked again only for a node that refuses it).
    password: str | None = None
    for report, user in waiting:
        if password is None:
            users = sorted({u for _, u in waiting})
            password = prompter.password(
                f"\nLogin password of {' / '.join(users)} on the nodes (typed once, not shown): "
            )
            assert password is not None  # None only where a retry is asked (Prompter.password)
        try:
            _with_password(report, user, known_hosts, public_key, password, prompter, say)
        except NodeFailed as failed:
            report.failed = str(failed)

    # 4. Proven with the key alone, before anything else changes.
    for report in _live(reports):
        user = user_of(report.host)
        key_ok, sudo_ok = key_login_works(report.host, known_hosts, user)
        if not key_ok:
            report.failed = f"key login as {user} still fails after the key was installed"
        elif not sudo_ok:
            report.failed = (
                f"sudo -n still asks {user} for a password after the drop-in was installed"
            )
        elif not report.already:
            report.done.append("key login and passwordless sudo proven")

    # 5. Only on nodes proven to take the key.
    if disable_password_login:
        for report in _live(reports):
            try:
                _password_login_off(report, known_hosts)
            except NodeFailed as failed:
                report.failed = str(failed)
    return Outcome(key, key_made, known_hosts, reports)


def _live(reports: list[NodeReport]) -> list[NodeReport]:
    return [report for report in reports if report.ok]


def _with_password(
    report: NodeReport,
    user: str,
    known_hosts: Path,
    public_key: str,
    password: str,
    prompter: Prompter,
    say: Say,
) -> None:
    host = report.host
    say(f"{host.name}: logging in as {user} with the password...")
    try:
        client = _password_session(host, user, known_hosts, password)
    except paramiko.AuthenticationException:
        retry = prompter.password(
            f"{host.name} refused that password; password of {user} on {host.name}: ", retry=True
        )
        if not retry:
            raise NodeFailed(f"the password of {user} was refused") from None
        try:
            client = _password_session(host, user, known_hosts, retry)
        except paramiko.AuthenticationException:
            raise NodeFailed(f"the password of {user} was refused") from None
        password = retry
    try:
        code, out, err = _run(client, authorized_key_script(public_key))
        if code != 0:
            last = (err.strip().splitlines() or [f"exit {code}"])[-1]
            raise NodeFailed(f"installing the key in ~{user}/.ssh/authorized_keys failed: {last}")
        if out.strip() == "changed":
            report.done.append(f"key added to ~{user}/.ssh/authorized_keys")
        if user != "root":
            code, out, err = _run(client, _as_root(sudoers_script(user)), stdin=password + "\n")
            if code in (3, 4):
                raise NodeFailed((err.strip().splitlines() or ["visudo refused the drop-in"])[-1])
            if code != 0:
                raise NodeFailed(_sudo_failure(user, err))
            if out.strip() == "changed":
                report.done.append(
                    f"passwordless sudo for {user} ({SUDOERS_DROP_IN}, visudo -c passed)"
                )
    finally:
        client.close()


def _password_login_off(report: NodeReport, known_hosts: Path) -> None:
    host = report.host
    user = user_of(host)
    remote = Remote(host, known_hosts=known_hosts, connect_timeout=CONNECT_TIMEOUT)
    with remote:
        command = password_off_script()
        if user != "root":
            command = f"sudo -n sh -c {shlex.quote(command)}"
        result = remote.run(command, timeout=COMMAND_TIMEOUT)
    if not result.ok:
        last = (result.stderr.strip().splitlines() or [f"exit {result.exit_code}"])[-1]
        raise NodeFailed(f"turning password login off failed: {last}")
    # sshd re-executes itself on the reload: a connection in that moment is refused.
    deadline = time.monotonic() + RELOAD_TIMEOUT
    while not key_login_works(host, known_hosts, user)[0]:
        if time.monotonic() > deadline:
            raise NodeFailed(
                f"key login fails since password login was turned off; on the node's console: "
                f"rm {SSHD_DROP_IN} and reload sshd"
            )
        time.sleep(0.5)
    offered = _password_allowed(host, user)
    while offered is None and time.monotonic() < deadline:
        time.sleep(0.5)
        offered = _password_allowed(host, user)
    if offered is not False:
        raise NodeFailed(f"sshd still offers password login after {SSHD_DROP_IN} and a reload")
    if result.stdout.strip() == "changed":
        report.done.append(f"SSH password login off ({SSHD_DROP_IN}, sshd -t passed)")
        report.already = False
