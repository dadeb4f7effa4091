"""A quiet job whose every rank is idle is a hang by default (launch.idle, launch.progress): the
counters read on a node, the judgement, and the watch that says it."""

from __future__ import annotations

import shlex
import subprocess
import threading

from tests.helpers import unique_run_id
from torch_multinode.launch import hang, idle
from torch_multinode.launch.progress import Progress, until_hang
from torch_multinode.launch.spec import JobSpec

WINDOW = idle.IDLE_WINDOW


def counters(**ranks: tuple[float, int]) -> idle.Processes:
    """rN=(cpu, io): rank N's own process (pid 100 + N)."""
    return {
        (int(r[1:]), 100 + int(r[1:])): idle.Counters(cpu, io) for r, (cpu, io) in ranks.items()
    }


def test_every_rank_idle_is_idle_and_one_that_computes_or_moves_bytes_is_not():
    before = counters(r0=(10.0, 5000), r1=(12.0, 7000))
    assert idle.idle(before, counters(r0=(10.1, 5100), r1=(12.0, 7000)), WINDOW)
    assert not idle.idle(before, counters(r0=(10.0, 5000), r1=(13.5, 7000)), WINDOW)  # computes
    # a checkpoint written to a network filesystem: no CPU to speak of, but bytes
    assert not idle.idle(before, counters(r0=(10.0, 5000), r1=(12.1, 7000 + 10**6)), WINDOW)
    # a rank seen once (ended, or a restart's) settles nothing; no rank at all neither
    assert not idle.idle(before, counters(r0=(10.0, 5000)), WINDOW)
    assert not idle.idle({}, {}, WINDOW)
    # a rank waits while its DataLoader worker reads: the worker's bytes count; a worker that
    # ended, or a new one, is activity too
    worker = {(1, 300): idle.Counters(1.0, 10**6)}
    assert not idle.idle(
        before | worker, before | {(1, 300): idle.Counters(1.0, 3 * 10**6)}, WINDOW
    )
    assert not idle.idle(before | worker, before | {(1, 301): idle.Counters(0.0, 0)}, WINDOW)
    said = idle.moved(before | worker, counters(r0=(10.1, 5100), r1=(12.0, 7000)) | worker)
    assert said == (
        "2 rank(s), 3 process(es), each at most 0.10 s of CPU and 100 bytes read or written"
    )


def test_a_look_reads_twice_a_window_apart_and_stops_when_the_job_ends():
    stuck = {0: "collective all_reduce train.py:12 in <module>", 1: "elsewhere - train.py:9"}

    def look(first, second, places=(stuck, stuck), ended=False):
        readings, where, waited = [first, second], list(places), []

        def wait(seconds: float) -> bool:
            waited.append(seconds)
            return ended

        said = idle.look(lambda: readings.pop(0), lambda: where.pop(0), wait)
        return said, waited

    same = counters(r0=(1.0, 10), r1=(2.0, 20))
    said, waited = look(same, same)
    assert (
        said == "2 rank(s), 2 process(es), each at most 0.00 s of CPU and 0 bytes read or written"
    )
    assert waited == [WINDOW]
    assert look(same, same, ended=True)[0] is None  # the job ended meanwhile
    assert look({}, {})[0] is None  # no rank yet: the rendezvous
    assert look(same, counters(r0=(1.0, 10), r1=(3.0, 20)))[0] is None  # a rank computed
    # slow progress: idle by its counters, but rank 0 was caught in another place the second time
    moved = {0: "elsewhere - train.py:14 in <module>", 1: "elsewhere - train.py:9"}
    assert look(same, same, (stuck, moved))[0] is None
    # every rank asleep and none in a collective: no hang of collectives, not looked at twice
    asleep = {0: "elsewhere - train.py:14", 1: "elsewhere - train.py:9"}
    said, waited = look(same, same, (asleep, asleep))
    assert said is None and waited == []


