"""Pipeline parallel over two processes computes the unsplit model's losses and gradients."""

from __future__ import annotations

import pytest
import torch

from tests.training.conftest import load_state, run_main
from tests.training.references import (
    BATCH,
    STEPS,
    pipeline_in_one_process,
)
from torch_multinode.training import pipeline


@pytest.mark.parametrize(("schedule", "microbatches"), [("gpipe", 4), ("1f1b", 2)])
def test_two_stages_match_the_unsplit_model(torchrun, tmp_path, schedule, microbatches):
    run = torchrun(
        "training.pipeline",
        "--schedule",
        schedule,
        "--microbatches",
        str(microbatches),
        "--steps",
        str(STEPS),
        "--batch-size",
        str(BATCH),
        "--out-dir",
        str(tmp_path),
    )
    assert run.returncode == 0, run.explain()
    assert run.lines("pipeline  ") == [
        "pipeline  2 stages: blocks 0-2 on rank 0, blocks 3-4 on rank 1"
    ]
    losses, parameters, gradients = pipeline_in_one_process()
    stages = [load_state(tmp_path / f"stage-{rank}.pt") for rank in range(2)]
    assert [stage["blocks"] for stage in stages] == [(0, 3), (3, 5)]
    assert stages[0]["losses"] == []
    assert stages[1]["losses"] == pytest.approx(losses, abs=1e-6)
    held = {name for stage in stages for name in stage["parameters"]}
    assert held == set(parameters)  # together the stages hold the whole model, once
    for stage in stages:
        for name, value in stage["parameters"].items():
            assert torch.allclose(value, parameters[name], atol=1e-6), name
        for name, value in stage["gradients"].items():
            assert torch.allclose(value, gradients[name], atol=1e-6), name


def test_the_batch_must_split_into_micro_batches(monkeypatch, capsys):
    environ = {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "1",
    }
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    code, _, err = run_main(pipeline.main, ["--batch-size", "30", "--microbatches", "4"], capsys)
    assert (code, err) == (2, "Error: batch 30 does not split into 4 micro-batches (30 % 4 = 2)\n")


def test_stage_bounds_cover_every_block_once():
    assert pipeline.stage_bounds(5, 2) == [(0, 3), (3, 5)]
    assert pipeline.stage_bounds(5, 4) == [(0, 2), (2, 3), (3, 4), (4, 5)]
