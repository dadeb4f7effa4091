"""The simulated cluster: real SSH with checked host keys, plain unprovisioned hosts, clean teardown."""

from __future__ import annotations

import ast
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import run_cli
from torch_multinode.cluster import engine
from torch_multinode.cluster.errors import UserError
from torch_multinode.cluster.inventory_read import load
from torch_multinode.cluster.remote import Remote, on_all
from torch_multinode.sim import nodes as sim

SIM_CLI = ("python", "-m", "torch_multinode.sim.cli")  # as make sim-up runs it
ROOT = Path(__file__).resolve().parents[2]


def test_production_rooms_never_import_the_simulator():
    """sim/ is test and benchmark infrastructure: only tests and bench/ may import it."""
    found = []
    for room in ("cluster", "provision", "launch", "netcheck", "training"):
        for path in sorted((ROOT / room).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
                else:
                    continue
                if any(name.split(".")[:2] == ["torch_multinode", "sim"] for name in names):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == []


def _docker_ids(kind: str, name: str) -> list[str]:
    args = ["ps", "-aq"] if kind == "container" else ["ls", "-q"]
    proc = subprocess.run(
        [
            "docker",
            *([kind] if kind != "container" else []),
            *args,
            "--filter",
            f"label={sim.LABEL}={name}",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return proc.stdout.split()


def _ssh(inventory, host, command: str) -> subprocess.CompletedProcess:
    """The OpenSSH client, in batch mode, with host-key checking on."""
    return subprocess.run(
        [
            "ssh",
            "-o",
            "BatchMode=yes",
            "-o",
            "StrictHostKeyChecking=yes",
            "-o",
            f"UserKnownHostsFile={inventory.known_hosts}",
            "-o",
            "ConnectTimeout=5",
            "-i",
            str(host.ssh_key),
            f"{host.ssh_user}@{host.ssh_address}",
            command,
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


@pytest.mark.sim
def test_two_nodes_answer_over_ssh_with_the_generated_inventory(sim2):
    inventory = load(sim2.config.inventory_path)
    assert [h.name for h in inventory.hosts] == ["node1", "node2"]
    for index, host in enumerate(inventory.hosts, start=1):
        proc = _ssh(inventory, host, "ip -o -4 addr show dev eth1")
        assert proc.returncode == 0, proc.stderr
        assert f"inet {sim2.config.node_ip(index)}/24" in proc.stdout

    def probe(host):
        with Remote.for_inventory(inventory, host) as remote:
            return remote.run(f"{host.python} -c 'import torch; print(torch.__version__)'").stdout

    versions = on_all(inventory.hosts, probe)
    assert set(versions) == {"node1", "node2"}
    assert all(v.startswith("2.14.1") for v in versions.values())


@pytest.mark.sim
def test_nodes_are_plain_hosts_that_provisioning_has_not_touched(sim2):
    inventory = load(sim2.config.inventory_path)
    node1, node2 = inventory.hosts
    with Remote.for_inventory(inventory, node1) as remote:
        assert remote.run("hostname").stdout.strip() == "debian-1"
        hosts_file = remote.run("cat /etc/hosts").stdout
        assert str(node2.compute_ip) not in hosts_file and "node2" not in hosts_file
        assert remote.run("command -v ufw").exit_code == 1
        assert remote.run("test -e /root/.ssh/id_ed25519").exit_code == 1
        # What the nodes can do: shape their link, reach a peer on the compute network.
        assert remote.run("tc qdisc show dev eth1", check=True).ok
        ping = remote.run(f"ping -c 1 -W 2 {node2.compute_ip}")
        assert ping.exit_code == 0, ping.stdout
        # Every node has host keys of its own.
    keys = on_all(
        inventory.hosts,
        lambda h: (
            Remote.for_inventory(inventory, h).run("cat /etc/ssh/ssh_host_ed25519_key.pub").stdout
        ),
    )
    assert keys["node1"] != keys["node2"]


@pytest.mark.sim
def test_standard_input_reaches_a_node_command_whole(sim2):
    """What must not go on a command line (a file list, a secret) goes on standard input."""
    data = "".join(f"line {index}\n" for index in range(20000))  # about 200 KB
    with Remote.for_inventory(sim2.inventory, sim2.inventory.hosts[1]) as remote:
        # invoke's own stdin handling sent one character per 10 ms: 200 KB would take half an
        # hour and end in this command's timeout
        result = remote.run("sha256sum; echo done >&2; exit 3", stdin=data, timeout=60)
    import hashlib

    assert result.stdout.split()[0] == hashlib.sha256(data.encode()).hexdigest()
    assert (result.exit_code, result.stderr) == (3, "done\n")


@pytest.mark.sim
def test_unknown_host_key_is_refused(sim2, tmp_path):
    inventory = load(sim2.config.inventory_path)
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    remote = Remote(inventory.hosts[0], known_hosts=empty)
    with pytest.raises(UserError) as caught:
        remote.run("true")
    assert str(caught.value) == (
        f"host 'node1': the SSH host key of {inventory.hosts[0].ssh_address} is not in {empty}"
    )
    assert _ssh(inventory, inventory.hosts[0], "true").returncode == 0  # the right file works


@pytest.mark.sim
def test_second_up_reuses_the_nodes(sim2):
    again = sim.up(2, None, sim2.config)
    assert again.reused
    assert again.nodes == ["node1", "node2"]


@pytest.mark.sim
def test_link_shaping_applies_and_lifts(sim2):
    container = sim2.config.container(1)
    sim.up(2, "1gbit", sim2.config)
    shown = sim.docker("exec", container, "tc", "qdisc", "show", "dev", "eth1").stdout
    assert "tbf" in shown and "rate 1Gbit" in shown
    sim.up(2, None, sim2.config)
    shown = sim.docker("exec", container, "tc", "qdisc", "show", "dev", "eth1").stdout
    assert "tbf" not in shown


@pytest.mark.sim
def test_three_nodes_up_and_down_leave_nothing_behind(sim_factory, tmp_path):
    config = sim_factory.config()
    common = [
        "--name",
        config.name,
        "--subnet",
        config.subnet,
        "--mgmt-subnet",
        config.mgmt_subnet,
        "--state-dir",
        str(tmp_path),
    ]
    proc = run_cli(*SIM_CLI, "up", "--nodes", "3", *common)
    try:
        assert proc.returncode == 0, proc.stderr
        assert f"Simulated cluster '{config.name}': 3 node(s) up over SSH" in proc.stdout
        assert f"Inventory: {tmp_path / 'inventory.yml'}" in proc.stdout
        assert len(_docker_ids("container", config.name)) == 3
        assert len(_docker_ids("network", config.name)) == 2
        assert len(_docker_ids("volume", config.name)) == 4  # one each, and /shared
        inventory = load(tmp_path / "inventory.yml")
        assert [h.name for h in inventory.hosts] == ["node1", "node2", "node3"]

        refused = run_cli(*SIM_CLI, "up", "--nodes", "2", *common)
        assert refused.returncode == 2
        assert refused.stderr == (
            f"Error: simulated cluster '{config.name}' already has 3 node(s) "
            "(try 'make sim-down' first, or NNODES=3)\n"
        )
    finally:
        down = run_cli(*SIM_CLI, "down", *common)
    assert down.returncode == 0, down.stderr
    assert down.stdout == (
        f"Simulated cluster '{config.name}' removed: 3 container(s), 2 network(s), 4 volume(s).\n"
    )
    for kind in ("container", "network", "volume"):
        assert _docker_ids(kind, config.name) == []
    assert not (tmp_path / "inventory.yml").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--nodes", "5"], "Error: the simulated cluster takes 1 to 4 nodes, not 5 (try NNODES=2)"),
        (["--nodes", "0"], "Error: the simulated cluster takes 1 to 4 nodes, not 0 (try NNODES=2)"),
        (["--link", "fast"], "Error: LINK='fast' is not a rate tc understands (try LINK=1gbit)"),
        (
            ["--subnet", "10.0.0.0/30"],
            "Error: simulator subnet 10.0.0.0/30 is too small (try a /24)",
        ),
    ],
)
def test_bad_sim_arguments_are_one_line_errors(tmp_path, args, message):
    proc = run_cli(*SIM_CLI, "up", "--name", "neverstarted", "--state-dir", str(tmp_path), *args)
    assert (proc.returncode, proc.stdout, proc.stderr) == (2, "", message + "\n")


def test_mirror_comes_from_the_machines_apt_sources(tmp_path):
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\nURIs: http://mirror.invalid/debian\nSuites: bookworm bookworm-updates\n"
        "Components: main\n\nTypes: deb\nURIs: http://mirror.invalid/debian-security\n"
        "Suites: bookworm-security\n"
    )
    assert engine.debian_mirror(tmp_path) == ("http://mirror.invalid/debian", "bookworm")
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / "sources.list").write_text(
        "deb [arch=amd64] http://old.invalid/debian bullseye main\n"
    )
    assert engine.debian_mirror(legacy) == ("http://old.invalid/debian", "bullseye")
    with pytest.raises(UserError, match="no Debian mirror found"):
        engine.debian_mirror(tmp_path / "nothing")


def test_inventory_written_for_the_sim_is_valid(tmp_path):
    config = sim.SimConfig("unit", "172.29.250.0/24", tmp_path, "172.30.250.0/24")
    inventory = load(sim.write_inventory(config, 3))
    assert [str(h.compute_ip) for h in inventory.hosts] == [
        "172.29.250.11",
        "172.29.250.12",
        "172.29.250.13",
    ]
    assert [h.ssh_address for h in inventory.hosts][0] == "172.30.250.11"
    assert inventory.known_hosts == (tmp_path / "known_hosts").resolve()
    assert [h.compute_interface for h in inventory.hosts] == ["eth1"] * 3


def test_each_named_cluster_keeps_its_files_apart():
    assert sim.default_state_dir(sim.DEFAULT_NAME) == sim.REPO_ROOT / ".sim"
    assert sim.default_state_dir("lab") == sim.REPO_ROOT / ".sim" / "lab"


def test_a_node_that_never_answers_over_ssh_is_named_with_what_its_container_says(monkeypatch):
    class Unreachable:
        host = type("Host", (), {"name": "node1"})()

        def run(self, command, timeout=None, check=False):
            raise UserError("host 'node1': cannot SSH to root@172.30.80.11:22: reset by peer")

        def close(self):
            pass

    def fake_docker(*args, check=True, timeout=None):
        out = {"inspect": "running\n", "logs": "Server listening on 0.0.0.0 port 22.\n"}[args[0]]
        return subprocess.CompletedProcess(["docker", *args], 0, out, "")

    monkeypatch.setattr(sim, "docker", fake_docker)
    with pytest.raises(UserError) as failure:
        sim._wait_for_ssh(Unreachable(), "tmn-node1", deadline=time.monotonic() - 1)
    assert str(failure.value) == (
        "node node1 did not answer over SSH in time: host 'node1': cannot SSH to "
        "root@172.30.80.11:22: reset by peer; container tmn-node1 is running, its last log "
        "lines: Server listening on 0.0.0.0 port 22."
    )
