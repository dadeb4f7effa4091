"""What makes a checkpoint complete (training/checkpointing/complete.py), the one rule DDP's
files, the spare's broadcast, FSDP2's steps and the replicas' restore follow: a file cut short
never counts, a step some rank holds only in part is said and skipped, never loaded."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from torch_multinode.training.checkpointing import checkpoint, complete, dcp, replicate


def _saved(path, value=1.0):
    torch.save({"model": torch.full((1000,), value)}, path)
    return path


def test_a_torch_file_cut_short_is_not_whole(tmp_path):
    whole = _saved(tmp_path / "whole.pt")
    assert complete.torch_file_whole(whole)
    data = whole.read_bytes()
    for cut in (len(data) - 1, len(data) // 2, 10, 0):
        (tmp_path / "cut.pt").write_bytes(data[:cut])
        assert not complete.torch_file_whole(tmp_path / "cut.pt"), cut
    assert not complete.torch_file_whole(tmp_path / "absent.pt")


def test_a_file_of_another_size_than_written_is_lacking(tmp_path):
    (tmp_path / "a").write_bytes(b"12345")
    (tmp_path / "b").write_bytes(b"12")
    expected = {"a": 5, "b": 3, "c": 1, "d": None}
    assert complete.lacking(tmp_path, expected) == ["b", "c", "d"]
    (tmp_path / "d").write_bytes(b"any size will do where none was recorded")
    assert complete.lacking(tmp_path, expected) == ["b", "c"]
    assert complete.sizes(tmp_path, ["a", "b", "c"]) == {"a": 5, "b": 2}


def test_the_skipped_steps_are_one_line_naming_why():
    assert complete.skipped([[5, 10]], 10) is None
    assert complete.skipped([[15]], 10, {15: "node3 lacks 3 of the 8 files it needs"}) == (
        "checkpoint step 15 (node3 lacks 3 of the 8 files it needs) not complete on every "
        "rank: skipped, never loaded"
    )
    assert complete.skipped([[20], [15, 20]], None) == (
        "checkpoint steps 15, 20 not complete on every rank: skipped, never loaded"
    )


def test_a_ddp_file_cut_short_under_its_name_is_seen_but_never_resumed(tmp_path):
    store = checkpoint.CheckpointStore(tmp_path, rank=0, keep=3)
    for step in (4, 8):
        _saved(tmp_path / checkpoint.file_name(step, 0), float(step))
    cut = tmp_path / checkpoint.file_name(12, 0)
    cut.write_bytes((tmp_path / checkpoint.file_name(8, 0)).read_bytes()[:-100])
    assert store.steps() == [4, 8] and store.seen() == [4, 8, 12]
    # A rank whose node holds only another rank's files reads a complete one of them.
    other = checkpoint.CheckpointStore(tmp_path, rank=1, keep=3)
    assert other.steps() == [4, 8]
    assert other.load(8)["model"][0].item() == 8.0


def test_the_replicas_count_a_file_only_with_the_size_it_was_written_with():
    needed = {10: {"__0_0.distcp": 100, "__1_0.distcp": 100, "manifest.pt": None}}
    whole = {0: {10: {"__0_0.distcp": 100, "manifest.pt": 7}}, 1: {10: {"__1_0.distcp": 100}}}
    assert replicate.usable_step(whole, needed) == 10
    cut = {0: {10: {"__0_0.distcp": 100, "manifest.pt": 7}}, 1: {10: {"__1_0.distcp": 60}}}
    assert replicate.usable_step(cut, needed) is None
    # A directory holding a file cut short fetches it again, from one holding it whole.
    held = {
        0: {"__0_0.distcp": 100, "__1_0.distcp": 100, "manifest.pt": 7},
        1: {"__1_0.distcp": 60},
    }
    assert replicate.transfers(held, needed[10]) == {
        (0, 1): ["__0_0.distcp", "__1_0.distcp", "manifest.pt"]
    }


def test_keep_never_prunes_the_newest_step_whose_copies_finished(tmp_path):
    """--keep 1 with replicas: step 15 is written, its copy in flight; step 10, the newest
    copied, stays until 15's copy has finished, so a node lost meanwhile leaves the survivors
    a complete step."""
    store = dcp.Checkpoints(tmp_path, env=None, keep=1, node="node1")
    for step in (5, 10, 15):
        (store.path(step)).mkdir()
        (store.path(step) / dcp.MANIFEST).write_bytes(b"")
    store.replication = SimpleNamespace(active=True, broken=False, copied=10)
    assert store._protected() == {10, 15}
    store.replication.copied = None  # none finished yet this run (a resume): every step
    assert store._protected() == {5, 10, 15}
    store.replication.broken = True  # no more copies this run: --keep alone
    assert store._protected() == set()


def test_a_hold_between_checkpoints_holds_its_rank_once_per_directory(tmp_path):
    """--hold-after-step 7 --hold-rank 1 (the test hook a node is killed in between
    checkpoints): rank 1 holds after step 7, once; a restart on the same directory goes on,
    and another rank never holds."""
    tmp_path = tmp_path / "ckpt"  # not there yet: a hold may come before the first checkpoint
    held = dcp.Checkpoints(tmp_path, SimpleNamespace(rank=1), keep=1, node="n2", hold=(7, 1))
    other = dcp.Checkpoints(tmp_path, SimpleNamespace(rank=0), keep=1, node="n1", hold=(7, 1))
    assert not held.holding(6) and not other.holding(7)
    assert held.holding(7)
    restarted = dcp.Checkpoints(tmp_path, SimpleNamespace(rank=1), keep=1, node="n2", hold=(7, 1))
    assert not restarted.holding(7)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".held-step-00000007-rank-1"]
    assert held.steps() == []  # the marker is no step
