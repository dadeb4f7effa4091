"""Replicas of training.fsdp's checkpoints on node-local disks (training/checkpointing/replicate.py):
three local "nodes" (one rank each, a directory each standing for its disk) lose the third's
disk; the other two resume from what they hold between them, resharded 3 -> 2, exactly as two
ranks resume the same step from storage every rank sees; then one of them is killed in the
middle of a copy (its torchrun and rank, while the other receives its files of the last step)
and its disk lost, and the job goes on from the step before on a fresh node. And the pure
parts: what a directory sends, the step complete on the union of the directories, the files
each must fetch, the atomic receive.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.training.conftest import kill_node_then_the_others, local_nodes, wait_until
from tests.training.references import SMALL, STEPS, progress
from torch_multinode.training.checkpointing import replicate, transfer
from torch_multinode.training.settings.config import STOP_EXIT_CODE

pytestmark = pytest.mark.xdist_group("fsdp")
# 6 sequences split over 3 ranks, and over 2 continuing the 3 planned ones.
BATCH = ("--global-batch-size", "6")
FILES = [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"] + [
    f"rank-0000{r}.pt" for r in range(3)
]
NEEDED = [*FILES, "manifest.pt"]


def nodes(
    directory: Path,
    disks: list[Path],
    *args: str,
    planned: int | None = None,
    own: dict[int, list[str]] | None = None,
    during: Callable[[list[subprocess.Popen]], None] | None = None,
) -> list:
    """A job of len(disks) "nodes" on this machine, one rank each: node i's checkpoint
    directory is disks[i] (its disk, or one directory they all see) and its name node-i;
    own[i], arguments of node i's alone; `during(processes)` called while they run."""
    extra = {"TMN_PLANNED_WORLD_SIZE": str(planned)} if planned else {}
    return local_nodes(
        directory,
        "torch_multinode.training.fsdp",
        len(disks),
        lambda i: [
            *SMALL,
            *BATCH,
            *args,
            *(own or {}).get(i, []),
            "--checkpoint-dir",
            str(disks[i]),
        ],
        lambda i: extra,
        during,
    )


def _killed_mid_copy(directory: Path, index: int) -> Callable[[list[subprocess.Popen]], None]:
    """Kills node `index` (its torchrun and rank), and then the others
    (kill_node_then_the_others), once the next node has begun to receive one of its files into
    `directory` (a temporary file of that name there)."""
    prefixes = (f".__{index}_0.distcp.", f".rank-{index:05d}.pt.")

    def copy_began() -> bool:
        return directory.is_dir() and any(
            p.name.startswith(prefixes) and p.name.endswith(".tmp") for p in directory.iterdir()
        )

    def watch(processes: list[subprocess.Popen]) -> None:
        wait_until(copy_began, 150, f"no copy of node-{index}'s files began", every=0.01)
        kill_node_then_the_others(processes, index)

    return watch


