"""training.fsdp on this machine: FSDP2 on 2 ranks equals one plain process, resumes exactly,
holds about half a replica per rank, and exports a model a plain process loads. Resharding from
a directory every rank sees, and the refusal to reshard node-local disks, are proven in the
training containers (test_fsdp_cluster.py; with replicas, test_replication.py).

Tolerance: 2 ranks against one plain process, fp32, 20 steps of AdamW: every parameter within
1e-5 (measured: 2.2e-7; the ranks' gradient sums round differently). A resume at the same world
size is bit for bit; resharded runs are within 1e-5 of the uninterrupted run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import digests, fill, interrupt, read_until, small_filesystem
from tests.training.conftest import (
    load_state,
    local_nodes,
    max_difference,
    run_command,
    torchrun_command,
)
from tests.training.references import SMALL, STEPS, bench_row, digest, progress, reference
from torch_multinode.training.modeling import gpt

# One worker runs these (make test's --dist loadgroup): most of them start from the `straight`
# run, which would otherwise be repeated in every worker that gets one of them.
pytestmark = pytest.mark.xdist_group("fsdp")
TOLERANCE = 1e-5


def launch(directory: Path, *args: str, nproc: int = 2, env=None):
    """training.fsdp under torchrun (nproc ranks), or as one plain process (nproc 0)."""
    if nproc:
        command = torchrun_command("training.fsdp", *SMALL, *args, nproc=nproc)
    else:
        command = [sys.executable, "-m", "torch_multinode.training.fsdp", *SMALL, *args]
    return run_command(command, directory, env, 180)


def copy_step(source: Path, step: int, target: Path) -> Path:
    """A checkpoint directory holding only `step` of `source`'s."""
    target.mkdir(parents=True)
    shutil.copytree(source / f"step-{step:08d}", target / f"step-{step:08d}")
    return target


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """20 uninterrupted steps on 2 ranks, checkpoints every 5 in one directory, exported."""
    directory = tmp_path_factory.mktemp("straight")
    run = launch(
        directory,
        "--checkpoint-dir",
        "checkpoints",
        "--export",
        str(directory / "model.pt"),
        "--bench",
    )
    assert run.returncode == 0, run.explain()
    return directory, run


@pytest.fixture(scope="module")
def plain():
    return reference()


def test_two_ranks_equal_one_plain_process_and_the_loss_falls(straight, plain):
    directory, run = straight
    model, expected = plain
    assert run.lines("world    ") == ["world    2 processes on 1 node(s), gloo, cpu"]
    assert run.lines("model    ") == [
        "model    GPT 2 blocks, width 32, 4 heads, 0.03M parameters, fp32, "
        "FSDP2 (fully_shard per block and root)"
    ]
    assert max_difference(load_state(directory / "model.pt"), model.state_dict()) < TOLERANCE
    found = progress(run.stdout)
    assert sorted(found) == list(range(1, STEPS + 1))
    for step, (loss, norm) in found.items():
        # The norm clip_grad_norm_ computed over the DTensor shards (and clipped with: every
        # step's is above 1) is the whole gradient's; the progress line rounds to 4 decimals.
        assert norm == pytest.approx(expected[step][1], abs=1e-4), step
        assert loss == pytest.approx(expected[step][0], abs=1e-4), step
    assert min(norm for _, norm in found.values()) > 1.0  # --grad-clip 1 clipped every step
    assert found[1][0] > 4.0 and found[STEPS][0] < 2.6  # ln 64 = 4.16; the floor is 0.73


def test_each_rank_holds_half_of_an_unsharded_replica(straight):
    _, run = straight
    row = bench_row(run.stdout)
    assert row["world_size"] == 2 and row["strategy"] == "fsdp"
    assert len(row["bytes_held"]) == 2
    assert max(row["bytes_held"]) / row["bytes_unsharded"] == row["bytes_ratio"] <= 0.55
    assert row["tokens_per_second"] > 0 and row["steps"] == STEPS - 1
    held = run.lines("] holds parameters")
    assert len(held) == 2 and all(line.endswith(f"({row['bytes_ratio']:.3f})") for line in held)


def test_the_export_loads_into_a_plain_model(straight, plain):
    directory, _ = straight
    model, _ = plain
    shape = json.loads((directory / "model.pt.json").read_text())["shape"]
    loaded = gpt.GPT(gpt.Shape(**shape))
    loaded.load_state_dict(torch.load(directory / "model.pt", weights_only=True))  # strict
    tokens = gpt.TokenChains(64, 16, 0.1, 0).batch(1000, 8)  # a batch it never trained on
    with torch.no_grad():
        assert (loaded(tokens[:, :-1]) - model(tokens[:, :-1])).abs().max() < 1e-4
        torch.manual_seed(0)
        untrained = gpt.loss_of(gpt.GPT(gpt.Shape(**shape)), tokens)
        assert gpt.loss_of(loaded, tokens) < untrained - 1.0


