"""Meeting users where they are: GPU selection, the debug switch, scripts written for
torch.distributed.launch, and the three init methods."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from cluster.errors import ClusterError
from cluster.inventory import parse
from tests.conftest import run_cli
from training import launcher

SCRIPTS = Path(__file__).parent / "launcher_scripts"

GPU_INVENTORY = """\
all:
  vars: {compute_subnet: 10.7.0.0/24, launch_mode: container}
  children:
    nodes:
      hosts:
        big: {ansible_host: 10.1.0.1, compute_ip: 10.7.0.1, compute_interface: eth1, gpus: 4}
        small:
          ansible_host: 10.1.0.2
          compute_ip: 10.7.0.2
          compute_interface: eth1
          gpus: 2
          cuda_visible_devices: "1"
        cpu: {ansible_host: 10.1.0.3, compute_ip: 10.7.0.3, compute_interface: eth1, gpus: 0}
"""


def _command(host, spec, inventory) -> list[str]:
    master = inventory.hosts[0]
    return shlex.split(
        launcher.remote_command(host, master, 2, spec, 29500, {}, "container", "img:1")
    )


def test_gpu_selection_sets_visible_devices_and_process_count():
    inventory = parse(GPU_INVENTORY, "inv.yml")
    big, small, _ = inventory.hosts
    spec = launcher.JobSpec(run_id="tmn-g", gpus=(0, 2))
    words = _command(big, spec, inventory)
    assert "CUDA_VISIBLE_DEVICES=0,2" in words and "--nproc-per-node=2" in words
    assert words[words.index("--gpus") + 1] == "all"
    # The inventory's per-host selection wins for that host.
    words = _command(small, spec, inventory)
    assert "CUDA_VISIBLE_DEVICES=1" in words and "--nproc-per-node=1" in words
    # Without a selection: every GPU the node has, one process each, no CUDA_VISIBLE_DEVICES.
    words = _command(big, launcher.JobSpec(run_id="tmn-g"), inventory)
    assert "--nproc-per-node=4" in words
    assert not any(w.startswith("CUDA_VISIBLE_DEVICES=") for w in words)


@pytest.mark.parametrize(
    "host_index, gpus, message",
    [
        (0, (0, 4), "GPUS=0,4 asks for GPU 4, but node 'big' has 4 GPU(s) (0-3)"),
        (2, (0,), "GPUS=0 but node 'cpu' has no GPU (inventory gpus: 0)"),
    ],
)
def test_gpu_selection_is_checked_against_each_node(host_index, gpus, message):
    inventory = parse(GPU_INVENTORY, "inv.yml")
    with pytest.raises(ClusterError) as caught:
        launcher.nproc_for(inventory.hosts[host_index], launcher.JobSpec(gpus=gpus))
    assert str(caught.value) == message


def test_gpus_on_a_cpu_machine_is_one_clear_line():
    proc = run_cli("train", "--gpus", "0")
    assert proc.returncode == 2
    assert proc.stderr == (
        "Error: GPUS=0 but this machine has no GPU (try leaving GPUS unset; --nproc-per-node "
        "sets the process count)\n"
    )
    proc = run_cli("train", "--gpus", "0,zero")
    assert proc.returncode == 2
    assert (
        proc.stderr == "Error: GPUS: '0,zero' is not a list of GPU indices (try a form like 0,2)\n"
    )


def test_debug_turns_on_the_backends_logs_for_that_run():
    inventory = parse(GPU_INVENTORY, "inv.yml")
    words = _command(inventory.hosts[0], launcher.JobSpec(run_id="tmn-d", debug="info"), inventory)
    for variable in ("NCCL_DEBUG=INFO", "NCCL_DEBUG_SUBSYS=INIT,NET",
                     "TORCH_DISTRIBUTED_DEBUG=INFO", "TORCH_CPP_LOG_LEVEL=INFO"):  # fmt: skip
        assert variable in words
    detail = _command(
        inventory.hosts[0], launcher.JobSpec(run_id="tmn-d", debug="detail"), inventory
    )
    assert "TORCH_DISTRIBUTED_DEBUG=DETAIL" in detail
    quiet = _command(inventory.hosts[0], launcher.JobSpec(run_id="tmn-d"), inventory)
    assert not any(w.startswith("NCCL_DEBUG=") for w in quiet)


def test_legacy_scripts_are_detected_by_the_flag_they_declare(tmp_path):
    assert launcher.legacy_flag(SCRIPTS / "legacy_local_rank.py") == "--local_rank"
    assert launcher.legacy_flag(SCRIPTS / "tutorial_ddp.py") is None
    both = tmp_path / "both.py"
    both.write_text('p.add_argument("--local-rank", "--local_rank", type=int)\n')
    assert launcher.legacy_flag(both) == "--local-rank"
    spec = launcher.JobSpec(script=both, local_rank_flag="--local-rank", run_id="tmn-l")
    assert launcher.entry_point(spec, "/run") == [
        "-m", "training.legacy", "--flag=--local-rank", "/run/both.py",
    ]  # fmt: skip


# --- On the simulated cluster -------------------------------------------------------------


@pytest.mark.sim
def test_debug_output_shows_backend_lines_from_every_node(sim2, tmp_path):
    proc = run_cli("train", "-i", str(sim2.config.inventory_path), "--debug",
                   "--log-dir", str(tmp_path), "--script", str(SCRIPTS / "tutorial_ddp.py"),
                   timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    assert f"each node's log: {tmp_path}/NODE.log" in proc.stdout
    for node, rank in (("node1", 0), ("node2", 1)):
        # The C++ side's own log lines (DDP's logger, the reducer), from that node's rank.
        backend = [
            line for line in proc.stdout.splitlines()
            if line.startswith(f"[{node}] [rank{rank}]:[I") and "DDP Initialized with" in line
        ]  # fmt: skip
        assert backend, f"no backend debug line from {node}"
        assert "DDP Initialized with" in (tmp_path / f"{node}.log").read_text()


@pytest.mark.sim
def test_legacy_local_rank_script_trains_on_two_nodes_unchanged(sim2):
    proc = run_cli("train", "-i", str(sim2.config.inventory_path),
                   "--script", str(SCRIPTS / "legacy_local_rank.py"), "--", "--steps", "3",
                   timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    assert "[launcher] legacy_local_rank.py parses --local_rank: passing it the local rank" in (
        proc.stdout
    )
    lines = sorted(line for line in proc.stdout.splitlines() if " legacy rank " in line)
    assert [line.split(" legacy ")[0] for line in lines] == ["[node1]", "[node2]"]
    assert "legacy rank 0 local_rank 0 steps 3" in lines[0]
    assert "legacy rank 1 local_rank 0 steps 3" in lines[1]
    assert lines[0].split("weight ")[1] == lines[1].split("weight ")[1]


@pytest.mark.sim
def test_three_init_methods_each_form_a_two_node_group(sim2):
    proc = run_cli("train", "-i", str(sim2.config.inventory_path),
                   "--module", "training.init_methods", "--", "--shared-dir", "/shared",
                   timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    for method in ("env", "tcp", "file"):
        found = [
            line for line in proc.stdout.splitlines() if f"] {method}:// group of 2 ranks" in line
        ]
        assert len(found) == 2, method
        assert all(line.endswith("all_reduce 3 == 3 OK") for line in found)
        assert {line.split()[0] for line in found} == {"[node1]", "[node2]"}
