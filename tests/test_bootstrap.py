"""From machines as a fresh install leaves them to keys and sudo, as a user types it:

    make sim-up NNODES=2 FRESH=1                 (here: the command it runs, on the test's networks)
    make bootstrap INVENTORY=...                  (host keys confirmed, the password typed once)

The prompts are answered through a pseudo-terminal. Meanwhile the test watches the process
lists of the controller and of every node for the password, and afterwards looks for it in
every output, in the files the run wrote and in the nodes' files and logs.

What comes next on such nodes (`make provision`, `make netcheck`, `make train` in the training
image, as the bootstrapped user) is the shared `provisioned` cluster's: nodes made the same way,
bootstrapped unattended (tests/conftest.py), then provisioned; tests/test_end_to_end.py runs the
flow on them and looks for that cluster's password in the same places.
"""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import threading
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO_ROOT, VENV_BIN, console_fingerprint, make
from tests.helpers import password_in_node_files, password_login
from tests.terminal import Terminal
from torch_multinode.cluster.inventory_read import load
from torch_multinode.provision import bootstrap
from torch_multinode.sim import nodes as sim

CONFIRM = (
    r"(node\d) \((\S+)\) presents the ED25519 host key\n\s+(SHA256:\S+)\n"
    r"  On node\d's own console, 'ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub' prints its "
    r"fingerprint.\n  Is it the same\? Type yes to trust it, anything else to refuse: "
)
# Files under the repository larger than this are not searched for the password.
MAX_SEARCHED = 50 * 1024 * 1024
PASSWORD_PROMPT = r"Login password of trainer on the nodes \(typed once, not shown\): "


class Watch:
    """Every process's command line on the controller and on each node, sampled until stopped."""

    def __init__(self, containers: list[str]):
        self.containers = containers
        self.seen: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            lists = [subprocess.run(["ps", "-eww", "-o", "args="], capture_output=True, text=True)]
            for container in self.containers:
                lists.append(
                    sim.docker("exec", container, "ps", "-eww", "-o", "args=", check=False)
                )
            for listing in lists:
                self.seen.update(listing.stdout.splitlines())
            time.sleep(0.1)

    def stop(self) -> set[str]:
        self._stop.set()
        self._thread.join(timeout=30)
        return self.seen


def _bootstrap_terminal(inventory: Path, *extra: str) -> Terminal:
    return Terminal(
        ["make", "--no-print-directory", "bootstrap", f"INVENTORY={inventory}", *extra], REPO_ROOT
    )


def _node_state(container: str) -> str:
    """What bootstrap may change on a node, to compare before and after a run."""
    return sim.docker(
        "exec",
        container,
        "sh",
        "-c",
        "cat /home/trainer/.ssh/authorized_keys /etc/sudoers.d/torch-multinode 2>&1; "
        "ls -l --time-style=+%s.%N /etc/sudoers.d /etc/ssh/sshd_config.d /home/trainer/.ssh",
    ).stdout


