"""A run killed after its checkpoints and resumed ends exactly where an uninterrupted run does,
including when one rank lost its newest checkpoint and a half-written temp file lies around."""

from __future__ import annotations

import shutil

import pytest

from tests.training.conftest import (
    REFERENCE_STEPS,
    TINY,
    load_state,
    max_difference,
    run_command,
    torchrun_command,
)
from torch_multinode.training.checkpointing.checkpoint import file_name
from torch_multinode.training.settings.config import STOP_EXIT_CODE

CHECKPOINTING = ("--steps", str(REFERENCE_STEPS), "--checkpoint-every", "4", "--keep", "2")


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, reference_ddp):
    """Checkpoint directories of a run stopped by --stop-after-step 10 (after steps 4 and 8)."""
    directory = tmp_path_factory.mktemp("stopped")
    checkpoints = directory / "checkpoints"
    command = torchrun_command(
        "training.ddp",
        *TINY,
        *CHECKPOINTING,
        "--checkpoint-dir",
        str(checkpoints),
        "--stop-after-step",
        "10",
    )
    run = run_command(command, directory, None, 180)
    assert run.returncode != 0, run.explain()
    assert f"exitcode  : {STOP_EXIT_CODE}" in run.stderr, run.explain()
    assert run.lines("stopping after step 10") == [
        f"stopping after step 10 (--stop-after-step): exit {STOP_EXIT_CODE}"
    ]
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        file_name(step, rank) for step in (4, 8) for rank in (0, 1)
    ]
    return checkpoints


def test_resume_agrees_on_the_newest_step_every_rank_has(
    torchrun, tmp_path, stopped, reference_ddp
):
    checkpoints = tmp_path / "checkpoints"
    shutil.copytree(stopped, checkpoints)
    # Rank 1's node died while writing step 8: its file never got its final name.
    newest = checkpoints / file_name(8, 1)
    partial = checkpoints / f".{file_name(8, 1)}.x1y2z3.tmp"
    partial.write_bytes(newest.read_bytes()[:100])
    newest.unlink()
    out = tmp_path / "model.pt"
    run = torchrun(
        "training.ddp",
        *TINY,
        *CHECKPOINTING,
        "--checkpoint-dir",
        str(checkpoints),
        "--out",
        str(out),
    )
    assert run.returncode == 0, run.explain()
    assert run.lines("resuming from") == [
        "resuming from step 4, the newest step every rank has (rank 0 has 4, 8; rank 1 has 4)"
    ]
    assert run.lines("steps          ") == ["steps          12 (resumed from step 4)"]
    # Bit for bit, though the resumed run restarted mid-epoch and crossed into the next one.
    assert max_difference(load_state(out), reference_ddp.state) == 0.0
    assert run.digests() == reference_ddp.finished.digests()
    assert not partial.exists(), "rank 1 should clear its own leftover temp file"
    # --keep 2: steps 8 (rewritten) and 12 remain.
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        file_name(step, rank) for step in (8, 12) for rank in (0, 1)
    ]


def test_another_world_size_is_refused_and_no_resume_starts_over(python_module, tmp_path, stopped):
    checkpoints = tmp_path / "checkpoints"
    shutil.copytree(stopped, checkpoints)
    run = python_module("training.ddp", *TINY, *CHECKPOINTING, "--checkpoint-dir", str(checkpoints))
    assert run.returncode == 2, run.explain()
    assert run.stderr.splitlines() == [
        f"Error: checkpoint step 8 in {checkpoints} has world_size 2, this run has 1: sampler "
        "positions would not match (try --no-resume, or the original world size and "
        "--global-batch-size)"
    ]
    # --no-resume starts over, deleting this rank's checkpoints only.
    run = python_module(
        "training.ddp", *TINY, *CHECKPOINTING, "--checkpoint-dir", str(checkpoints), "--no-resume"
    )
    assert run.returncode == 0, run.explain()
    assert run.lines("--no-resume") == [f"--no-resume: starting from step 0 in {checkpoints}"]
    assert sorted(p.name for p in checkpoints.iterdir()) == sorted(
        [file_name(8, 0), file_name(12, 0), file_name(4, 1), file_name(8, 1)]
    )
