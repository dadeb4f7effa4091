"""Issue 50: `compute_interface: auto` and `gpus: auto`, found on the node by the one owner of
that (cluster.autodetect), with the project's fake of the node-execution layer: what each
node is asked, once; what its answer gives; a value not found, said in one line per node; and
`cluster check` saying "found at provision" without asking any node."""

from __future__ import annotations

import pytest

from tests.conftest import run_cli
from tests.fakes import FakeNodes, autodetect_answer, is_autodetect_probe
from tests.helpers import inventory, inventory_text, node
from torch_multinode.cluster import autodetect
from torch_multinode.cluster import cli as cluster_cli
from torch_multinode.cluster.errors import UserError
from torch_multinode.cluster.remote import Result


def auto_inventory(**fields):
    """Three nodes: n1 and n2 leave both values to the node, n3 gives them."""
    hosts = {
        "n1": node(1, compute_interface="auto", gpus="auto", **fields),
        "n2": node(2, compute_interface="auto", gpus="auto", **fields),
        "n3": node(3, compute_interface="eth1", gpus=1),
    }
    return inventory(hosts)


def answering(interfaces=None, gpus=None):
    """FakeNodes answering the probe: `interfaces` and `gpus` per node name."""

    def respond(host, command):
        assert is_autodetect_probe(command), command
        return autodetect_answer(
            host, command, (interfaces or {}).get(host.name), (gpus or {}).get(host.name)
        )

    return FakeNodes(responder=respond)


def test_auto_values_are_none_until_found_and_named_in_the_host():
    loaded = auto_inventory()
    n1, n2, n3 = loaded.hosts
    assert (n1.compute_interface, n1.gpus, n1.auto) == (None, None, {"compute_interface", "gpus"})
    assert (n3.compute_interface, n3.gpus, n3.auto) == ("eth1", 1, frozenset())
    assert loaded.unresolved == (n1, n2)


def test_each_node_that_says_auto_is_asked_once_and_its_values_replace_none():
    loaded = auto_inventory()
    nodes = answering(
        interfaces={"n2": {"lo": ["127.0.0.1"], "ens5": ["10.1.0.2"], "eth9@if12": ["10.7.0.2"]}},
        gpus={"n1": 8},
    )
    resolved = autodetect.resolve(loaded, nodes)
    n1, n2, n3 = resolved.inventory.hosts
    assert (n1.compute_interface, n1.gpus) == ("eth1", 8)
    assert (n2.compute_interface, n2.gpus) == ("eth9", 0)  # no nvidia-smi: 0
    assert n3 == loaded.hosts[2]
    assert n1.auto == {"compute_interface", "gpus"}  # still named, for the outputs
    assert [name for name, _ in nodes.commands] == ["n1", "n2"]  # n3 gives its own
    assert resolved.lines() == [
        "found on the node (auto in the inventory): n1: compute_interface eth1 (holds "
        "10.7.0.1), gpus 8 (nvidia-smi)",
        "found on the node (auto in the inventory): n2: compute_interface eth9 (holds "
        "10.7.0.2), gpus 0 (no nvidia-smi)",
    ]
    assert resolved.inventory.unresolved == ()


def test_the_probe_asks_only_what_the_host_leaves_to_the_node():
    only_gpus = inventory({"n1": node(1, gpus="auto")}).hosts[0]
    command = autodetect.probe_command(only_gpus)
    assert "nvidia-smi --query-gpu=index --format=csv,noheader" in command
    assert "ip -o -4 addr show" not in command
    only_interface = inventory({"n1": node(1, compute_interface="auto")}).hosts[0]
    command = autodetect.probe_command(only_interface)
    assert "ip -o -4 addr show" in command and "nvidia-smi" not in command
    assert autodetect.wanted(inventory({"n1": node(1)}).hosts[0]) == ()


def test_a_secondary_address_is_found_and_loopback_is_never_the_compute_interface():
    host = auto_inventory().hosts[0]
    text = autodetect_answer(
        host,
        autodetect.probe_command(host),
        {"lo": ["127.0.0.1", "10.7.0.1"], "bond0": ["10.1.0.1", "10.7.0.1"]},
        2,
    )
    found = autodetect.parse(host, text)
    assert (found.interface, found.gpus, found.error) == ("bond0", 2, None)


