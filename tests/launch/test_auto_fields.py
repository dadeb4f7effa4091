"""Issue 50: a job on nodes whose inventory entries say `compute_interface: auto` and
`gpus: auto`. The launcher finds the values on the nodes once (cluster.autodetect), before the
job's processes are counted or its environment written, and says what it found; a node whose
value is not found stops the job before anything starts (exit 1), a spare's is left out. With
the fake of the node-execution layer (no network)."""

from __future__ import annotations

import pytest

from tests.fakes import FakeNodes, autodetect_answer, is_autodetect_probe
from tests.helpers import inventory_text, node
from torch_multinode.cluster.errors import UserError
from torch_multinode.launch import cli, options
from torch_multinode.launch.environment import interface_env
from torch_multinode.launch.nodes import nproc_for


def on_nodes(tmp_path, monkeypatch, *extra, gpus=None, interfaces=None, down=()):
    """launch.cli's _on_nodes for three nodes that say auto, the nodes answered by FakeNodes:
    `gpus` and `interfaces` per node name (default: no nvidia-smi, eth1 holds compute_ip)."""
    hosts = {f"n{i}": node(i, compute_interface="auto", gpus="auto") for i in (1, 2, 3)}
    path = tmp_path / "inv.yml"
    path.write_text(inventory_text(hosts, launch_mode="host"))
    script = tmp_path / "job.py"
    script.write_text("print('hi')\n")

    def respond(host, command):
        assert is_autodetect_probe(command), command
        return autodetect_answer(
            host, command, (interfaces or {}).get(host.name), (gpus or {}).get(host.name)
        )

    fake = FakeNodes(responder=respond, down=set(down))
    monkeypatch.setattr(cli, "SshNodes", lambda inventory: fake)
    args = options.parser().parse_args(["-i", str(path), "--script", str(script), *extra])
    args.argv = []
    spec = cli._spec(args)
    return fake, spec, cli._on_nodes(args, spec)


def test_the_values_are_found_once_before_the_processes_are_counted(tmp_path, monkeypatch, capsys):
    fake, spec, (inventory, _, _, _) = on_nodes(
        tmp_path,
        monkeypatch,
        "--nnodes",
        "2",
        gpus={"n1": 2, "n2": 2},
        interfaces={"n2": {"lo": ["127.0.0.1"], "ens5f0": ["10.7.0.2"]}},
    )
    assert [(h.compute_interface, h.gpus) for h in inventory.hosts] == [("eth1", 2), ("ens5f0", 2)]
    assert [name for name, _ in fake.commands] == ["n1", "n2"]  # the job's nodes, once each
    assert fake.closed
    assert [nproc_for(h, spec) for h in inventory.hosts] == [2, 2]  # one process per GPU found
    assert interface_env(inventory)["n2"] == {
        "GLOO_SOCKET_IFNAME": "ens5f0",
        "NCCL_SOCKET_IFNAME": "=ens5f0",
    }
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == [
        "[launcher] found on the node (auto in the inventory): n1: compute_interface eth1 "
        "(holds 10.7.0.1), gpus 2 (nvidia-smi)",
        "[launcher] found on the node (auto in the inventory): n2: compute_interface ens5f0 "
        "(holds 10.7.0.2), gpus 2 (nvidia-smi)",
    ]
    assert out[2].startswith("[launcher] job ")


def test_a_job_node_whose_value_is_not_found_stops_the_job_before_anything_starts(
    tmp_path, monkeypatch
):
    with pytest.raises(UserError) as raised:
        on_nodes(
            tmp_path,
            monkeypatch,
            interfaces={"n3": {"lo": ["127.0.0.1"], "eth0": ["10.1.0.3"]}},
        )
    assert raised.value.exit_code == 1
    assert raised.value.line() == (
        "Error: host 'n3': compute_interface is auto, but no interface there holds its "
        "compute_ip 10.7.0.3 (it has eth0 10.1.0.3) (try assigning 10.7.0.3 to the compute NIC, "
        "or compute_interface: NAME)"
    )


def test_a_spare_whose_values_are_not_found_is_left_out(tmp_path, monkeypatch, capsys):
    _, _, (inventory, _, _, spares) = on_nodes(
        tmp_path, monkeypatch, "--nnodes", "1", "--restarts", "1", down={"n3"}
    )
    assert [h.name for h in inventory.hosts] == ["n1"]
    assert [(h.name, h.compute_interface, h.gpus) for h in spares] == [("n2", "eth1", 0)]
    assert (
        "[launcher] spare n3 left out: host 'n3': cannot SSH to 10.1.0.3:22: timed out"
        in capsys.readouterr().out.splitlines()
    )


def test_an_inventory_without_auto_asks_no_node(tmp_path, monkeypatch):
    path = tmp_path / "inv.yml"
    path.write_text(inventory_text({"n1": node(1)}, launch_mode="host"))
    script = tmp_path / "job.py"
    script.write_text("print('hi')\n")
    monkeypatch.setattr(cli, "SshNodes", lambda inventory: pytest.fail("a node was asked"))
    args = options.parser().parse_args(["-i", str(path), "--script", str(script)])
    args.argv = []
    inventory, _, _, _ = cli._on_nodes(args, cli._spec(args))
    assert inventory.hosts[0].compute_interface == "eth1"