def test_the_counters_are_of_this_runs_ranks_only_and_a_busy_one_uses_cpu():
    """COUNTERS_SCRIPT on this machine: a rank of this run asleep with its DataLoader-like child
    (RANK inherited, counted with it), a rank of another run and one of a restart's; a busy
    rank."""
    start = "TMN_RUN_ID={run} RANK={rank} sh -c '{body}' & "
    asleep = "sleep 41.5 & wait"
    busy = "i=0; while [ $i -lt 3000000 ]; do i=$((i+1)); done"  # about 4 s, then it ends
    run = unique_run_id()
    script = (
        start.format(run=run, rank=3, body=asleep)
        + start.format(run=unique_run_id(), rank=5, body=asleep)
        + start.format(run=f"{run}-r1", rank=6, body=asleep)
        + start.format(run=run, rank=4, body=busy)
        + "sleep 0.3; "
        + shlex.join(["sh", "-c", idle.COUNTERS_SCRIPT, "x", run])
        + "; sleep 1; "
        + shlex.join(["sh", "-c", idle.COUNTERS_SCRIPT, "x", run])
        + "; kill $(jobs -p) 2>/dev/null; pkill -f 'sleep 41.5'; true"
    )
    out = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=60).stdout
    first, second = (idle.parse(half) for half in _halves(out))
    assert first.keys() == second.keys(), out
    ranks = sorted(rank for rank, _ in first)
    assert ranks == [3, 3, 4], out  # rank 3's shell and its sleep, rank 4's shell
    busy = {key for key in first if key[0] == 4}
    asleep = first.keys() - busy
    assert all(second[k].cpu - first[k].cpu < 0.05 for k in asleep), out
    assert all(second[k].cpu - first[k].cpu > 0.3 for k in busy), out
    assert not idle.idle(first, second, 1.0)
    assert idle.idle({k: first[k] for k in asleep}, {k: second[k] for k in asleep}, 1.0)


def _halves(out: str) -> tuple[str, str]:
    lines = out.splitlines()
    ranks = [line for line in lines if line.startswith(idle.MARK)]
    return "\n".join(ranks[: len(ranks) // 2]), "\n".join(ranks[len(ranks) // 2 :])


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _spec(**overrides) -> JobSpec:
    return JobSpec(run_id="tmn-idle", **overrides)


def test_a_quiet_scripts_ranks_are_looked_at_after_a_while_and_all_idle_is_a_hang():
    clock = Clock()
    progress = Progress(None, clock)
    progress.note("epoch 1 of 100")  # a user's script: no step lines of our form
    clock.now = idle.IDLE_AFTER - 1
    assert not progress.idle_due()
    clock.now = idle.IDLE_AFTER + 1
    assert progress.idle_due()
    assert progress.describe() == f"no output for {idle.IDLE_AFTER + 1:.0f} s (every rank idle)"
    # STALL given, or 0, or a job with step lines: the look is not theirs
    assert not Progress(60.0, clock).idle_due() and not Progress(0.0, clock).idle_due()
    stepping = Progress(None, clock)
    stepping.note("step 1/10")
    assert not stepping.idle_due()

    said: list[str] = []
    verdict = hang.Verdict(["rank 1 on node2: not in a collective"], [], "rank 1 (node2) ...")
    found = until_hang(
        threading.Event(),
        lambda: progress,
        _spec(),
        said.append,
        lambda: verdict,
        "py-spy dump",
        lambda: "2 rank(s), 2 process(es), each at most 0.00 s of CPU and 0 bytes read or written",
    )
    assert found is verdict
    assert said == [
        f"[launcher] no output for {idle.IDLE_AFTER + 1:.0f} s and every rank idle for "
        f"{WINDOW:g} s (2 rank(s), 2 process(es), each at most 0.00 s of CPU and 0 bytes read or "
        "written): "
        "the job hangs; reading every rank's stacks..."
    ]


def test_a_rank_that_moved_is_no_hang_and_the_watch_goes_on_until_the_job_ends():
    clock = Clock()
    progress = Progress(None, clock)
    progress.note("epoch 1 of 100")
    clock.now = idle.IDLE_AFTER + 1
    done, looks = threading.Event(), []

    def look() -> str | None:
        looks.append(1)
        if len(looks) == 2:
            done.set()  # the job ends
        return None  # a rank computed

    def read() -> hang.Verdict:
        raise AssertionError("no stacks are read for a job whose ranks work")

    assert until_hang(done, lambda: progress, _spec(), print, read, "", look) is None
    assert len(looks) == 2
