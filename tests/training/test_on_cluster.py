"""The workloads across two simulated nodes, through the launcher: DDP equal to one process,
communication demos on 2 nodes x 2 processes, and a pipeline whose stages sit on different
nodes. A node killed mid-run, and the job run again to where an uninterrupted run ends, is
tests/test_projects_in_containers.py's (jobs in the training image)."""

from __future__ import annotations

import re
import subprocess
import uuid

import pytest

from tests.conftest import run_cli
from tests.training.conftest import (
    REFERENCE_STEPS,
    TINY,
    load_state,
    max_difference,
)
from tests.training.references import BATCH, STEPS, ddp_in_one_process, pipeline_in_one_process
from torch_multinode.sim import nodes as sim
from torch_multinode.training.settings import config as config_module
from torch_multinode.training.settings.config import TrainConfig

pytestmark = [pytest.mark.sim, pytest.mark.extended]


def _train(cluster, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return run_cli("train", "-i", str(cluster.config.inventory_path), *args, timeout=timeout)


def _fetch(cluster, remote: str, local) -> None:
    """A file from node1 (where rank 0 writes --out) to this machine."""
    sim.docker("cp", f"{cluster.config.container(1)}:{remote}", str(local))


def _digests(stdout: str) -> dict[int, str]:
    found = re.findall(r"\[rank (\d+)\] parameters sha256 ([0-9a-f]{64})", stdout)
    return {int(rank): digest for rank, digest in found}


def test_two_node_ddp_equals_one_process_on_the_same_global_batches(sim2, tmp_path):
    out = f"/shared/{uuid.uuid4().hex}/model.pt"
    proc = _train(sim2, "--", *TINY, "--steps", str(REFERENCE_STEPS), "--out", out)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "world    2 processes on 2 node(s), gloo, cpu" in proc.stdout
    digests = _digests(proc.stdout)
    assert sorted(digests) == [0, 1] and digests[0] == digests[1]
    _fetch(sim2, out, tmp_path / "model.pt")
    config = config_module.parse(TrainConfig, [*TINY, "--steps", str(REFERENCE_STEPS)])
    expected = ddp_in_one_process(config, REFERENCE_STEPS)  # tiny has no BatchNorm: see that test
    assert max_difference(expected.state_dict(), load_state(tmp_path / "model.pt")) < 1e-6


def test_communication_demos_pass_on_two_nodes_of_two_processes(sim2):
    proc = _train(sim2, "--nproc-per-node", "2", "--module", "training.comm_demo")
    assert proc.returncode == 0, proc.stdout[-3000:]
    final = [line for line in proc.stdout.splitlines() if "checks passed on 4 ranks" in line]
    assert len(final) == 1 and final[0].startswith("[node1] all ")


def test_pipeline_stages_on_two_nodes_match_the_unsplit_model(sim2, tmp_path):
    directory = f"/shared/{uuid.uuid4().hex}"
    proc = _train(
        sim2,
        "--module",
        "training.pipeline",
        "--",
        "--schedule",
        "1f1b",
        "--microbatches",
        "2",
        "--steps",
        str(STEPS),
        "--batch-size",
        str(BATCH),
        "--out-dir",
        directory,
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "[node1] pipeline  2 stages: blocks 0-2 on rank 0, blocks 3-4 on rank 1" in proc.stdout
    losses, parameters, gradients = pipeline_in_one_process()
    import torch

    for rank in (0, 1):
        _fetch(sim2, f"{directory}/stage-{rank}.pt", tmp_path / f"stage-{rank}.pt")
    stages = [load_state(tmp_path / f"stage-{rank}.pt") for rank in (0, 1)]
    assert stages[1]["losses"] == pytest.approx(losses, abs=1e-6)
    for stage in stages:
        for name, value in stage["parameters"].items():
            assert torch.allclose(value, parameters[name], atol=1e-6), name
        for name, value in stage["gradients"].items():
            assert torch.allclose(value, gradients[name], atol=1e-6), name