def test_a_resumed_run_ends_bit_for_bit_where_the_uninterrupted_one_does(straight, tmp_path):
    directory, uninterrupted = straight
    checkpoints = copy_step(directory / "checkpoints", 10, tmp_path / "checkpoints")
    half_written = checkpoints / ".step-00000015.tmp"  # a run killed while writing step 15
    half_written.mkdir()
    (half_written / "__0_0.distcp").write_bytes(b"partial")
    run = launch(
        tmp_path, "--checkpoint-dir", "checkpoints", "--export", str(tmp_path / "model.pt")
    )
    assert run.returncode == 0, run.explain()
    assert run.lines("resuming from") == [
        "resuming from step 10, the newest step every rank has (rank 0 has 10; rank 1 has 10)"
    ]
    assert digest(run.stdout) == digest(uninterrupted.stdout)
    assert (
        max_difference(load_state(tmp_path / "model.pt"), load_state(directory / "model.pt")) == 0
    )
    assert progress(run.stdout) == {
        s: v for s, v in progress(uninterrupted.stdout).items() if s > 10
    }
    assert not half_written.exists()
    # --keep 3 (the default): the newest three complete steps remain.
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        f"step-{step:08d}" for step in (10, 15, 20)
    ]


def test_ddp_strategy_trains_the_same_model_with_whole_replicas(plain, tmp_path):
    model, _ = plain
    out = tmp_path / "model.pt"
    run = launch(tmp_path, "--strategy", "ddp", "--export", str(out), "--bench")
    assert run.returncode == 0, run.explain()
    assert run.lines("model    ")[0].endswith("DDP (a whole replica per rank)")
    assert max_difference(load_state(out), model.state_dict()) < TOLERANCE
    assert bench_row(run.stdout)["bytes_ratio"] == 1.0


@pytest.mark.extended
@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small filesystem needs root (CI's)")
def test_a_full_node_local_disk_is_one_error_line_and_every_nodes_step_before_stays(
    straight, tmp_path
):
    """The data-safety matrix's FSDP2 node-local x full disk: two local "nodes", each its own
    directory holding step 10; node-1's is a small filesystem, filled up. The write of step 15
    fails on node-1 and every rank says so in one line naming node-1's directory; step 10 is
    byte for byte as it was on both disks, and once there is room again the run resumes from
    it and ends bit for bit where the uninterrupted one does."""
    directory, uninterrupted = straight
    with small_filesystem(tmp_path / "small", "2m") as small:
        disks = [tmp_path / "disk-0", small / "checkpoints"]
        for disk in disks:  # each node's disk with every rank's files of step 10
            copy_step(directory / "checkpoints", 10, disk)
        before = [digests(disk) for disk in disks]
        filler = fill(small)

        def job() -> list:
            return local_nodes(
                tmp_path,
                "torch_multinode.training.fsdp",
                2,
                lambda i: [*SMALL, "--checkpoint-dir", str(disks[i])],
                lambda i: {},
            )

        full = job()
        assert all(run.returncode != 0 for run in full), full[0].explain() + full[1].explain()
        for run in full:  # every rank says node-1's error: the ranks agree on it
            said = [line for line in run.stderr.splitlines() if line.startswith("Error: ")]
            assert len(said) == 1, run.explain()
            assert said == [
                f"Error: cannot write checkpoint step 15 to {disks[1]} on node-1: No space left "
                "on device (try freeing space there, or another --checkpoint-dir)"
            ], run.explain()
        # What was complete stays complete, on both disks; the half-written 15 never named.
        for disk, kept in zip(disks, before, strict=True):
            assert {k: v for k, v in digests(disk).items() if k in kept} == kept, disk
            assert sorted(p.name for p in disk.glob("step-*")) == ["step-00000010"], disk
        filler.unlink()
        again = job()
        assert all(run.returncode == 0 for run in again), again[0].explain() + again[1].explain()
        assert again[0].lines("resuming from") == [
            "resuming from step 10, the newest step every rank has (rank 0 has 10; rank 1 has 10)"
        ], again[0].explain()
        assert digest(again[0].stdout) == digest(uninterrupted.stdout)


def test_ctrl_c_during_a_checkpoint_write_of_a_local_job_keeps_the_step_before(straight, tmp_path):
    """The data-safety matrix's FSDP2 x Ctrl-C: a local job (`train`, no inventory) paused in
    its write of step 10 (the test hook) gets Ctrl-C: exit 130, step 10 never takes its name,
    step 5 is complete, and the run resumed from it ends bit for bit where the uninterrupted
    one does."""
    _, uninterrupted = straight
    checkpoints = tmp_path / "checkpoints"
    process = subprocess.Popen(
        [str(Path(sys.executable).parent / "train"), "--module", "training.fsdp", "--log-dir"]
        + [str(tmp_path / "run"), "--", *SMALL, "--checkpoint-dir", str(checkpoints)]
        + ["--checkpoint-pause-step", "10", "--checkpoint-pause-rank", "1"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        seen = read_until(process, "[rank 1] checkpoint step 10: its files written")
        rest, _ = interrupt(process)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130, seen + rest
    named = sorted(p.name for p in checkpoints.iterdir())
    assert named == [".paused-step-00000010-rank-1", ".step-00000010.tmp", "step-00000005"], named
    again = launch(tmp_path, "--checkpoint-dir", str(checkpoints))
    assert again.returncode == 0, again.explain()
    assert again.lines("resuming from") == [
        "resuming from step 5, the newest step every rank has (rank 0 has 5; rank 1 has 5)"
    ]
    assert digest(again.stdout) == digest(uninterrupted.stdout)
    assert not (checkpoints / ".step-00000010.tmp").exists()  # swept at the resume
