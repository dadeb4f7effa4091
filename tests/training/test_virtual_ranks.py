"""A job continued on fewer ranks than planned (TMN_PLANNED_WORLD_SIZE) computes the planned
world's steps: training.ddp on 2 ranks planned for 3 prints the losses of 3 ranks and ends on
their parameters, from the 3 ranks' checkpoint and back; without the variable another world size
is refused. training.fsdp on 2 ranks planned for 3 splits the planned global batch unevenly.

Tolerance: losses as printed (4 decimals) within 1e-4, parameters within 1e-5 (measured: 2e-7
for ddp, 6e-8 for fsdp; the sums over ranks and micro-batches round differently)."""

from __future__ import annotations

import re
import shutil
import sys
import time

import pytest
import torch

from tests.training.conftest import (
    TINY,
    load_state,
    max_difference,
    run_command,
    run_main,
    torchrun_command,
)
from tests.training.references import SMALL, STEPS, progress
from torch_multinode.cluster.errors import UserError
from torch_multinode.cluster.jobenv import PLANNED_WORLD_VARIABLE
from torch_multinode.training import ddp
from torch_multinode.training.checkpointing.checkpoint import file_name
from torch_multinode.training.distributed.parallel import DistEnv
from torch_multinode.training.loop import metrics
from torch_multinode.training.loop.virtual_ranks import VirtualRanks, loss_scale, played_ranks
from torch_multinode.training.settings import arguments

# -- the plan ----------------------------------------------------------------------------------


def test_each_planned_rank_is_played_by_exactly_one_rank_its_own_first():
    assert played_ranks(0, 2, 3) == (0, 2)
    assert played_ranks(1, 2, 3) == (1,)
    assert played_ranks(2, 3, 3) == (2,)
    for world, planned in [(1, 1), (1, 4), (2, 3), (3, 8), (4, 4), (5, 16)]:
        played = [played_ranks(rank, world, planned) for rank in range(world)]
        assert sorted(v for ranks in played for v in ranks) == list(range(planned))
        assert all(ranks[0] == rank for rank, ranks in enumerate(played))
    for rank, world, planned in [(2, 2, 3), (0, 3, 2), (-1, 2, 3)]:
        with pytest.raises(ValueError):
            played_ranks(rank, world, planned)


@pytest.mark.extended
def test_the_loss_scale_makes_the_average_over_the_world_the_mean_over_the_planned_ranks():
    for world, planned in [(1, 3), (2, 3), (3, 8), (4, 4)]:
        gradients = torch.arange(1.0, planned + 1) ** 2  # one per planned rank's micro-batch
        per_rank = [
            sum(loss_scale(world, planned) * gradients[v] for v in played_ranks(r, world, planned))
            for r in range(world)
        ]
        assert float(sum(per_rank) / world) == pytest.approx(float(gradients.mean()))
    assert loss_scale(3, 3) == 1.0


def test_virtual_ranks_describe_the_layout_in_one_line():
    assert not VirtualRanks(1, 3, 3).active
    layout = VirtualRanks(0, 2, 3)
    assert layout.active and layout.ranks == (0, 2) and layout.loss_scale == 2 / 3
    assert layout.describe(32) == (
        "continuing on 2 of 3 planned ranks: global batch 96 kept, rank 0 plays ranks 0 and 2 "
        "(rank r plays r, r + 2, ...: 1 or 2 micro-batches of 32 per step)"
    )
    assert (
        VirtualRanks(1, 2, 4)
        .describe(8)
        .endswith(
            "rank 0 plays ranks 0 and 2 (rank r plays r, r + 2, ...: 2 micro-batches of 8 per step)"
        )
    )


def test_the_planned_world_size_comes_from_the_launcher_or_is_the_world_size():
    assert arguments.planned_world_size({}) is None
    assert arguments.planned_world_size({"WORLD_SIZE": "2"}) == 2
    assert arguments.planned_world_size({"WORLD_SIZE": "2", PLANNED_WORLD_VARIABLE: ""}) == 2
    assert arguments.planned_world_size({"WORLD_SIZE": "2", PLANNED_WORLD_VARIABLE: "3"}) == 3
    assert arguments.planned_world_size({PLANNED_WORLD_VARIABLE: "3"}) == 3  # one process
    for value in ("1", "three", "0"):
        with pytest.raises(UserError) as refused:
            arguments.planned_world_size({"WORLD_SIZE": "2", PLANNED_WORLD_VARIABLE: value})
        assert refused.value.line() == (
            f"Error: {PLANNED_WORLD_VARIABLE}={value!r} is not a world size of at least this "
            "job's 2 ranks (try unsetting it: the launcher sets it only to continue a job on "
            "fewer ranks)"
        )


