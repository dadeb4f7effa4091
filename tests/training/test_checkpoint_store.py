"""Checkpoint files: atomic writes, what counts as a complete step, pruning, and agreement."""

from __future__ import annotations

import errno
import os
import random

import numpy as np
import pytest
import torch

from torch_multinode.cluster.errors import UserError
from torch_multinode.training.checkpointing import checkpoint, durable
from torch_multinode.training.checkpointing.checkpoint import (
    CheckpointStore,
    file_name,
    newest_common_step,
    plan_resume,
)


class Unpicklable:
    def __reduce__(self):
        raise RuntimeError("disk full")


def test_an_interrupted_write_leaves_neither_the_file_nor_a_temp_file(tmp_path):
    path = tmp_path / file_name(5, 0)
    durable.write_atomically(path, {"step": 4})
    with pytest.raises(RuntimeError, match="disk full"):
        durable.write_atomically(path, {"step": 5, "bad": Unpicklable()})
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
    assert torch.load(path, weights_only=True) == {"step": 4}  # the old complete file survives
    # Readable by all, as open() makes it: in a container the job writes as root, and the
    # inventory's user fetches what rank 0 wrote (--out) over SSH.
    assert path.stat().st_mode & 0o777 == 0o644


def test_only_complete_files_of_this_rank_count(tmp_path):
    store = CheckpointStore(tmp_path, rank=1, keep=10)
    for step in (10, 20):
        store.save(step, {"step": step})
    (tmp_path / file_name(30, 0)).write_bytes(b"rank 0's, not ours")
    (tmp_path / f".{file_name(30, 1)}.abc123.tmp").write_bytes(b"half written")
    (tmp_path / "step-40-rank-1.pt").write_bytes(b"not our naming")
    assert store.steps() == [10, 20]
    assert store.load(20) == {"step": 20}
    store.remove_temporaries()
    assert not (tmp_path / f".{file_name(30, 1)}.abc123.tmp").exists()
    assert (tmp_path / file_name(30, 0)).exists()


def test_a_rank_with_no_file_of_its_own_reads_another_ranks_and_prunes_only_its_own(tmp_path):
    # After a restart on fewer nodes the node that held rank 2 holds rank 1 now: its files are
    # rank 2's, whose model, optimizer and position every data-parallel rank shares.
    CheckpointStore(tmp_path, rank=2, keep=10).save(5, {"step": 5, "rank": 2})
    CheckpointStore(tmp_path, rank=2, keep=10).save(10, {"step": 10, "rank": 2})
    store = CheckpointStore(tmp_path, rank=1, keep=1)
    assert store.steps() == [5, 10]
    assert store.load(10) == {"step": 10, "rank": 2}
    store.save(15, {"step": 15, "rank": 1})
    assert store.steps() == [15]  # its own now, pruned to keep 1; rank 2's left alone
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        file_name(5, 2),
        file_name(10, 2),
        file_name(15, 1),
    ]
    assert store.clear() == 1 and store.steps() == [5, 10]


def test_saving_keeps_the_newest_k(tmp_path):
    store = CheckpointStore(tmp_path, rank=0, keep=2)
    for step in (5, 10, 15, 20):
        store.save(step, {"step": step})
    assert store.steps() == [15, 20]
    assert store.clear() == 2 and store.steps() == []


def test_a_corrupt_checkpoint_is_an_error_naming_the_file(tmp_path):
    store = CheckpointStore(tmp_path, rank=0, keep=2)
    store.path(7).write_bytes(b"garbage")
    with pytest.raises(UserError, match=f"cannot load checkpoint {store.path(7)}"):
        store.load(7)


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
    # a node new to the job (a spare) holds none: with data-parallel checkpoints (every rank's
    # the same state), it receives the newest step the others share from the first of them
    plan = plan_resume([[4, 8], [], [8]], None, "/ck", replicated=True)
    assert plan == checkpoint.ResumePlan(
        8,
        "resuming from step 8, the newest step every rank with checkpoints has (rank 0 has 4, "
        "8; rank 1 has none; rank 2 has 8); rank 0 sends its state to rank 1, whose node holds "
        "none",
        (1,),
        0,
    )
    with pytest.raises(UserError):  # sharded checkpoints (FSDP's) cannot be sent whole
        plan_resume([[4, 8], []], None, "/ck")
    with pytest.raises(UserError) as error:
        plan_resume([[4, 8], [6]], None, "/ck")
    assert error.value.line() == (
        "Error: no checkpoint step is present on every rank in /ck (rank 0 has 4, 8; rank 1 "
        "has 6) (try --no-resume to start over)"
    )
    with pytest.raises(UserError, match="rank 1 has none"):
        plan_resume([[], []], True, "/ck")


