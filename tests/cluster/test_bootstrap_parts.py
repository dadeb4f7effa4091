"""The parts of `make bootstrap`: the key pair, fingerprints, the scripts it runs on a node, and
its one-line failures. The whole flow from fresh nodes is tests/test_bootstrap.py."""

from __future__ import annotations

import subprocess
from pathlib import Path

import paramiko
import pytest
import yaml

from tests.conftest import VENV_BIN, run_cli
from torch_multinode.cluster.errors import UserError
from torch_multinode.cluster.inventory_read import load
from torch_multinode.provision import bootstrap, keys
from torch_multinode.sim import nodes as sim

ED25519_SHA256 = "SHA256:" + "A" * 43


def test_a_missing_key_pair_is_made_once_private_0600(tmp_path):
    key = tmp_path / "keys" / "id_ed25519"
    public, made = keys.ensure_key(key)
    assert made and public.startswith("ssh-ed25519 ")
    assert oct(key.stat().st_mode & 0o777) == "0o600"
    assert oct(key.parent.stat().st_mode & 0o777) == "0o700"
    assert keys.ensure_key(key) == (public, False)
    Path(f"{key}.pub").unlink()  # the public half is made again from the private one
    assert keys.ensure_key(key) == (public, False)


def test_a_private_key_others_can_read_is_refused(tmp_path):
    key = tmp_path / "id_ed25519"
    keys.ensure_key(key)
    key.chmod(0o644)
    with pytest.raises(UserError, match="can be read by other users") as raised:
        keys.ensure_key(key)
    assert raised.value.hint == f"chmod 600 {key}"


def test_the_fingerprint_is_the_one_ssh_keygen_prints_on_the_node(tmp_path):
    key = tmp_path / "host_key"
    keys.ensure_key(key)
    printed = subprocess.run(
        ["ssh-keygen", "-lf", f"{key}.pub"], capture_output=True, text=True, check=True
    ).stdout.split()[1]
    loaded = paramiko.Ed25519Key.from_private_key_file(str(key))
    assert keys.fingerprint(loaded) == printed
    assert keys.console_command(loaded) == "ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub"


def test_fingerprints_file_reads_names_and_addresses_and_comments(tmp_path):
    path = tmp_path / "fingerprints"
    path.write_text(
        f"# from each node's console\npc1 {ED25519_SHA256}  # desk\n\n10.0.0.2 {ED25519_SHA256}\n"
    )
    assert keys.read_fingerprints(path) == {"pc1": ED25519_SHA256, "10.0.0.2": ED25519_SHA256}


@pytest.mark.parametrize(
    "text, message",
    [
        ("pc1 MD5:aa:bb\n", "line 1: 'pc1 MD5:aa:bb' is not 'NODE SHA256:...'"),
        (f"pc1\npc2 {ED25519_SHA256}\n", "line 1: 'pc1' is not"),
        (f"pc1 {ED25519_SHA256} extra\n", "is not 'NODE SHA256:...'"),
        (f"pc1 {ED25519_SHA256}\npc1 SHA256:{'B' * 43}\n", "line 2: a second fingerprint for pc1"),
    ],
)
def test_a_bad_fingerprints_line_is_named(tmp_path, text, message):
    path = tmp_path / "fingerprints"
    path.write_text(text)
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(".", r"\.")):
        keys.read_fingerprints(path)


def _inventory(tmp_path: Path, hosts: dict, **cluster_vars) -> Path:
    document = {
        "all": {
            "vars": {"compute_subnet": "10.8.0.0/24", **cluster_vars},
            "children": {"nodes": {"hosts": hosts}},
        }
    }
    path = tmp_path / "inventory.yml"
    path.write_text(yaml.safe_dump(document))
    return path


def _host(number: int, **extra) -> dict:
    address = f"10.8.0.{number}"
    return {
        "ansible_host": address,
        "compute_ip": address,
        "compute_interface": "eth0",
        "gpus": 0,
        **extra,
    }


def test_one_key_for_every_node_defaulting_to_the_users_own(tmp_path):
    default = load(_inventory(tmp_path, {"a": _host(1)}))
    assert keys.key_path(default) == Path("~/.ssh/id_ed25519").expanduser()
    two = load(
        _inventory(
            tmp_path,
            {
                "a": _host(1, ansible_ssh_private_key_file="/k/one"),
                "b": _host(2, ansible_ssh_private_key_file="/k/two"),
            },
        )
    )
    with pytest.raises(UserError, match="different ansible_ssh_private_key_file"):
        keys.key_path(two)


def test_a_user_name_sudoers_could_misread_is_refused(tmp_path):
    inventory = load(_inventory(tmp_path, {"a": _host(1)}, ansible_user="me,root"))
    with pytest.raises(UserError, match="user 'me,root' is not a user name sudoers takes"):
        bootstrap.user_of(inventory.hosts[0])


def test_bootstrap_without_an_inventory_is_one_line():
    done = run_cli("cluster", "bootstrap")
    assert done.returncode == 2
    assert done.stderr.splitlines()[0].startswith("Error: no inventory given")


def test_a_missing_fingerprints_file_is_one_line_and_nothing_is_made(tmp_path):
    key = tmp_path / "keys" / "id_ed25519"
    path = _inventory(tmp_path, {"a": _host(1)}, ansible_ssh_private_key_file=str(key))
    done = run_cli("cluster", "bootstrap", "-i", str(path), "--fingerprints", str(tmp_path / "no"))
    assert done.returncode != 0
    assert done.stderr.strip().splitlines() == [
        f"Error: fingerprints file {tmp_path / 'no'} cannot be read: No such file or directory"
    ]
    assert not key.parent.exists()  # checked before the key pair would be made


