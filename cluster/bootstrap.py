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

The password lives in this process's memory only: it goes to the node inside the SSH
connection (authentication) and on sudo's standard input, never on a command line, in a file
or in any output.
"""

from __future__ import annotations

import base64
import getpass
import hashlib
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import paramiko

from torch_multinode.cluster.errors import UserError, shown
from torch_multinode.cluster.inventory import Host, Inventory
from torch_multinode.cluster.remote import Remote, on_all

DEFAULT_KEY = Path("~/.ssh/id_ed25519")
SUDOERS_DROP_IN = "/etc/sudoers.d/torch-multinode"
# sshd takes the first value it reads for each keyword, and reads sshd_config.d/*.conf in name
# order before the main file: "00-" comes before the "50-cloud-init.conf" that turns it back on.
SSHD_DROP_IN = "/etc/ssh/sshd_config.d/00-torch-multinode.conf"
CONNECT_TIMEOUT = 15.0
COMMAND_TIMEOUT = 60.0
RELOAD_TIMEOUT = 20.0
# In the order a node's host key is asked for: the fingerprint shown is of the first type the
# node has (every OpenSSH since 6.5 makes an ed25519 key).
HOST_KEY_TYPES = {
    "ssh-ed25519": "ed25519",
    "ecdsa-sha2-nistp256": "ecdsa",
    "rsa-sha2-512": "rsa",
    "rsa-sha2-256": "rsa",
}
_FINGERPRINT = re.compile(r"^SHA256:[A-Za-z0-9+/]{43}$")
# What sudoers and useradd accept as a user name, and nothing that could change a sudoers line.
_USER_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,31}$")

Say = Callable[[str], None]


class NodeFailed(Exception):
    """This node cannot be bootstrapped; the message is the one line that says why."""


class Prompter:
    """The questions bootstrap asks, on the terminal; tests answer them through a pty."""

    def __init__(self, interactive: bool | None = None, password_stdin: bool = False):
        self.interactive = sys.stdin.isatty() if interactive is None else interactive
        self.password_stdin = password_stdin
        self._stdin_password: str | None = None

    def confirm(self, question: str) -> bool:
        if not self.interactive:
            raise UserError(
                "a host key needs confirming and there is no terminal to ask on",
                hint="running make bootstrap in a terminal, or FINGERPRINTS=file with one 'NODE "
                "SHA256:...' line per node",
            )
        print(question, end="", file=sys.stderr, flush=True)
        answer = sys.stdin.readline()
        if not answer:
            raise UserError("no answer (end of input)", exit_code=1)
        return answer.strip().lower() in ("yes", "y")

    def password(self, question: str, retry: bool = False) -> str | None:
        """The password typed at `question` (never echoed); None when it cannot be asked."""
        if self.password_stdin:
            if retry:
                return None  # one password from stdin; a node that refuses it fails
            if self._stdin_password is None:
                self._stdin_password = sys.stdin.readline().rstrip("\n")
            return self._stdin_password
        if not self.interactive:
            raise UserError(
                "a node needs its login password and there is no terminal to ask on",
                hint="running make bootstrap in a terminal, or --password-stdin with the "
                "password on standard input",
            )
        return getpass.getpass(question, stream=sys.stderr)


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
# The controller's key pair


def key_path(inventory: Inventory) -> Path:
    """The private key the inventory logs in with (the first host's), or ~/.ssh/id_ed25519."""
    keys = {host.ssh_key for host in inventory.hosts}
    if len(keys) > 1:
        raise UserError(
            f"inventory {inventory.path}: the hosts name different ansible_ssh_private_key_file "
            "values; bootstrap installs one key on every node",
            hint="one ansible_ssh_private_key_file in all.vars",
        )
    chosen = keys.pop() or DEFAULT_KEY
    return Path(os.path.expanduser(chosen))


def ensure_key(path: Path) -> tuple[str, bool]:
    """The public key line of the pair at `path`, made (ed25519, no passphrase, 0600) if there
    is none; and whether it was made now."""
    public = Path(f"{path}.pub")
    made = False
    if not path.exists():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        comment = f"torch-multinode@{socket.gethostname()}"
        _ssh_keygen("-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path))
        made = True
    elif not public.exists():
        public.write_text(_ssh_keygen("-y", "-f", str(path)))
    if path.stat().st_mode & 0o077:
        raise UserError(
            f"the private key {path} can be read by other users; ssh refuses to use it",
            hint=f"chmod 600 {path}",
        )
    parts = public.read_text().split()
    if len(parts) < 2:
        raise UserError(f"{public} holds no public key", hint=f"ssh-keygen -y -f {path} > {public}")
    return f"{parts[0]} {parts[1]}", made


def _ssh_keygen(*args: str) -> str:
    try:
        done = subprocess.run(
            ["ssh-keygen", *args],
            capture_output=True,
            text=True,
            check=False,
            timeout=60,
            stdin=subprocess.DEVNULL,
        )
    except FileNotFoundError:
        raise UserError(
            "ssh-keygen is not installed", hint="apt-get install openssh-client"
        ) from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        raise UserError(f"ssh-keygen {' '.join(args[:2])} failed: {last}", exit_code=1)
    return done.stdout


# ---------------------------------------------------------------------------------------------
# Host keys


def fingerprint(key: paramiko.PKey) -> str:
    """As `ssh-keygen -lf` prints it: SHA256 of the key blob, base64 without padding."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def known_hosts_entry(host: Host) -> str:
    """How known_hosts names the node: the address, or [address]:port off port 22."""
    if host.ssh_port == 22:
        return host.ssh_address
    return f"[{host.ssh_address}]:{host.ssh_port}"


def console_command(key: paramiko.PKey) -> str:
    """What prints the same fingerprint on the node's own console."""
    kind = HOST_KEY_TYPES.get(key.get_name(), "ed25519")
    return f"ssh-keygen -lf /etc/ssh/ssh_host_{kind}_key.pub"


def fetch_host_key(host: Host, prefer: tuple[str, ...] = (), timeout: float = CONNECT_TIMEOUT):
    """The host key the node's sshd presents (the key exchange only, nothing is trusted yet)."""
    try:
        sock = socket.create_connection((host.ssh_address, host.ssh_port), timeout=timeout)
    except OSError as exc:
        raise NodeFailed(
            f"cannot reach {host.ssh_address}:{host.ssh_port}: {exc.strerror or exc}"
        ) from None
    transport = paramiko.Transport(sock)
    try:
        wanted = list(prefer) + [name for name in HOST_KEY_TYPES if name not in prefer]
        transport.get_security_options().key_types = wanted
        transport.start_client(timeout=timeout)
        return transport.get_remote_server_key()
    except (paramiko.SSHException, EOFError, OSError) as exc:
        raise NodeFailed(
            f"no SSH host key from {host.ssh_address}:{host.ssh_port}: {exc or type(exc).__name__}"
        ) from None
    finally:
        transport.close()


def read_fingerprints(path: Path) -> dict[str, str]:
    """A file of expected fingerprints: one 'NODE SHA256:...' per line, NODE being the
    inventory's host name or its address; '#' starts a comment."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise UserError(f"fingerprints file {path} cannot be read: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise UserError(f"fingerprints file {path} is not text") from None
    expected: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        if len(words) != 2 or not _FINGERPRINT.match(words[1]):
            raise UserError(
                f"fingerprints file {path}, line {number}: {shown(line.strip())} is not "
                "'NODE SHA256:...'",
                hint="the SHA256 fingerprint that 'ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub' "
                "prints on the node",
            )
        if words[0] in expected and expected[words[0]] != words[1]:
            raise UserError(
                f"fingerprints file {path}, line {number}: a second fingerprint for {words[0]}"
            )
        expected[words[0]] = words[1]
    return expected


def check_host_key(
    host: Host,
    known_hosts: Path,
    expected: dict[str, str] | None,
    prompter: Prompter,
    say: Say,
) -> bool:
    """Make the node's host key known: True when it was added now, False when it already was.
    Raises NodeFailed when the key is not the expected one or not confirmed."""
    entry = known_hosts_entry(host)
    known = paramiko.HostKeys()
    if known_hosts.exists():
        try:
            known.load(str(known_hosts))
        except (OSError, paramiko.SSHException) as exc:
            raise UserError(f"{known_hosts} cannot be read: {exc}") from None
    recorded = known.lookup(entry) or {}
    key = fetch_host_key(host, prefer=tuple(recorded.keys()))
    fingerprint_now = fingerprint(key)
    if key.get_name() in recorded:
        if recorded[key.get_name()] == key:
            return False
        raise NodeFailed(
            f"its host key ({fingerprint_now}) is not the one recorded for {entry} in "
            f"{known_hosts}: the node was reinstalled, or this is not the node; if it was "
            f"reinstalled, ssh-keygen -f {known_hosts} -R '{entry}' and run bootstrap again"
        )
    if expected is not None:
        wanted = expected.get(host.name) or expected.get(host.ssh_address)
        if wanted is None:
            raise NodeFailed("no fingerprint for it in the fingerprints file")
        if wanted != fingerprint_now:
            raise NodeFailed(
                f"its host key is {fingerprint_now}, not {wanted} as the fingerprints file says: "
                "refused (not the node, or it was reinstalled)"
            )
        say(f"{host.name}: host key {fingerprint_now} matches the fingerprints file")
    else:
        kind = key.get_name().removeprefix("ssh-").split("-")[0].upper()
        question = (
            f"\n{host.name} ({host.ssh_address}) presents the {kind} host key\n"
            f"    {fingerprint_now}\n"
            f"  On {host.name}'s own console, '{console_command(key)}' prints its fingerprint.\n"
            f"  Is it the same? Type yes to trust it, anything else to refuse: "
        )
        if not prompter.confirm(question):
            raise NodeFailed(f"its host key {fingerprint_now} was not confirmed: refused")
    _append_known_host(known_hosts, entry, key)
    return True


def _append_known_host(known_hosts: Path, entry: str, key: paramiko.PKey) -> None:
    known_hosts.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    existing = known_hosts.read_bytes() if known_hosts.exists() else b""
    line = f"{entry} {key.get_name()} {key.get_base64()}\n"
    with known_hosts.open("a", encoding="utf-8") as out:
        if existing and not existing.endswith(b"\n"):
            out.write("\n")
        out.write(line)


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
    client = paramiko.SSHClient()
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    client.load_host_keys(str(known_hosts))
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
    if isinstance(cause, paramiko.BadHostKeyException):
        return f"its SSH host key is not the one in {known_hosts} (reinstalled?)"
    if isinstance(cause, paramiko.AuthenticationException):
        key = host.ssh_key or "~/.ssh/id_*"
        return f"it refuses key login as {user} with {key}"
    if isinstance(cause, paramiko.SSHException) and "not found in known_hosts" in str(cause):
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
