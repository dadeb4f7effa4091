"""The CLI's edges and the whole pre-flight run against a fake cluster (no network)."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys

import pytest

from tests.netcheck.netcheck_fakes import INVENTORY, FakeCluster, inventory, run_netcheck
from torch_multinode.cluster.containers import rdma_options
from torch_multinode.cluster.execution import ContainerContext, HostContext, context_for
from torch_multinode.netcheck import attempts, cli, preflight
from torch_multinode.netcheck.report import CHECKS, Status


def run(fake, **options):
    options.setdefault("nnodes", len(fake.hosts))
    report = preflight.preflight(fake_inventory(), attempts.Options(**options), fake)
    assert fake.surprises == []
    return report


def fake_inventory():
    return inventory()


def fake(n=2, **faults):
    return FakeCluster(list(fake_inventory().hosts[:n]), **faults)


def cells(report):
    return {node: {c: report.cell(node, c) for c in report.checks} for node in report.nodes}


# --- the command line -----------------------------------------------------------------------


def test_no_inventory_is_one_error_line():
    proc = run_netcheck()
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "Error: no inventory given (try INVENTORY=path/to/inventory.yml (see "
        "inventory.example.yml), or 'make sim-up' and INVENTORY=.sim/inventory.yml for the "
        "simulated cluster)"
    ]


def test_missing_inventory_and_bad_nnodes(tmp_path, capsys):
    assert cli.main(["-i", str(tmp_path / "none.yml")]) == 2
    assert capsys.readouterr().err == (
        f"Error: inventory {tmp_path / 'none.yml'} does not exist "
        "(try a path to an existing file)\n"
    )
    path = tmp_path / "inventory.yml"
    path.write_text(INVENTORY)
    assert cli.main(["-i", str(path), "--nnodes", "5"]) == 2
    assert capsys.readouterr().err == (
        f"Error: NNODES=5 but inventory {path} lists 3 host(s) "
        "(try NNODES=3 or add hosts to the inventory)\n"
    )


def test_help_names_every_option():
    proc = subprocess.run(
        [sys.executable, "-m", "torch_multinode.netcheck.cli", "--help"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0
    for option in (
        "--inventory",
        "--nnodes",
        "--json",
        "--sweep",
        "--no-sweep",
        "--bandwidth",
        "--pairwise",
        "--env-file",
        "--timeout",
        "exit status: 0 when nothing FAILs",
    ):
        assert option in proc.stdout, option


def test_bad_timeout_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["-i", "x.yml", "--timeout", "0"])
    assert exit_info.value.code == 2
    assert "'0' must be above 0" in capsys.readouterr().err


def test_cli_writes_env_file_and_json(tmp_path, monkeypatch, capsys):
    path = tmp_path / "inventory.yml"
    path.write_text(INVENTORY)
    cluster = fake(3)
    monkeypatch.setattr(cli, "SshNodes", lambda inventory: cluster)
    assert cli.main(["-i", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] is True and data["env_file"] == str(tmp_path / "netcheck-env.json")
    written = json.loads((tmp_path / "netcheck-env.json").read_text())
    assert written["nodes"]["node3"] == {
        "NCCL_SOCKET_IFNAME": "=eth1",
        "GLOO_SOCKET_IFNAME": "eth1",
        "NCCL_IB_DISABLE": "1",
    }
    other = tmp_path / "elsewhere" / "env.json"
    assert cli.main(["-i", str(path), "-n", "2", "--env-file", str(other)]) == 0
    assert "ready: 0 FAIL, 0 WARN, 0 SKIP" in capsys.readouterr().out
    assert set(json.loads(other.read_text())["nodes"]) == {"node1", "node2"}
    # Each node's versions locked beside the inventory, by every passing run (cluster.version_lock).
    assert data["lock_file"] == str(tmp_path / "versions.lock.json")
    locked = json.loads((tmp_path / "versions.lock.json").read_text())["nodes"]
    assert set(locked) == {"node1", "node2", "node3"}  # -n 2 replaced two, kept the third
    assert locked["node3"] == {
        "kernel": "6.1.0-fake",
        "driver": "none",
        "docker": "27.3.1",
        "torch": "2.14.1+cpu",
        "nccl": "none",
    }
    assert cluster.surprises == []


# --- the whole run, on a fake cluster -------------------------------------------------------


def test_healthy_cluster_passes_everything_and_cleans_up():
    cluster = fake(3)
    report = run(cluster)
    assert report.ok and report.checks == list(CHECKS)
    assert all(s is Status.PASS for row in cells(report).values() for s in row.values())
    assert report.backend == "gloo" and len(report.measurements) == 6
    kinds = [k for _, k in cluster.calls]
    # Every listener and worker started is stopped again.
    assert kinds.count("serve") == 3 and kinds.count("stop") == 6
    assert kinds.count("collective") == 3 and kinds.count("freeport") == 1
    # The workers reported the software facts: torch is imported once per node.
    assert kinds.count("software") == 0
    assert report.for_node("node2", "software")[0].detail.startswith("Python 3.11.2, torch 2.14.1")


def test_down_node_is_reported_never_raised():
    cluster = fake(3, down={"node3"})
    report = run(cluster)
    assert report.exit_code == 1
    assert report.cell("node3", "ssh") is Status.FAIL
    (ssh,) = report.for_node("node3", "ssh")
    assert ssh.remedy.startswith("on node3: check that the node is up")
    for check in ("names", "ports", "interfaces", "software"):
        assert report.cell("node3", check) is Status.SKIP
    assert report.cell("node3", "ping") is Status.FAIL  # its peers pinged it in vain
    assert report.cell("node1", "ping") is Status.PASS
    assert report.cell("node1", "collective") is Status.SKIP
    assert report.for_node("node1", "collective")[0].detail == (
        "needs every node; node3 does not answer over SSH"
    )
    # Nothing but SSH was attempted on the dead node.
    assert [k for n, k in cluster.calls if n == "node3"] == ["true"]


def test_firewall_fault_skips_the_collective():
    cluster = fake(2, firewalled={"node2"})
    report = run(cluster)
    # Without workers, the software probe runs on its own on every node.
    assert sorted(n for n, k in cluster.calls if k == "software") == ["node1", "node2"]
    assert report.cell("node2", "software") is Status.PASS
    assert report.cell("node2", "ports") is Status.FAIL
    assert report.cell("node1", "ports") is Status.PASS
    assert report.cell("node1", "collective") is Status.SKIP
    assert report.measurements == []


def test_loopback_name_and_held_port_and_version_skew():
    holders = [{"pid": 99, "name": "python3", "command": "python3 -m old.job"}]
    report = run(
        fake(
            2,
            loopback_name={"node2"},
            held_port={"node1": {"port": 29500, "holders": holders}},
            torch={"node2": "2.13.0"},
        )
    )
    assert report.cell("node2", "names") is Status.FAIL
    assert report.cell("node1", "ports") is Status.FAIL
    assert report.for_node("node1", "ports")[0].remedy.startswith("on node1: stop it (kill 99)")
    assert report.cell("node2", "software") is Status.FAIL
    assert report.cell("node1", "software") is Status.PASS  # a 1:1 tie goes to the master


def test_sweep_and_pairwise_measure_tcp_and_add_the_bandwidth_column():
    cluster = fake(3)
    report = run(cluster, sweep=True, pairwise=True)
    assert report.checks[-1] == "bandwidth"
    assert [(x.source, x.target) for x in report.ring] == [
        ("node1", "node2"),
        ("node2", "node3"),
        ("node3", "node1"),
    ]
    assert len(report.pairwise) == 6
    assert len(report.measurements) == 27  # 3 ops x 9 sizes
    # Fake links and collectives both move 1 GB/s; all_reduce busbw over 3 ranks is x 4/3.
    assert report.busbw_vs_tcp()["ratio"] == pytest.approx(4 / 3, rel=1e-3)
    assert all(report.cell(n, "bandwidth") is Status.PASS for n in report.nodes)


# --- where the training stack is checked ----------------------------------------------------


def test_container_context_starts_the_probe_like_the_launcher_starts_a_job():
    host = fake_inventory().hosts[0]
    gpu_host = host.__class__(**{**host.__dict__, "gpus": 2})
    context = ContainerContext("train:1")
    # NCCL's file is checked for first: Docker would make a missing one a directory. The node's
    # RDMA devices, where it has them, come last before the image, as the launcher's.
    assert context.wrap(host, "python3 -c 'print(1)'", "netcheck-abc") == (
        "test -f /etc/nccl.conf || { echo 'Error: /etc/nccl.conf is missing on this node (try "
        "make provision, whose nccl_config role writes it)' >&2; exit 125; } && "
        "docker run --rm --init --pull never --label torch-multinode.netcheck=netcheck-abc "
        "--network host --ipc host --ulimit memlock=-1:-1 --ulimit stack=67108864 "
        f"-v /etc/nccl.conf:/etc/nccl.conf:ro {rdma_options()} train:1 "
        "sh -c 'python3 -c '\"'\"'print(1)'\"'\"''"
    )
    assert f" --gpus all {rdma_options()} train:1 " in context.wrap(gpu_host, "true", "t")
    assert context.cleanup("netcheck-abc") == (
        "docker ps -q --filter label=torch-multinode.netcheck=netcheck-abc | xargs -r docker rm "
        "-f >/dev/null 2>&1; true"
    )
    assert isinstance(context_for(fake_inventory()), HostContext)
    chosen = context_for(inventory(launch_mode="container"))
    assert isinstance(chosen, ContainerContext) and chosen.image == "torch-multinode/train:latest"


def test_the_shipped_code_is_on_the_import_path_of_the_probe_and_the_workers():
    """The image holds no project code: netcheck's own, sent to the nodes, is mounted (read-only)
    and on PYTHONPATH in the container, and on PYTHONPATH on the host."""
    host = fake_inventory().hosts[0]
    # The code arrives in a torch_multinode/ directory; its parent goes on the import path.
    code = "/w/tmn-1/torch_multinode"
    wrapped = ContainerContext("train:1", code_dir=code).wrap(host, "true", "t")
    inside = shlex.split(wrapped.replace(rdma_options(), ""))
    image = inside.index("train:1")
    assert inside[image - 4 : image] == ["-v", f"{code}:{code}:ro", "-e", "PYTHONPATH=/w/tmn-1"]
    assert HostContext("/w/tmn 1/torch_multinode").wrap(host, "python3 x", "t") == (
        "export PYTHONPATH='/w/tmn 1'; python3 x"
    )
    assert HostContext().wrap(host, "python3 x", "t") == "python3 x"


def test_container_mode_runs_software_and_collective_in_the_image():
    cluster = fake(2)
    report = preflight.preflight(
        inventory(launch_mode="container"), attempts.Options(nnodes=2), cluster
    )
    assert cluster.surprises == []
    assert report.ok, report.findings
    assert report.stack == "the training image torch-multinode/train:latest"
    kinds = [k for n, k in cluster.calls if n == "node1"]
    # The worker in the image reports the software too; then its leftovers are ended (the pid
    # file and the container label, in one call).
    assert kinds[-3:] == ["docker run", "collective", "stop"]
    # The network checks stay on the host: only the training stack is in the container.
    assert kinds.count("docker run") == 1 and "software" not in kinds


def test_the_collective_runs_on_one_network_where_only_one_node_has_rdma():
    """node1 with an RDMA device, node2 without: the env file keeps each node's own finding,
    and the collective runs as a job on both would, NCCL on sockets on both (mixed, NCCL's
    set-up waits for ever)."""
    cluster = fake(2, infiniband={"node1": "mlx5_0"})
    report = run(cluster)
    assert cluster.surprises == []
    assert [report.env[name].get("NCCL_IB_DISABLE") for name in ("node1", "node2")] == [None, "1"]
    workers = [c for n, c in cluster.commands if "netcheck.collective" in c]
    assert len(workers) == 2 and all("NCCL_IB_DISABLE=1" in c for c in workers), workers
    assert report.cell("node1", "interfaces") is Status.WARN


def test_a_worker_that_cannot_start_gets_the_software_probe_alone():
    cluster = fake(2, broken_worker={"node2"})
    report = run(cluster)
    assert [n for n, k in cluster.calls if k == "software"] == ["node2"]
    (collective,) = report.for_node("node2", "collective")
    assert collective.detail == (
        "the worker failed: exit 1: /opt/venv/bin/python: No module named netcheck.collective"
    )
    assert report.cell("node2", "software") is Status.PASS
    assert report.for_node("node1", "collective")[0].detail.endswith(
        "(waiting for node2, which failed)"
    )


# --- on a Slurm inventory ---------------------------------------------------------------------


def _slurm_report(cluster, nnodes=3):
    from dataclasses import replace

    slurm_inventory = replace(fake_inventory(), scheduler="slurm")
    report = preflight.preflight(slurm_inventory, attempts.Options(nnodes=nnodes), cluster)
    assert cluster.surprises == []
    return report


def test_a_slurm_inventory_adds_the_slurm_column_and_passes_when_every_node_is_ready():
    cluster = fake(3)
    report = _slurm_report(cluster)
    assert report.ok, report.findings
    assert report.checks[-1] == "slurm"
    slurm = {f.node: (f.status, f.detail) for f in report.findings if f.check == "slurm"}
    assert slurm == {n: (Status.PASS, f"Slurm has {n} idle") for n in ("node1", "node2", "node3")}
    assert [n for n, k in cluster.calls if k == "sinfo"] == ["node1"]  # asked of the controller
    assert sorted(n for n, k in cluster.calls if k == "munge") == ["node1", "node2", "node3"]
    assert (
        "slurm"
        not in preflight.preflight(fake_inventory(), attempts.Options(nnodes=2), fake(2)).checks
    )  # not on an SSH inventory


def test_slurm_names_a_drained_an_unknown_a_not_responding_node_and_broken_munge():
    cluster = fake(
        3,
        slurm_state={"node2": "drained|disk replaced", "node3": "idle*|Not responding"},
        munge_broken={"node1"},
    )
    found = {f.node: f for f in _slurm_report(cluster).findings if f.check == "slurm"}
    assert all(f.status is Status.FAIL for f in found.values())
    assert found["node1"].detail == (
        "munge does not work on node1: exit 1: unmunge: Error: Socket communication error"
    )
    assert found["node2"].detail == "Slurm has node2 drained (disk replaced)"
    assert found["node2"].remedy == (
        "on node1: once that is dealt with, scontrol update nodename=node2 state=resume"
    )
    assert found["node3"].detail == "Slurm has node3 idle* (Not responding)"
    assert found["node3"].remedy.startswith("on node3: check slurmd and munge")

    report = _slurm_report(fake(3, slurm_unknown={"node3"}))
    slurm = {f.node: f for f in report.findings if f.check == "slurm"}
    assert [n for n, f in slurm.items() if f.status is Status.FAIL] == ["node3"]
    assert slurm["node3"].detail == "node3 is not a node of Slurm's controller on node1"
    assert slurm["node3"].remedy == (
        "make provision INVENTORY=/nonexistent/inventory.yml (slurm.conf lists every node of "
        "the inventory)"
    )
