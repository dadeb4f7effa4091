"""The slow-rank warning's rule (training/loop/pace.py: OwnTime, own_work, slow_ranks) with
constructed per-rank numbers (issue 49): ranks that share a node share its cores, so a rank's
own wait for a CPU there is chance, not its work; a rank slower by work of its own is still
named, on one node or on several, and so is a busy node among idle ones."""

from __future__ import annotations

import pytest

from torch_multinode.training.loop import pace


def named(per_rank: list[tuple[float, float, str]]) -> list[int]:
    """The ranks the warning names, at the default factor, from (seconds, waited, node)."""
    return [slow.rank for slow in pace.slow_ranks(pace.own_work(per_rank), 1.5)]


def test_two_local_ranks_on_a_loaded_cpu_are_not_called_slow():
    # One machine, two busy cores: rank 1 waited 0.15 s per step for a CPU, rank 0 0.01 s;
    # the work of each is the same 0.10 s.
    per_rank = [(0.11, 0.01, "vm"), (0.25, 0.15, "vm")]
    measured = [(seconds, node) for seconds, _, node in per_rank]
    assert [s.rank for s in pace.slow_ranks(measured, 1.5)] == [1]  # the spurious warning
    assert named(per_rank) == []


def test_a_rank_slower_by_its_own_work_is_named_on_a_shared_node():
    # --step-delay on rank 1: a sleep, not a wait for a CPU; both waited a little for one.
    assert named([(0.11, 0.01, "vm"), (1.12, 0.02, "vm")]) == [1]
    # ...and while the CPU is oversubscribed too: its wait is left out, its sleep is not.
    found = pace.slow_ranks(pace.own_work([(0.30, 0.20, "vm"), (1.10, 0.05, "vm")]), 1.5)
    assert [(s.rank, s.node) for s in found] == [(1, "vm")]
    assert found[0].seconds == pytest.approx(1.175) and found[0].others == pytest.approx(0.225)


def test_ranks_on_different_nodes_compare_their_time_as_measured():
    # The cluster's case (tests/training/test_faults.py: rank 1 on node2 sleeps 1 s a step).
    per_rank = [(0.05, 0.0, "node1"), (1.06, 0.0, "node2")]
    assert pace.own_work(per_rank) == [(0.05, "node1"), (1.06, "node2")]
    assert named(per_rank) == [1]
    # A node busy with other work holds the others up: its rank is named, waits and all.
    assert named([(0.05, 0.0, "node1"), (0.40, 0.35, "node2")]) == [1]


def test_a_busy_node_among_idle_ones_is_named_whatever_its_ranks_share():
    # Two ranks a node; node2's both wait for a CPU (another job runs there): both named.
    per_rank = [
        (0.10, 0.00, "node1"),
        (0.10, 0.01, "node1"),
        (0.45, 0.35, "node2"),
        (0.40, 0.30, "node2"),
    ]
    assert named(per_rank) == [2, 3]
    # Within node2, how the wait fell between its ranks does not matter: the node's median.
    assert pace.own_work(per_rank)[2:] == [
        (pytest.approx(0.425), "node2"),
        (pytest.approx(0.425), "node2"),
    ]


def test_own_time_keeps_each_steps_wait_for_a_cpu_within_its_own_windows():
    now, waited = [0.0], [0.0]
    own = pace.OwnTime(clock=lambda: now[0], waited=lambda: waited[0])
    for step_wait in (0.1, 0.3, 0.2):
        own.resume()
        now[0] += 1.0
        waited[0] += step_wait  # runnable, not running, during its own work
        own.pause()  # a collective: waiting for the other ranks is not its own time
        now[0] += 5.0
        waited[0] += 2.0  # nor is a wait for a CPU in there
        own.resume()
        now[0] += 0.5
        own.end_step()
    assert own.take() == (pytest.approx(1.5), pytest.approx(0.2))  # the medians of the steps
    assert own.take() == (0.0, 0.0)  # afresh


def test_with_the_detector_off_no_clock_is_read_and_nothing_is_kept():
    def never() -> float:
        raise AssertionError("read with --slow-rank-factor 0")

    own = pace.Untimed(clock=never, waited=never)
    own.resume()
    own.pause()
    own.resume()
    own.end_step()
    assert own.take() == (0.0, 0.0) and own.steps == []


def test_the_cpu_wait_is_this_threads_run_queue_time_or_nothing():
    first = pace.cpu_wait()
    assert first >= 0.0 and pace.cpu_wait() >= first