def test_rng_states_survive_a_weights_only_round_trip(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    path = tmp_path / "rng.pt"
    durable.write_atomically(path, checkpoint.rng_states(torch.device("cpu")))
    expected = (random.random(), np.random.rand(), torch.rand(()).item())
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    checkpoint.restore_rng_states(torch.load(path, weights_only=True), torch.device("cpu"))
    assert (random.random(), np.random.rand(), torch.rand(()).item()) == expected


def _disk_full_after(limit: int):
    """A torch.save that writes `limit` bytes of the file and then finds the disk full, the way
    torch reports it: a RuntimeError raised while handling the OSError."""

    def save(payload, file):
        file.write(b"x" * limit)
        try:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError:
            # As torch does it: implicitly chained, __context__ only.
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos")  # noqa: B904

    return save


def test_a_full_disk_is_one_error_line_naming_the_directory_and_keeps_the_last_checkpoint(
    tmp_path, monkeypatch
):
    store = CheckpointStore(tmp_path, rank=1, keep=1)
    store.save(4, {"step": 4})
    monkeypatch.setattr(checkpoint.torch, "save", _disk_full_after(100))
    with pytest.raises(UserError) as error:
        store.save(8, {"step": 8})
    assert error.value.exit_code == 1
    assert error.value.line() == (
        f"Error: cannot write checkpoint step 8 to {tmp_path}: No space left on device; step 4 "
        "is kept (try freeing space there, a smaller --keep, or a --checkpoint-dir with more "
        "room)"
    )
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == [file_name(4, 1)]  # no temp file left
    assert store.load(4) == {"step": 4}


def test_a_read_only_directory_is_refused_before_training(tmp_path, monkeypatch):
    store = CheckpointStore(tmp_path / "checkpoints", rank=0, keep=2)
    store.check_writable()  # creates it, leaves nothing behind
    assert list((tmp_path / "checkpoints").iterdir()) == []

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(tmp_path / "checkpoints"))

    monkeypatch.setattr(checkpoint.tempfile, "NamedTemporaryFile", read_only)
    with pytest.raises(UserError) as error:
        store.check_writable()
    assert error.value.line() == (
        f"Error: cannot write checkpoints to {tmp_path / 'checkpoints'}: Read-only file system "
        "(try a writable --checkpoint-dir)"
    )
    (tmp_path / "a-file").write_text("")
    with pytest.raises(UserError) as error:
        CheckpointStore(tmp_path / "a-file" / "sub", rank=0, keep=2).check_writable()
    assert error.value.line() == (
        f"Error: cannot write checkpoints to {tmp_path / 'a-file' / 'sub'}: Not a directory "
        "(try another --checkpoint-dir)"
    )


def test_an_error_that_is_not_the_disks_keeps_its_traceback(tmp_path):
    store = CheckpointStore(tmp_path, rank=0, keep=2)
    with pytest.raises(RuntimeError, match="disk full"):  # Unpicklable's, not an OSError
        store.save(5, {"bad": Unpicklable()})
    assert list(tmp_path.iterdir()) == []


def test_the_hook_before_the_rename_sees_a_complete_temp_file_and_no_final_name(tmp_path):
    store = CheckpointStore(tmp_path, rank=0, keep=1)
    store.save(4, {"step": 4})
    seen = []

    def before_rename(temporary):
        seen.append((temporary.name, torch.load(temporary, weights_only=True), store.steps()))

    store.save(8, {"step": 8}, prune=False, before_rename=before_rename)
    [(name, payload, steps)] = seen
    assert name.startswith(f".{file_name(8, 0)}.") and payload == {"step": 8} and steps == [4]
    assert store.steps() == [4, 8]  # prune=False: the caller prunes once every rank has step 8
    store.prune()
    assert store.steps() == [8]