@pytest.fixture(scope="module")
def fresh(sim_factory, tmp_path_factory):
    """Two nodes as a fresh install leaves them; node2's user has another password than node1's."""
    started = time.time()  # before the passwords exist: files changed from here on are searched
    config = sim_factory.config()
    sim_factory.started.append(config)
    first, second = secrets.token_urlsafe(12), secrets.token_urlsafe(12)
    # What `make sim-up NNODES=2 FRESH=1` runs, on this test's own networks and state directory;
    # the password comes on stdin, as from a pipe (at a terminal it is asked twice).
    planned = make("-n", "sim-up", "NNODES=2", "FRESH=1", timeout=60)
    assert planned.returncode == 0, planned.stdout + planned.stderr
    command = planned.stdout.strip().splitlines()[-1].split()
    assert command[0].endswith("bin/python"), planned.stdout
    assert command[1:] == "-m torch_multinode.sim.cli up --nodes 2 --fresh".split(), planned.stdout
    placed = ["--name", config.name, "--subnet", config.subnet, "--mgmt-subnet"]
    placed += [config.mgmt_subnet, "--state-dir", str(config.state_dir)]
    up = subprocess.run(
        [*command, *placed],
        cwd=REPO_ROOT,
        input=first + "\n",
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert up.returncode == 0, up.stdout + up.stderr
    assert f"make bootstrap INVENTORY={config.inventory_path}" in up.stdout, up.stdout
    assert f"trainer@{config.mgmt_ip(1)}" in up.stdout, up.stdout
    cluster = sim.SimCluster(config, [config.container(1), config.container(2)], None, False)
    sim.docker("exec", "-i", config.container(2), "chpasswd", stdin=f"trainer:{second}\n")
    inventory = tmp_path_factory.mktemp("fresh") / "inventory.yml"
    inventory.write_text(config.inventory_path.read_text())
    yield cluster, inventory, (first, second), started, up.stdout + up.stderr
    sim_factory.down(cluster)


@pytest.mark.sim
@pytest.mark.image_e2e
@pytest.mark.timeout(1200)
def test_bootstrap_takes_fresh_nodes_from_a_typed_password_to_keys_and_sudo(fresh):
    cluster, inventory, (first, second), started, sim_up_output = fresh
    config = cluster.config
    containers = [config.container(1), config.container(2)]
    known_hosts = config.known_hosts_path
    outputs: list[str] = [sim_up_output]
    seen: set[str] = set()
    watch = Watch(containers)
    try:
        # The fresh inventory knows no host key and the controller has no key for it.
        assert known_hosts.read_text() == "" and not config.key_path.exists()

        # 1. Both host keys confirmed by the user, who compares with each node's console; the
        #    common password typed once, node2 refuses it and then the wrong one again.
        term = _bootstrap_terminal(inventory)
        for index in (1, 2):
            shown = term.expect(CONFIRM)
            assert shown.group(1, 2) == (f"node{index}", config.mgmt_ip(index))
            assert shown.group(3) == console_fingerprint(containers[index - 1])
            term.type("yes\n")
        term.expect(PASSWORD_PROMPT)
        term.type(first + "\n")
        term.expect(r"node2 refused that password; password of trainer on node2: ")
        term.type("not-" + second + "\n")
        code = term.finish()
        outputs.append(term.transcript)
        assert code != 0, term.transcript
        assert f"Controller key: {config.key_path} (made now" in term.transcript
        errors = [line for line in term.transcript.splitlines() if line.startswith("Error:")]
        assert errors == [
            f"Error: host 'node2' ({config.mgmt_ip(2)}): the password of trainer was refused"
        ], term.transcript
        assert "\n  node1        host key added to known_hosts; key added" in term.transcript
        assert oct(config.key_path.stat().st_mode & 0o777) == "0o600"

        # 2. node1 is done and says so; node2 asks for the password again, and takes it.
        term = _bootstrap_terminal(inventory)
        term.expect(PASSWORD_PROMPT)
        term.type(second + "\n")
        code = term.finish()
        outputs.append(term.transcript)
        assert code == 0, term.transcript
        assert "\n  node1        already bootstrapped, nothing changed" in term.transcript
        assert "\n  node2        key added to ~trainer/.ssh/authorized_keys; passwordless sudo" in (
            term.transcript
        )
        assert "Next: make provision INVENTORY=" in term.transcript

        # 3. A second run asks nothing (no terminal at all) and changes nothing.
        before = [_node_state(c) for c in containers], known_hosts.read_text()
        #    No terminal: standard input empty and no controlling terminal, so a prompt would
        #    end the run with an error rather than wait.
        again = subprocess.run(
            ["make", "--no-print-directory", "bootstrap", f"INVENTORY={inventory}"],
            cwd=REPO_ROOT,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=300,
            start_new_session=True,
            check=False,
        )
        outputs.append(again.stdout + again.stderr)
        assert "Login password" not in outputs[-1] and "Type yes" not in outputs[-1]
        assert again.returncode == 0, again.stdout + again.stderr
        assert again.stdout.count("already bootstrapped, nothing changed") == 2
        assert ([_node_state(c) for c in containers], known_hosts.read_text()) == before

        # 3b. A user without sudo: one line naming the node and the fix; node1 still fine.
        outputs.append(_a_user_without_sudo_is_named(config, inventory, second))

        # 4. node2 presents another host key than the confirmed one: refused, named; node1 fine.
        outputs.append(_another_host_key_is_refused(config, inventory))

        # 5. Password login off, once key and sudo are proven: refused after, key login works.
        hosts = load(inventory).hosts
        assert password_login(hosts[0], known_hosts, first) == "ok"
        off = make("bootstrap", f"INVENTORY={inventory}", "NO_PASSWORD_LOGIN=1", timeout=300)
        outputs.append(off.stdout + off.stderr)
        assert off.returncode == 0, off.stdout + off.stderr
        assert off.stdout.count("SSH password login off (") == 2
        logins = [password_login(hosts[i], known_hosts, p) for i, p in enumerate((first, second))]
        assert logins == ["not offered", "not offered"]
        assert all(
            bootstrap.key_login_works(h, known_hosts, "trainer") == (True, True) for h in hosts
        )
    finally:
        seen |= watch.stop()

    # 6. The password in no process list, output, file written, or node file or log.
    #    The watch did look while bootstrap ran: it saw its process here and its logins there.
    assert [line for line in seen if "cluster bootstrap -i" in line], sorted(seen)[:50]
    assert [line for line in seen if re.match(r"sshd(-session)?: trainer", line)], sorted(seen)
    passwords = (first, second, "not-" + second)
    assert _repository_files_holding(passwords, since=started) == []
    for password in passwords:
        assert not [line for line in seen if password in line]
        assert not [text for text in outputs if password in text]
        for root in (config.state_dir, inventory.parent, REPO_ROOT / ".runs"):
            found = subprocess.run(["grep", "-rlF", password, str(root)], capture_output=True)
            assert found.stdout == b"", found.stdout
        for container in containers:
            assert password_in_node_files(container, password) == ""
    assert len(seen) > 20  # the watch did see the processes of the runs


def _repository_files_holding(passwords: tuple[str, ...], since: float) -> list[str]:
    """The regular files under the repository written or changed since `since` (by mtime or
    ctime: a copy that kept an older mtime still counts) that hold any of `passwords`. Not
    searched: .venv/, .git/objects, files over MAX_SEARCHED and any that cannot be read (other
    tests write and remove files here meanwhile). Symbolic links are not followed."""
    needles = [password.encode() for password in passwords]
    skipped = {REPO_ROOT / ".venv", REPO_ROOT / ".git" / "objects"}
    holding: list[str] = []
    pending = [REPO_ROOT]
    while pending:
        try:
            entries = list(os.scandir(pending.pop()))
        except OSError:
            continue
        for entry in entries:
            path = Path(entry.path)
            try:
                if entry.is_dir(follow_symlinks=False):
                    if path not in skipped:
                        pending.append(path)
                    continue
                if not entry.is_file(follow_symlinks=False):
                    continue
                info = entry.stat(follow_symlinks=False)
                if max(info.st_mtime, info.st_ctime) < since or info.st_size > MAX_SEARCHED:
                    continue
                data = path.read_bytes()
            except OSError:
                continue
            if any(needle in data for needle in needles):
                holding.append(str(path.relative_to(REPO_ROOT)))
    return holding


def _another_host_key_is_refused(config: sim.SimConfig, inventory: Path) -> str:
    container = config.container(2)
    keep = "mkdir -p /root/hostkeys && cp -p /etc/ssh/ssh_host_* /root/hostkeys/"
    renew = "rm /etc/ssh/ssh_host_* && ssh-keygen -A >/dev/null && kill -HUP $(cat /run/sshd.pid)"
    restore = (
        "cp -p /root/hostkeys/* /etc/ssh/ && rm -r /root/hostkeys && kill -HUP $(cat /run/sshd.pid)"
    )
    sim.docker("exec", container, "sh", "-c", f"{keep} && {renew}")
    try:
        time.sleep(1)  # sshd re-executes itself on SIGHUP
        refused = make("bootstrap", f"INVENTORY={inventory}", timeout=300)
        assert refused.returncode != 0, refused.stdout + refused.stderr
        errors = [line for line in refused.stderr.splitlines() if line.startswith("Error:")]
        assert len(errors) == 1 and errors[0].startswith(
            f"Error: host 'node2' ({config.mgmt_ip(2)}): its host key (SHA256:"
        ), refused.stderr
        assert "is not the one recorded for" in errors[0] and "reinstalled" in errors[0]
        assert "\n  node1        already bootstrapped, nothing changed" in refused.stdout
    finally:
        sim.docker("exec", container, "sh", "-c", restore)
        time.sleep(1)
    return refused.stdout + refused.stderr


def _a_user_without_sudo_is_named(config: sim.SimConfig, inventory: Path, password: str) -> str:
    container = config.container(2)
    sim.docker("exec", container, "useradd", "-m", "-s", "/bin/bash", "nosudo")
    sim.docker("exec", "-i", container, "chpasswd", stdin=f"nosudo:{password}\n")
    document = yaml.safe_load(inventory.read_text())
    document["all"]["children"]["nodes"]["hosts"]["node2"]["ansible_user"] = "nosudo"
    other = inventory.with_name("nosudo.yml")
    other.write_text(yaml.safe_dump(document, sort_keys=False))
    try:
        done = subprocess.run(
            [str(VENV_BIN / "cluster"), "bootstrap", "-i", str(other), "--password-stdin"],
            input=password + "\n",
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert done.returncode == 1, done.stdout + done.stderr
        assert done.stderr.splitlines() == [
            f"Error: host 'node2' ({config.mgmt_ip(2)}): user nosudo has no sudo there: as root "
            "on the node, 'usermod -aG sudo nosudo', then run bootstrap again"
        ], done.stderr
        assert "\n  node1        already bootstrapped, nothing changed" in done.stdout
        # Nothing of sudo changed for it: still asks, and no drop-in names it.
        grants = sim.docker("exec", container, "sh", "-c", "cat /etc/sudoers.d/*").stdout
        assert "nosudo" not in grants
    finally:
        sim.docker("exec", container, "userdel", "-r", "nosudo", check=False)
        other.unlink()
    return done.stdout + done.stderr
