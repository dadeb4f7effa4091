"""Issue 50: netcheck on an inventory whose hosts say `compute_interface: auto` and `gpus: auto`.
Its first stage (ssh) finds the values on each node in the same round trip
(cluster.autodetect), every later stage uses them, and the report says what was found; a node
where no interface holds its compute_ip is a FAIL naming both, and the stages that need every
node say why they did not run. Against the fake cluster (no network)."""

from __future__ import annotations

import json

from tests import helpers
from tests.helpers import node
from tests.netcheck.netcheck_fakes import FakeCluster
from torch_multinode.cluster.inventory_read import parse
from torch_multinode.netcheck import attempts, cli, preflight
from torch_multinode.netcheck.report import Status, render


def auto_text(**extra):
    """Three nodes as netcheck_fakes' (SSH on 10.8.0.1N, compute on 10.9.0.1N), node1 and
    node2 leaving their compute interface and GPUs to the node."""
    hosts = {
        f"node{n}": node(
            n,
            ansible_host=f"10.8.0.1{n}",
            compute_ip=f"10.9.0.1{n}",
            **({"compute_interface": "auto", "gpus": "auto"} if n < 3 else {}),
        )
        for n in (1, 2, 3)
    }
    return helpers.inventory_text(
        hosts,
        compute_subnet="10.9.0.0/24",
        rendezvous_port=29500,
        launch_mode="host",
        training_python="/opt/venv/bin/python",
        **extra,
    )


def auto_inventory():
    return parse(auto_text(), "/nonexistent/inventory.yml")


def run(cluster, inventory=None):
    inventory = inventory or auto_inventory()
    report = preflight.preflight(inventory, attempts.Options(), cluster)
    assert cluster.surprises == []
    return report


def test_auto_values_are_found_in_the_ssh_stage_and_used_by_every_later_one():
    inventory = auto_inventory()
    cluster = FakeCluster(list(inventory.hosts))
    report = run(cluster, inventory)
    assert report.ok, render(report)
    # One round trip each: the ssh stage's command is the probe, on the nodes that say auto.
    assert [(n, k) for n, k in cluster.calls if k in ("true", "autodetect")] == [
        ("node1", "autodetect"),
        ("node2", "autodetect"),
        ("node3", "true"),
    ]
    # The interface found (eth1, where the fake nodes hold their compute_ip) is what the
    # launcher is told to use; no nvidia-smi: 0 GPUs, which the software check agrees with.
    assert report.env["node1"]["NCCL_SOCKET_IFNAME"] == "=eth1"
    assert report.env["node2"]["GLOO_SOCKET_IFNAME"] == "eth1"
    assert report.found == {
        "node1": {"compute_interface": "eth1", "gpus": 0, "gpus_from": "no nvidia-smi"},
        "node2": {"compute_interface": "eth1", "gpus": 0, "gpus_from": "no nvidia-smi"},
    }
    text = render(report).splitlines()
    assert text[2:4] == [
        "found on node1 (auto in the inventory): compute_interface eth1, gpus 0 (no nvidia-smi)",
        "found on node2 (auto in the inventory): compute_interface eth1, gpus 0 (no nvidia-smi)",
    ]
    assert report.as_dict()["found"] == report.found


def test_gpus_found_by_nvidia_smi_are_what_the_software_check_compares():
    inventory = auto_inventory()
    cluster = FakeCluster(list(inventory.hosts), nvidia_smi={"node1": 2})
    report = run(cluster, inventory)
    assert report.found["node1"]["gpus"] == 2
    # The fake's torch sees no GPU: the node is held to the 2 nvidia-smi found.
    assert report.cell("node1", "software") is Status.FAIL
    details = [f.detail for f in report.for_node("node1", "software")]
    assert "torch sees 0 GPU(s) on node1, the inventory says 2" in details, details


def test_a_node_where_no_interface_holds_compute_ip_fails_and_blocks_what_needs_every_node():
    inventory = auto_inventory()
    cluster = FakeCluster(
        list(inventory.hosts),
        addresses={"node2": {"lo": ["127.0.0.1"], "eth0": ["10.8.0.12"], "eth1": ["10.9.0.99"]}},
    )
    report = run(cluster, inventory)
    assert report.exit_code == 1
    (found,) = report.for_node("node2", "interfaces")
    assert found.status is Status.FAIL
    assert found.detail == (
        "compute_interface is auto, but no interface there holds its compute_ip 10.9.0.12 (it "
        "has eth0 10.8.0.12; eth1 10.9.0.99)"
    )
    assert found.remedy == (
        "on node2: assign 10.9.0.12 to the compute NIC (make provision does it), or set "
        "compute_interface: NAME in the inventory"
    )
    assert report.found["node2"]["compute_interface"] is None
    # Nothing else was run on it; the others' checks that need every node say why not.
    assert [k for n, k in cluster.calls if n == "node2"] == ["autodetect"]
    assert report.for_node("node1", "collective")[0].detail == (
        "needs every node; node2: auto values not found"
    )
    assert report.cell("node2", "software") is Status.SKIP
    assert report.for_node("node2", "software")[0].detail == (
        "not checked: an auto value of node2 was not found (see interfaces)"
    )
    assert "found on node2 (auto in the inventory): compute_interface not found, gpus 0" in (
        render(report)
    )


def test_nvidia_smi_failing_is_a_software_fail():
    inventory = auto_inventory()
    cluster = FakeCluster(
        list(inventory.hosts), nvidia_smi={"node1": "NVIDIA-SMI has failed: driver not loaded"}
    )
    report = run(cluster, inventory)
    (software,) = report.for_node("node1", "software")
    assert software.status is Status.FAIL
    assert (
        software.detail
        == "gpus is auto, but nvidia-smi fails there: NVIDIA-SMI has failed: driver not loaded"
    )
    assert software.remedy == (
        "on node1: make nvidia-smi work (the NVIDIA driver), or set gpus: N in the inventory"
    )
    assert report.cell("node1", "interfaces") is Status.SKIP  # left out like a silent node


def test_the_cli_writes_the_interface_found_for_the_launcher(tmp_path, monkeypatch, capsys):
    path = tmp_path / "inventory.yml"
    path.write_text(auto_text())
    cluster = FakeCluster(list(parse(auto_text(), path).hosts))
    monkeypatch.setattr(cli, "SshNodes", lambda inventory: cluster)
    assert cli.main(["-i", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["found"]["node1"] == {
        "compute_interface": "eth1",
        "gpus": 0,
        "gpus_from": "no nvidia-smi",
    }
    written = json.loads((tmp_path / "netcheck-env.json").read_text())["nodes"]
    assert written["node1"]["NCCL_SOCKET_IFNAME"] == "=eth1"
    assert cluster.surprises == []