def test_progress_means_over_every_sample_whatever_each_rank_played(capsys):
    """One process playing 3 planned ranks of 2 samples and one of 1: the loss and accuracy
    are per sample, and the samples per second those of the planned world."""
    progress = metrics.Progress(
        DistEnv(), total_steps=1, batch_per_rank=2, log_every=1, planned_world_size=3
    )
    for loss, labels in [(1.0, [0, 1]), (4.0, [1]), (1.0, [1, 1])]:
        logits = torch.tensor([[0.0, 1.0]] * len(labels))  # predicts class 1
        progress.add(torch.tensor(loss), logits, torch.tensor(labels))
    progress.since = time.perf_counter() - 1.0  # the step took a second
    progress.maybe_report(1, 0.1)
    assert progress.last["loss"] == pytest.approx((2 * 1.0 + 4.0 + 2 * 1.0) / 5)
    assert progress.last["accuracy"] == pytest.approx(4 / 5)
    assert progress.last["samples_per_second"] == pytest.approx(3 * 2, rel=0.01)
    assert capsys.readouterr().out.startswith("step 1/1  loss 1.6000  acc  80.0%")


# -- whole runs --------------------------------------------------------------------------------

DDP_STEPS = 8  # 5 steps per epoch at 48 samples per step: the runs cross an epoch boundary
# TINY's flags; a later flag wins: 16 samples per rank of 3, a progress line every step.
RUN = (*TINY, "--global-batch-size", "48", "--log-every", "1")
RUN = (*RUN, "--steps", str(DDP_STEPS), "--checkpoint-every", "3")


def losses(output: str) -> dict[int, float]:
    """step -> the loss its progress line printed."""
    found = re.findall(r"^step +(\d+)/\d+  loss ([\d.]+)", output, re.M)
    return {int(step): float(loss) for step, loss in found}


def launch(directory, checkpoints, nproc: int, env=None, out: str | None = None, *extra: str):
    command = torchrun_command(
        "training.ddp", *RUN, *extra, "--checkpoint-dir", str(checkpoints), nproc=nproc
    )
    if out:
        command += ["--out", str(directory / out)]
    return run_command(command, directory, env, 180)


def keep_only(source, destination, step: int) -> None:
    destination.mkdir()
    for path in source.glob(f"step-{step:08d}-rank-*.pt"):
        shutil.copy(path, destination / path.name)


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory):
    """An uninterrupted 3-rank run: its printed losses, final parameters and checkpoints (steps
    3, 6 and 8). Resuming is exact (test_resume), so its steps after 3 are those of a 3-rank run
    resumed from step 3."""
    directory = tmp_path_factory.mktemp("three")
    run = launch(directory, directory / "checkpoints", 3, out="model.pt")
    assert run.returncode == 0, run.explain()
    assert sorted(losses(run.stdout)) == list(range(1, DDP_STEPS + 1)), run.explain()
    return run, load_state(directory / "model.pt"), directory / "checkpoints"


def test_two_ranks_planned_for_three_compute_the_steps_of_three_and_back(tmp_path, three_ranks):
    reference, parameters, checkpoints = three_ranks
    expected = losses(reference.stdout)
    two = tmp_path / "two"
    keep_only(checkpoints, two, 3)
    # With --static-graph, which DDP refuses beside no_sync (a reducer assertion at the first
    # step): off for the run on fewer ranks, and the steps are the same.
    # Planned rank 2 no longer runs: its --step-delay is no one's (as a node-loss test asks).
    delay = ("--step-delay", "0.01", "--step-delay-rank", "2")
    run = launch(
        tmp_path, two, 2, {PLANNED_WORLD_VARIABLE: "3"}, "two.pt", "--static-graph", *delay
    )
    assert run.returncode == 0, run.explain()
    assert run.lines("batch    ") == ["batch    16 per rank x 3 ranks = 48 global"]
    assert run.lines("continuing on") == [VirtualRanks(0, 2, 3).describe(16)]
    assert run.lines("--static-graph off") == [
        "--static-graph off: on fewer ranks than planned a rank plays several micro-batches "
        "under no_sync, which DDP's static graph does not allow"
    ]
    resumed = losses(run.stdout)
    assert sorted(resumed) == list(range(4, DDP_STEPS + 1)), run.explain()
    for step, loss in resumed.items():
        assert loss == pytest.approx(expected[step], abs=1.01e-4), (step, run.explain())
    # Equal but for the order of floating-point sums.
    assert max_difference(load_state(tmp_path / "two.pt"), parameters) < 1e-5
    # Written as the planned world's: rank 0's files for ranks 0 and 2, rank 1's for 1.
    assert sorted(p.name for p in two.iterdir()) == [
        file_name(step, rank) for step in (3, 6, 8) for rank in (0, 1, 2)
    ]

    # And back on 3 ranks from the 2 ranks' checkpoint of step 6.
    three = tmp_path / "three"
    keep_only(two, three, 6)
    run = launch(tmp_path, three, 3, out="three.pt")
    assert run.returncode == 0, run.explain()
    assert not run.lines("continuing on")
    resumed = losses(run.stdout)
    assert sorted(resumed) == [7, 8], run.explain()
    for step, loss in resumed.items():
        assert loss == pytest.approx(expected[step], abs=1.01e-4), (step, run.explain())
    assert max_difference(load_state(tmp_path / "three.pt"), parameters) < 1e-5