def test_values_not_found_are_one_line_per_node_exit_1():
    loaded = auto_inventory()
    nodes = answering(
        interfaces={"n1": {"lo": ["127.0.0.1"], "eth0": ["10.1.0.1"]}},
        gpus={
            "n2": "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."
        },
    )
    with pytest.raises(UserError) as raised:
        autodetect.resolve(loaded, nodes)
    assert raised.value.exit_code == 1
    assert raised.value.lines() == [
        "Error: host 'n1': compute_interface is auto, but no interface there holds its "
        "compute_ip 10.7.0.1 (it has eth0 10.1.0.1) (try assigning 10.7.0.1 to the compute "
        "NIC, or compute_interface: NAME)",
        "Error: host 'n2': gpus is auto, but nvidia-smi fails there: NVIDIA-SMI has failed "
        "because it couldn't communicate with the NVIDIA driver. (try nvidia-smi working on "
        "the node (its driver), or gpus: N)",
    ]


def test_a_node_that_does_not_answer_is_said_and_a_spare_left_out():
    loaded = auto_inventory()
    job = loaded.first(1)
    spares = loaded.hosts[1:]
    nodes = answering()
    nodes.down = {"n2"}
    resolved = autodetect.resolve(job, nodes, spares)
    assert [h.name for h in resolved.spares] == ["n3"]  # n2 left out, n3 gives its own
    assert resolved.lines()[-1] == (
        "spare n2 left out: host 'n2': cannot SSH to 10.1.0.2:22: timed out"
    )
    nodes.down = {"n1"}
    with pytest.raises(UserError) as raised:
        autodetect.resolve(job, nodes, spares)
    assert raised.value.line() == "Error: host 'n1': cannot SSH to 10.1.0.1:22: timed out"
    assert raised.value.exit_code == 1


def test_ip_failing_is_said_with_its_own_words():
    host = inventory({"n1": node(1, compute_interface="auto")}).hosts[0]
    nodes = FakeNodes(
        responder=lambda h, c: Result(
            h.name,
            c,
            0,
            f"{autodetect.MARK}\n{autodetect.MARK} addresses\n"
            f"sh: 1: ip: not found\n{autodetect.MARK} ip 127\n",
            "",
        )
    )
    found = autodetect.find(nodes, [host])["n1"]
    assert str(found.error) == (
        "host 'n1': cannot list its addresses (ip -o -4 addr show: sh: 1: ip: not found)"
    )
    assert found.remedy == "install iproute2"


def test_the_cluster_commands_that_reach_the_nodes_find_the_values_once(capsys):
    """cluster hostfile, image and lock share one helper: nothing asked where nothing is auto;
    otherwise each node once, and what was found said on standard error."""
    plain = inventory({"n1": node(1, gpus=2)})
    nodes = answering(gpus={"n1": 4})
    assert cluster_cli._found_on_nodes(plain, nodes) is plain and nodes.commands == []
    loaded = auto_inventory()
    resolved = cluster_cli._found_on_nodes(loaded, nodes)
    assert [cluster_cli.slots(h) for h in resolved.hosts] == [4, 1, 1]  # hostfile's slots
    assert len(nodes.commands) == 2
    assert capsys.readouterr().err.splitlines() == [
        "found on the node (auto in the inventory): n1: compute_interface eth1 (holds "
        "10.7.0.1), gpus 4 (nvidia-smi)",
        "found on the node (auto in the inventory): n2: compute_interface eth1 (holds "
        "10.7.0.2), gpus 0 (no nvidia-smi)",
    ]


def test_check_inventory_says_auto_values_are_found_at_provision_and_asks_no_node(tmp_path):
    hosts = {
        "n1": node(1, ansible_host="10.7.0.1", compute_interface="auto", gpus="auto"),
        "n2": node(2, gpus="auto"),
    }
    del hosts["n1"]["compute_ip"]  # its ansible_host, in compute_subnet
    path = tmp_path / "inventory.yml"
    path.write_text(inventory_text(hosts))
    done = run_cli("cluster", "check", "-i", str(path))
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.splitlines()[1:] == [
        "  node_rank 0  n1               ssh 10.7.0.1         compute 10.7.0.1 (auto, found at "
        "provision)  gpus auto (found at provision)  master",
        "  node_rank 1  n2               ssh 10.1.0.2         compute 10.7.0.2 (eth1)  gpus auto "
        "(found at provision)  worker",
        "compute_ip of n1: the host's ansible_host (no compute_ip given, and that address is in "
        "compute_subnet 10.7.0.0/24)",
        "compute_interface of n1: auto, the interface that holds compute_ip, found at provision "
        "on the node (and by netcheck and each job)",
        "gpus of n1, n2: auto, nvidia-smi's count, found at provision on the node (and by "
        "netcheck and each job)",
    ]