@pytest.mark.extended
def test_two_survivors_of_three_nodes_resume_from_what_they_hold_between_them(tmp_path):
    disks = [tmp_path / f"disk-{index}" for index in range(3)]
    first = nodes(tmp_path, disks, "--stop-after-step", "12")
    assert all(f"exitcode  : {STOP_EXIT_CODE}" in run.stderr for run in first), first[0].explain()
    assert first[0].lines("checkpoint step 10 written") == [
        f"checkpoint step 10 written to {disks[0]}/step-00000010 (node-local disks: each node "
        "holds its own ranks' shards, copied to the next node in the background)"
    ]
    for index in range(3):  # its own rank's files and its predecessor's in the ring
        names = {p.name for p in (disks[index] / "step-00000010").iterdir()}
        own = {f"__{index}_0.distcp", f"rank-0000{index}.pt"}
        previous = {f"__{(index - 1) % 3}_0.distcp", f"rank-0000{(index - 1) % 3}.pt"}
        assert names == {".metadata", "manifest.pt", *own, *previous}, index

    # The reference: step 10 complete in one directory both ranks see (storage every node
    # sees), resharded 3 -> 2 with the planned world's batch.
    shared = tmp_path / "shared"
    (shared / "step-00000010").mkdir(parents=True)
    for disk in disks:
        shutil.copytree(disk / "step-00000010", shared / "step-00000010", dirs_exist_ok=True)
    reference = nodes(tmp_path, [shared, shared], planned=3)
    assert all(run.returncode == 0 for run in reference), reference[0].explain()

    shutil.rmtree(disks[2])  # node-2's disk is lost
    # The survivors go on to step 20, and there node-1 dies in the middle of a copy: killed
    # (its torchrun and rank) once node-0 has begun to receive its files of step 20, which
    # node-1 sends slowly (--replication-mbps 0.3: seconds between two files).
    last = disks[0] / "step-00000020"
    survivors = nodes(
        tmp_path,
        disks[:2],
        "--collective-timeout",  # what waits on the dead node gives up within 30 s
        "30",
        planned=3,
        own={1: ["--replication-mbps", "0.3"]},
        during=_killed_mid_copy(last, 1),
    )
    assert survivors[1].returncode == -signal.SIGKILL, survivors[1].explain()
    cut = survivors[0].lines("replication of checkpoint step 20 with node-1")
    assert cut, survivors[0].explain()
    assert survivors[0].lines("checkpoint step 10:") == [
        "checkpoint step 10: node-0's directory lacked 2 files, copied from node-1; node-1's "
        "directory lacked 2 files, copied from node-0"
    ]
    assert survivors[0].lines("resharded") == [
        "resharded step 10 from world size 3 to 2: each rank read the parts of the saved "
        "shards it now holds"
    ]
    for disk in disks[:2]:  # every file of step 10 on both survivors, fetched at the resume
        assert {p.name for p in (disk / "step-00000010").iterdir()} == set(NEEDED)
    found, expected = progress(survivors[0].stdout), progress(reference[0].stdout)
    assert sorted(found) == sorted(expected) == list(range(11, STEPS + 1))
    for step, (loss, _) in found.items():
        assert loss == pytest.approx(expected[step][0], abs=1e-4), step

    # node-1's disk is lost with it. On node-0 the copy cut short left node-1's files of step
    # 20 incomplete, one under a temporary name. With a fresh node (an empty disk) beside
    # node-0, step 20 is complete nowhere; step 15 is (its copy had finished), and the job
    # goes on from there to the losses it had before.
    held = sorted(p.name for p in last.iterdir())
    assert "rank-00001.pt" not in held and any(n.endswith(".tmp") for n in held), held
    shutil.rmtree(disks[1])
    again = nodes(tmp_path, [disks[0], tmp_path / "disk-fresh"], planned=3)
    assert all(run.returncode == 0 for run in again), again[0].explain()
    assert again[0].lines("checkpoint step 15") == [
        "checkpoint step 15 (step 20 is not complete on these nodes): node-1's directory "
        "lacked 4 files, copied from node-0"
    ]
    assert not list(disks[0].rglob("*.tmp"))  # the cut copy's temporary file swept
    resumed = progress(again[0].stdout)
    assert sorted(resumed) == list(range(16, STEPS + 1))
    for step, (loss, _) in resumed.items():
        assert loss == pytest.approx(found[step][0], abs=1e-4), step


def test_a_directory_sends_what_its_ranks_wrote():
    assert replicate.written_by(FILES, (1,)) == ["__1_0.distcp", "rank-00001.pt"]
    assert replicate.written_by([*FILES, "__1_1.distcp"], (0, 1)) == [
        "__0_0.distcp",
        "__1_0.distcp",
        "__1_1.distcp",
        "rank-00000.pt",
        "rank-00001.pt",
    ]
    # Two ranks on a node share a directory: the ring is the directories, by lowest rank.
    assert replicate.directories([(2, 3), (0, 1), (0, 1), (2, 3), (4,)]) == [(0, 1), (2, 3), (4,)]


def held_after_a_ring_copy(lost: set[int], copied: bool = True) -> dict[int, dict[int, set]]:
    """Directory -> step -> files, three one-rank nodes, the ring's copies done, `lost` gone."""
    held = {}
    for node in set(range(3)) - lost:
        writers = {node, (node - 1) % 3} if copied else {node}
        held[node] = {10: {".metadata", "manifest.pt"} | set(replicate.written_by(FILES, writers))}
    return held


def test_the_newest_step_complete_on_the_union_is_chosen():
    assert replicate.usable_step(held_after_a_ring_copy({2}), {10: NEEDED}) == 10
    assert replicate.usable_step(held_after_a_ring_copy(set()), {10: NEEDED}) == 10
    # Two nodes lost at once, or one lost before its first copy: not complete.
    assert replicate.usable_step(held_after_a_ring_copy({1, 2}), {10: NEEDED}) is None
    assert replicate.usable_step(held_after_a_ring_copy({2}, copied=False), {10: NEEDED}) is None
    # An older complete step is chosen over a newer incomplete one.
    held = held_after_a_ring_copy({2})
    held[0][15] = {".metadata", "manifest.pt", "__0_0.distcp", "rank-00000.pt"}
    assert replicate.usable_step(held, {10: NEEDED, 15: NEEDED}) == 10


