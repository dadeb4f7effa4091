"""The keys of first contact (provision.bootstrap): the controller's key pair (ed25519, made
if there is none) and each node's host key, fetched and confirmed by its fingerprint (typed
"yes", or a file of expected fingerprints) before it is added to the known_hosts file; host-key
checking is never off. Also the questions bootstrap asks on the terminal (Prompter) and the
NodeFailed that ends one node's bootstrap.
"""

from __future__ import annotations

import base64
import getpass
import hashlib
import os
import re
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import paramiko

from torch_multinode.cluster import trust
from torch_multinode.cluster.errors import UserError, shown
from torch_multinode.cluster.inventory import Host, Inventory

DEFAULT_KEY = Path("~/.ssh/id_ed25519")
CONNECT_TIMEOUT = 15.0
# In the order a node's host key is asked for: the fingerprint shown is of the first type the
# node has (every OpenSSH since 6.5 makes an ed25519 key).
HOST_KEY_TYPES = {
    "ssh-ed25519": "ed25519",
    "ecdsa-sha2-nistp256": "ecdsa",
    "rsa-sha2-512": "rsa",
    "rsa-sha2-256": "rsa",
}
_FINGERPRINT = re.compile(r"^SHA256:[A-Za-z0-9+/]{43}$")

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
    entry = trust.host_entry(host)
    recorded = trust.recorded_keys(known_hosts, host)
    key = fetch_host_key(host, prefer=tuple(recorded.keys()))
    fingerprint_now = fingerprint(key)
    if key.get_name() in recorded:
        if recorded[key.get_name()] == key:
            return False
        raise NodeFailed(
            f"its host key ({fingerprint_now}) is not the one recorded for {entry} in "
            f"{known_hosts}: the node was reinstalled, or this is not the node; if it was "
            f"reinstalled, {trust.forget_command(known_hosts, host)} and run bootstrap again"
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
    trust.add_known_host(known_hosts, entry, key)
    return True
