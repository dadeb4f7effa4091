"""A run killed after its checkpoints and resumed ends exactly where an uninterrupted run does,
including when one rank lost its newest checkpoint and a half-written temp file lies around."""

from __future__ import annotations

import shutil
import signal
import subprocess

import pytest

from tests.training.conftest import (
    REFERENCE_STEPS,
    TINY,
    kill_node_then_the_others,
    load_state,
    local_nodes,
    max_difference,
    run_command,
    torchrun_command,
    wait_until,
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


def test_a_node_killed_in_the_first_checkpoint_write_loses_nothing_and_starts_again(
    tmp_path, reference_ddp
):
    """The data-safety matrix's DDP node-local x a node killed before the first checkpoint
    exists on every node: two local "nodes", each its own disk; node-1 pauses inside its write
    of step 4, the first (the test hook), and is killed there, after node-0 wrote its own file
    of step 4 whole. DDP's state is the same on every rank, so nothing is lost: the next run
    resumes from node-0's step 4 and sends it to node-1, whose disk holds none, sweeps node-1's
    half-written file, and ends bit for bit where the uninterrupted run does."""
    disks = [tmp_path / "disk-0", tmp_path / "disk-1"]
    pause = ("--checkpoint-pause-step", "4", "--checkpoint-pause-rank", "1")

    def kill_in_the_write(processes: list[subprocess.Popen]) -> None:
        def began() -> bool:
            return bool(list(disks[1].glob(f".{file_name(4, 1)}.*.tmp")))

        wait_until(began, 150, "node-1 never began its write of step 4")
        kill_node_then_the_others(processes, 1)

    def job(extra: tuple[str, ...], during=None) -> list:
        return local_nodes(
            tmp_path,
            "torch_multinode.training.ddp",
            2,
            lambda i: [*TINY, *CHECKPOINTING, "--checkpoint-dir", str(disks[i]), *extra],
            lambda i: {},
            during,
        )

    first = job(pause, kill_in_the_write)
    assert first[1].returncode == -signal.SIGKILL, first[1].explain()
    # node-0's step 4 whole under its name; node-1's only a temporary file, never named
    assert [p.name for p in disks[0].glob("step-*")] == [file_name(4, 0)], list(disks[0].iterdir())
    assert [p.name for p in disks[1].iterdir() if not p.name.startswith(".")] == []
    out = tmp_path / "model.pt"
    again = job(("--out", str(out)))
    assert all(run.returncode == 0 for run in again), again[0].explain() + again[1].explain()
    assert again[0].lines("resuming from") == [
        "resuming from step 4, the newest step every rank with checkpoints has (rank 0 has 4; "
        "rank 1 has none); rank 0 sends its state to rank 1, whose node holds none"
    ], again[0].explain()
    assert not list(disks[1].glob(".*.tmp"))  # the half-written file swept
    assert max_difference(load_state(out), reference_ddp.state) == 0.0