@pytest.mark.extended
def test_another_world_size_is_refused_unless_planned_and_then_it_must_match(
    tmp_path, three_ranks, monkeypatch, capsys
):
    _, _, checkpoints = three_ranks
    two = tmp_path / "two"
    keep_only(checkpoints, two, 8)
    run = launch(tmp_path, two, 2)
    assert run.returncode != 0, run.explain()
    assert {line for line in run.output.splitlines() if line.startswith("Error:")} == {
        f"Error: checkpoint step 8 in {two} has world_size 3, this run has 2: sampler "
        "positions would not match (try --no-resume, or the original world size and "
        "--global-batch-size)"
    }, run.explain()
    # One process (in this one) planned for 4: the checkpoint's 3 do not match either.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(PLANNED_WORLD_VARIABLE, "4")
    code, _, err = run_main(ddp.main, [*RUN, "--checkpoint-dir", str(two)], capsys)
    assert (code, err.splitlines()) == (
        2,
        [
            f"Error: checkpoint step 8 in {two} has world_size 3, this run has 4 (on 1 ranks "
            f"planned for 4, {PLANNED_WORLD_VARIABLE}): sampler positions would not match (try "
            f"--no-resume, or {PLANNED_WORLD_VARIABLE}=3 and the original --global-batch-size)"
        ],
    )


@pytest.mark.extended
def test_a_test_hooks_rank_is_one_of_the_planned_world(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(PLANNED_WORLD_VARIABLE, "3")  # one process planned for 3
    for flag in ("--step-delay-rank", "--checkpoint-pause-rank"):
        code, _, err = run_main(ddp.main, [*RUN, flag, "3"], capsys)
        assert (code, err.splitlines()) == (
            2,
            [f"Error: {flag} 3 is not a rank of this job (0 to 2)"],
        )


@pytest.mark.extended
def test_fsdp_on_two_ranks_planned_for_three_splits_the_planned_batch_unevenly(tmp_path):
    """training.fsdp needs no micro-batches (every sequence's loss is its own): 2 ranks planned
    for 3 split the 9 sequences of a step 5 + 4 and continue, resharded, the run of one plain
    process (the planned world's steps, test_fsdp) from its checkpoint of step 10."""
    nine = (*SMALL, "--global-batch-size", "9")
    command = [sys.executable, "-m", "torch_multinode.training.fsdp", *nine]
    plain = run_command(
        [*command, "--checkpoint-dir", "one", "--export", "plain.pt"], tmp_path, None, 180
    )
    assert plain.returncode == 0, plain.explain()
    expected = progress(plain.stdout)
    two = tmp_path / "two"
    two.mkdir()
    shutil.copytree(tmp_path / "one" / "step-00000010", two / "step-00000010")
    command = torchrun_command("training.fsdp", *nine, "--checkpoint-dir", str(two), nproc=2)
    run = run_command(
        [*command, "--export", "two.pt"], tmp_path, {PLANNED_WORLD_VARIABLE: "3"}, 180
    )
    assert run.returncode == 0, run.explain()
    assert run.lines("batch    ") == [
        "batch    3 sequences of 16 tokens per rank x 3 ranks = 144 tokens per step"
    ]
    assert run.lines("continuing on") == [
        "continuing on 2 of 3 planned ranks: global batch 9 kept, 4 or 5 sequences per rank"
    ]
    found = progress(run.stdout)
    assert sorted(found) == list(range(11, STEPS + 1)), run.explain()
    for step, (loss, norm) in found.items():
        assert loss == pytest.approx(expected[step][0], abs=1.01e-4), step
        assert norm == pytest.approx(expected[step][1], abs=1.01e-4), step
    parameters = load_state(tmp_path / "plain.pt")
    assert max_difference(load_state(tmp_path / "two.pt"), parameters) < 1e-5