def test_a_step_the_survivors_cannot_complete_is_one_line_naming_the_lost_files_and_why():
    """node-2 lost before its first copy finished: node-0 and node-1 hold 6 of step 10's 8
    files between them, and the resume stops saying which files and what replicas cover."""
    store = SimpleNamespace(
        layout=SimpleNamespace(nodes=("node-0", "node-1", "node-2")), directory=Path("/ckpt")
    )
    replication = replicate.Replication(store, 500, 60)
    replication.ring = [(0,), (1,)]
    error = replication._incomplete(10, held_after_a_ring_copy({2}, copied=False), NEEDED)
    assert error.line() == (
        "Error: checkpoint step 10 in /ckpt: the nodes of this run (node-0, node-1) hold 6 of "
        "its 8 files between them, and no older step complete (lost: __2_0.distcp, "
        "rank-00002.pt); each node's files are copied to one other node after each "
        "checkpoint, which covers one lost node, not two at once nor one lost before its "
        "first copy (try the lost node's disk back, or --no-resume to start over)"
    )


def test_every_rank_joins_the_replicas_group_so_that_none_waits_in_an_nccl_split(monkeypatch):
    """2 nodes x 2 GPUs: only ranks 0 and 2 copy, yet all four are members. Under NCCL the
    job's group is bound to each rank's GPU, and torch 2.14.1 makes a rank left out of a new
    group (gloo or not) join an ncclCommSplit that the gloo group's members never call: ranks
    1 and 3 would wait in it for ever."""
    made = []
    monkeypatch.setattr(
        replicate.dist, "new_group", lambda *args, **kwargs: made.append((args, kwargs)) or "g"
    )
    layout = SimpleNamespace(seen=((0, 1), (0, 1), (2, 3), (2, 3)))
    replication = replicate.Replication(SimpleNamespace(layout=layout), 500, 60)
    replication.open()
    assert replication.ring == [(0, 1), (2, 3)] and replication.group == "g"
    assert len(made) == 1
    args, kwargs = made[0]
    assert args == () and set(kwargs) == {"backend", "timeout"}, made
    assert kwargs["backend"] == "gloo" and kwargs["timeout"].total_seconds() == 60
    replication.open()  # once per run
    assert len(made) == 1


def test_each_directory_fetches_what_it_lacks_from_the_lowest_that_holds_it():
    held = {node: steps[10] for node, steps in held_after_a_ring_copy({2}).items()}
    assert replicate.transfers(held, NEEDED) == {
        (1, 0): ["__1_0.distcp", "rank-00001.pt"],
        (0, 1): ["__2_0.distcp", "rank-00002.pt"],
    }
    # A spare with an empty directory gets everything, each file from the lowest holder.
    held[2] = set()
    plan = replicate.transfers(held, NEEDED)
    assert plan[(0, 2)] == [
        ".metadata",
        "__0_0.distcp",
        "__2_0.distcp",
        "manifest.pt",
        "rank-00000.pt",
        "rank-00002.pt",
    ]
    assert plan[(1, 2)] == ["__1_0.distcp", "rank-00001.pt"]
    # At the world size it was saved at (no resharding) a directory fetches only what its own
    # ranks load: a spare in node-2's place gets rank 2's files, the index and the manifest.
    ranks = {0: (0,), 1: (1,), 2: (2,)}
    assert replicate.transfers(held, NEEDED, ranks) == {
        (0, 2): [".metadata", "__2_0.distcp", "manifest.pt", "rank-00002.pt"]
    }
    assert replicate.transfers({0: set(NEEDED), 1: set(NEEDED)}, NEEDED) == {}


def test_a_received_file_takes_its_name_only_once_complete(tmp_path):
    target = tmp_path / "__1_0.distcp"
    target.write_bytes(b"old")
    cut = transfer.AtomicFile(target)
    cut.write(b"half of")
    assert target.read_bytes() == b"old"  # a half-received file never takes the name
    cut.abort()
    assert [p.name for p in tmp_path.iterdir()] == ["__1_0.distcp"]
    whole = transfer.AtomicFile(target)
    whole.write(b"new ")
    whole.write(b"bytes")
    whole.commit()
    assert target.read_bytes() == b"new bytes"
    assert target.stat().st_mode & 0o777 == 0o644  # not mkstemp's 0600
    assert [p.name for p in tmp_path.iterdir()] == ["__1_0.distcp"]


def test_the_stream_of_files_arrives_whole_and_an_absent_file_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(transfer, "CHUNK", 4)
    source, target = tmp_path / "from", tmp_path / "to"
    source.mkdir()
    target.mkdir()
    (source / "a").write_bytes(b"0123456789")
    (source / "b").write_bytes(b"")
    failed: list[str] = []
    outgoing = transfer.sending(source, ["a", "b", "c"])
    incoming = transfer.receiving(target, ["a", "b", "c"], failed)
    pieces = 0
    for buffer in incoming:  # what the gloo group carries, one tensor at a time
        buffer.copy_(next(outgoing))
        pieces += 1
    assert next(outgoing, None) is None
    assert pieces == 4  # the sizes, then 10 bytes in pieces of 4
    assert (target / "a").read_bytes() == b"0123456789" and (target / "b").read_bytes() == b""
    assert failed == ["c (absent on the sender)"]
    assert sorted(p.name for p in target.iterdir()) == ["a", "b"]