def _on_node(cluster, script: str) -> subprocess.CompletedProcess:
    return sim.docker("exec", cluster.config.container(1), "sh", "-c", script, check=False)


@pytest.mark.sim
def test_a_sudoers_drop_in_visudo_refuses_never_takes_effect(sim2):
    """The drop-in's script as root on a node: a line visudo refuses leaves sudo as it was."""
    before = _on_node(sim2, "ls -a /etc/sudoers.d").stdout
    broken = _on_node(sim2, bootstrap.sudoers_script("trainer ALL=(ALL"))
    assert broken.returncode == 3, broken.stdout + broken.stderr
    assert "visudo refused the drop-in" in broken.stderr
    assert _on_node(sim2, "ls -a /etc/sudoers.d").stdout == before
    try:
        made = _on_node(sim2, bootstrap.sudoers_script("trainer"))
        assert (made.returncode, made.stdout) == (0, "changed\n"), made.stderr
        again = _on_node(sim2, bootstrap.sudoers_script("trainer"))
        assert (again.returncode, again.stdout) == (0, "unchanged\n")
        mode = _on_node(sim2, f"stat -c '%a %U' {bootstrap.SUDOERS_DROP_IN}; visudo -c -q; echo $?")
        assert mode.stdout == "440 root\n0\n"
    finally:
        _on_node(sim2, f"rm -f {bootstrap.SUDOERS_DROP_IN}")


@pytest.mark.sim
def test_an_unreachable_node_is_one_line_and_the_others_are_still_done(sim2, tmp_path):
    """node3's address is in the cluster's own management network, where no node answers."""
    document = yaml.safe_load(sim2.config.inventory_path.read_text())
    hosts = document["all"]["children"]["nodes"]["hosts"]
    ghost = sim2.config.mgmt_ip(4)
    hosts["node3"] = {**hosts["node2"], "ansible_host": ghost, "compute_ip": sim2.config.node_ip(4)}
    hosts["node3"].pop("sim_container")
    path = tmp_path / "inventory.yml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    known = sim2.config.known_hosts_path.read_text()
    done = run_cli("cluster", "bootstrap", "-i", str(path), timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    errors = done.stderr.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith(
        f"Error: host 'node3' ({ghost}): cannot reach {ghost}:22"
    )
    assert done.stdout.count("already bootstrapped, nothing changed") == 2
    assert sim2.config.known_hosts_path.read_text() == known


@pytest.mark.sim
def test_an_unknown_host_key_with_no_terminal_asks_for_a_fingerprints_file(sim2, tmp_path):
    document = yaml.safe_load(sim2.config.inventory_path.read_text())
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    document["all"]["vars"]["ssh_known_hosts_file"] = str(empty)
    path = tmp_path / "inventory.yml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    done = subprocess.run(
        [str(VENV_BIN / "cluster"), "bootstrap", "-i", str(path)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode != 0
    assert done.stderr.strip().splitlines() == [
        "Error: a host key needs confirming and there is no terminal to ask on (try running "
        "make bootstrap in a terminal, or FINGERPRINTS=file with one 'NODE SHA256:...' line per "
        "node)"
    ]
    assert empty.read_text() == ""


@pytest.mark.sim
def test_a_fingerprints_file_lets_the_matching_key_in_and_refuses_the_other(sim2, tmp_path):
    """Unattended: node1's line is its console's fingerprint, node2's is not node2's."""
    document = yaml.safe_load(sim2.config.inventory_path.read_text())
    known = tmp_path / "known_hosts"
    document["all"]["vars"]["ssh_known_hosts_file"] = str(known)
    path = tmp_path / "inventory.yml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    console = [
        _on_node(sim2, "ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub").stdout.split()[1],
        sim.docker(
            "exec",
            sim2.config.container(2),
            "ssh-keygen",
            "-lf",
            "/etc/ssh/ssh_host_ed25519_key.pub",
        ).stdout.split()[1],
    ]
    fingerprints = tmp_path / "fingerprints"
    fingerprints.write_text(f"node1 {console[0]}\n{sim2.config.mgmt_ip(2)} {console[0]}\n")
    done = subprocess.run(
        [
            str(VENV_BIN / "cluster"),
            "bootstrap",
            "-i",
            str(path),
            "--fingerprints",
            str(fingerprints),
        ],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.strip().splitlines() == [
        f"Error: host 'node2' ({sim2.config.mgmt_ip(2)}): its host key is {console[1]}, not "
        f"{console[0]} as the fingerprints file says: refused (not the node, or it was "
        "reinstalled)"
    ]
    assert f"node1: host key {console[0]} matches the fingerprints file" in done.stdout
    assert (
        "\n  node1        host key added to known_hosts; key login and passwordless sudo proven\n"
        in (done.stdout)
    )
    entries = [line.split()[:2] for line in known.read_text().splitlines()]
    assert entries == [[sim2.config.mgmt_ip(1), "ssh-ed25519"]]


@pytest.mark.parametrize(
    "script",
    [
        bootstrap.sudoers_script("trainer"),
        bootstrap.authorized_key_script("ssh-ed25519 AAAAC3Nza"),
        bootstrap.password_off_script(),
    ],
)
def test_the_node_scripts_are_plain_posix_sh(script):
    """Nodes run them with sh (dash on Debian and Ubuntu), including the branches the
    simulated nodes never take (systemd's reload)."""
    parsed = subprocess.run(["sh", "-n"], input=script, capture_output=True, text=True)
    assert (parsed.returncode, parsed.stderr) == (0, "")
