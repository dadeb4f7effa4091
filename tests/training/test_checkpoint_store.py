"""Checkpoint files: atomic writes, what counts as a complete step, pruning, and agreement."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from cluster.errors import ClusterError
from training import checkpoint
from training.checkpoint import CheckpointStore, file_name, newest_common_step, plan_resume


class Unpicklable:
    def __reduce__(self):
        raise RuntimeError("disk full")


def test_an_interrupted_write_leaves_neither_the_file_nor_a_temp_file(tmp_path):
    path = tmp_path / file_name(5, 0)
    checkpoint.write_atomically(path, {"step": 4})
    with pytest.raises(RuntimeError, match="disk full"):
        checkpoint.write_atomically(path, {"step": 5, "bad": Unpicklable()})
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
    assert torch.load(path, weights_only=True) == {"step": 4}  # the old complete file survives


def test_only_complete_files_of_this_rank_count(tmp_path):
    store = CheckpointStore(tmp_path, rank=1, keep=10)
    for step in (10, 20):
        store.save(step, {"step": step})
    (tmp_path / file_name(30, 0)).write_bytes(b"rank 0's, not ours")
    (tmp_path / f".{file_name(30, 1)}.abc123.tmp").write_bytes(b"half written")
    (tmp_path / "step-40-rank-1.pt").write_bytes(b"not our naming")
    assert store.steps() == [10, 20]
    assert store.load(20, torch.device("cpu")) == {"step": 20}
    store.remove_temporaries()
    assert not (tmp_path / f".{file_name(30, 1)}.abc123.tmp").exists()
    assert (tmp_path / file_name(30, 0)).exists()


def test_saving_keeps_the_newest_k(tmp_path):
    store = CheckpointStore(tmp_path, rank=0, keep=2)
    for step in (5, 10, 15, 20):
        store.save(step, {"step": step})
    assert store.steps() == [15, 20]
    assert store.clear() == 2 and store.steps() == []


def test_a_corrupt_checkpoint_is_an_error_naming_the_file(tmp_path):
    store = CheckpointStore(tmp_path, rank=0, keep=2)
    store.path(7).write_bytes(b"garbage")
    with pytest.raises(ClusterError, match=f"cannot load checkpoint {store.path(7)}"):
        store.load(7, torch.device("cpu"))


@pytest.mark.parametrize(
    ("steps_per_rank", "expected"),
    [
        ([[4, 8], [4, 8]], 8),
        ([[4, 8], [4]], 4),  # the newest of the minimum would also be 4, but:
        ([[4, 12], [8, 12, 16], [4, 8, 12]], 12),
        ([[4, 8], [6]], None),  # min over "newest I have" would pick 6, which rank 0 lacks
        ([[4], []], None),
    ],
)
def test_newest_common_step(steps_per_rank, expected):
    assert newest_common_step(steps_per_rank) == expected


def test_resume_plans():
    assert plan_resume([[], []], None, "/ck").step is None
    assert plan_resume([[4], [4]], False, "/ck").step is None
    plan = plan_resume([[4, 8], [4]], None, "/ck")
    assert plan == checkpoint.ResumePlan(
        4, "resuming from step 4, the newest step every rank has (rank 0 has 4, 8; rank 1 has 4)"
    )
    with pytest.raises(ClusterError) as error:
        plan_resume([[4, 8], [6]], None, "/ck")
    assert error.value.line() == (
        "Error: no checkpoint step is present on every rank in /ck (rank 0 has 4, 8; rank 1 "
        "has 6) (try --no-resume to start over)"
    )
    with pytest.raises(ClusterError, match="rank 1 has none"):
        plan_resume([[], []], True, "/ck")


def test_rng_states_survive_a_weights_only_round_trip(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    path = tmp_path / "rng.pt"
    checkpoint.write_atomically(path, checkpoint.rng_states())
    expected = (random.random(), np.random.rand(), torch.rand(()).item())
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    checkpoint.restore_rng_states(torch.load(path, weights_only=True))
    assert (random.random(), np.random.rand(), torch.rand(()).item()) == expected
