"""A hang, judged from its stacks (launch.hang) and noticed by its clock (launch.progress),
without a cluster: the stacks are what `py-spy dump --full-filenames` printed in the training
image (its format checked there: "Thread N (idle): NAME", then "    function (file:line)")."""

from __future__ import annotations

import shlex
import subprocess

import pytest

from tests.helpers import unique_run_id
from torch_multinode.launch import hang
from torch_multinode.launch.progress import HEARTBEAT, STALL_FLOOR, Progress

SITE = "/opt/venv/lib/python3.11/site-packages"
WORKDIR = "/tmp/torch-multinode/projects/proj"


def dump(pid: int, *frames: str, thread: str = "MainThread") -> str:
    lines = [f"Process {pid}: python3 -u train.py", "Python v3.11.2 (/usr/bin/python3.11)", ""]
    lines.append(f'Thread {pid} (idle): "{thread}"')
    lines += [f"    {frame}" for frame in frames]
    lines.append(f'Thread {pid + 3} (idle): "pt_elastic"')
    lines.append("    Thread.run (/usr/lib/python3.11/threading.py:975)")
    return "\n".join(lines)


def in_all_reduce(pid: int, line: int = 21) -> str:
    return dump(
        pid,
        f"all_reduce ({SITE}/torch/distributed/distributed_c10d.py:3013)",
        f"_exception_logger.<locals>.wrapper ({SITE}/torch/distributed/c10d_logger.py:83)",
        f"<module> ({WORKDIR}/train.py:{line})",
    )


def sleeping(pid: int) -> str:
    return dump(
        pid,
        f"load_batch ({WORKDIR}/mylib/data.py:7)",
        f"<module> ({WORKDIR}/train.py:19)",
    )


def node(*ranks: tuple[int, int, str]) -> str:
    return "\n".join(f"{hang.MARK} rank {rank} pid {pid}\n{text}" for rank, pid, text in ranks)


def test_a_rank_asleep_in_its_data_loading_is_named_with_its_line_and_the_others_wait():
    ranks = hang.parse("node1", node((0, 40, in_all_reduce(40))))[0]
    ranks += hang.parse("node2", node((1, 41, sleeping(41))))[0]
    verdict = hang.judge(ranks, {}, WORKDIR)
    assert [r.rank for r in verdict.culprits] == [1]
    assert verdict.culprits[0].node == "node2"
    assert verdict.lines == [
        "rank 0 on node1: waits in all_reduce, called at train.py:21 in <module>",
        "rank 1 on node2: not in a collective, at mylib/data.py:7 in load_batch",
    ]
    assert verdict.cause == (
        "rank 1 (node2) not in a collective (rank 1 at mylib/data.py:7 in load_batch) while "
        "rank 0 (node1) waits in all_reduce"
    )


def test_a_rank_waiting_inside_our_measure_of_its_waits_is_placed_at_its_own_call():
    """training.distributed.waits waits for a blocking collective in the process group's hook,
    inside the script's call: that frame, innermost, is neither the rank's place nor its line."""
    tool = "/tmp/torch-multinode/runs/tmn-1/tools/torch_multinode"
    waiting = dump(
        40,
        f"_wait ({tool}/training/distributed/waits.py:112)",
        f"post_hook ({tool}/training/distributed/waits.py:95)",
        f"all_reduce ({SITE}/torch/distributed/distributed_c10d.py:3013)",
        f"_exception_logger.<locals>.wrapper ({SITE}/torch/distributed/c10d_logger.py:83)",
        f"<module> ({WORKDIR}/train.py:21)",
    )
    ranks = hang.parse("node1", node((0, 40, waiting)))[0]
    ranks += hang.parse("node2", node((1, 41, sleeping(41))))[0]
    found = hang.place(ranks[0])
    assert (found.kind, found.op) == ("collective", "all_reduce")
    assert found.line == hang.Frame("<module>", f"{WORKDIR}/train.py", 21)
    assert "waits.py" not in found.innermost.file
    verdict = hang.judge(ranks, {}, WORKDIR)
    assert (
        verdict.lines[0]
        == "rank 0 on node1: waits in all_reduce, called at train.py:21 in <module>"
    )
    assert [r.rank for r in verdict.culprits] == [1]


def test_ranks_in_different_collectives_are_named_with_both():
    broadcast = dump(
        51,
        f"broadcast ({SITE}/torch/distributed/distributed_c10d.py:2790)",
        f"_exception_logger.<locals>.wrapper ({SITE}/torch/distributed/c10d_logger.py:83)",
        f"<module> ({WORKDIR}/train.py:24)",
    )
    ranks = hang.parse("node1", node((0, 50, in_all_reduce(50))))[0]
    ranks += hang.parse("node2", node((1, 51, broadcast)))[0]
    verdict = hang.judge(ranks, {}, WORKDIR)
    assert verdict.culprits == []
    assert verdict.cause == (
        "ranks wait in different collectives: rank 0 (node1) in all_reduce; rank 1 (node2) in "
        "broadcast"
    )


def test_a_rank_in_backward_counts_as_waiting_and_a_busy_rank_is_named():
    backward = dump(
        60,
        f"_engine_run_backward ({SITE}/torch/autograd/graph.py:841)",
        f"backward ({SITE}/torch/autograd/__init__.py:364)",
        f"backward ({SITE}/torch/_tensor.py:648)",
        f"train_step ({WORKDIR}/train.py:30)",
    )
    busy = dump(61, f"spin ({WORKDIR}/train.py:12)", f"train_step ({WORKDIR}/train.py:28)")
    ranks = hang.parse("node1", node((0, 60, backward), (1, 61, busy)))[0]
    verdict = hang.judge(ranks, {}, WORKDIR)
    assert [r.rank for r in verdict.culprits] == [1]
    assert verdict.lines[0].startswith("rank 0 on node1: in backward")
    assert "rank 1 at train.py:12 in spin" in verdict.cause


def test_a_node_whose_stacks_cannot_be_read_is_said_and_blamed_when_the_others_wait():
    ranks = hang.parse("node1", node((0, 70, in_all_reduce(70))))[0]
    verdict = hang.judge(ranks, {"node2": "Connection refused"}, WORKDIR)
    assert "node2: no stacks (Connection refused)" in verdict.lines
    assert "no stacks from node2, the likely cause" in verdict.cause


def test_what_the_collection_says_instead_of_stacks_is_kept():
    ranks, problem = hang.parse("node1", f"{hang.MARK} {hang.NO_PY_SPY}\n")
    assert (ranks, problem) == ([], hang.NO_PY_SPY)
    assert "pip install py-spy==" in problem
    failed = f"{hang.MARK} rank 0 pid 9\nError: Operation not permitted (os error 1)\n"
    failed += f"{hang.MARK} py-spy failed: exit 1\n"
    ranks, problem = hang.parse("node1", failed)
    assert problem is None and ranks[0].problem == "Error: Operation not permitted (os error 1)"
    assert hang.judge(ranks, {}).cause == "no rank's stacks could be read"


def test_the_collection_finds_the_ranks_of_this_run_only_and_not_their_workers(tmp_path):
    """STACKS_SCRIPT on this machine, with a stand-in for py-spy: a rank of this run, its
    DataLoader-like child (RANK inherited), a rank of another run and one of a restart's."""
    spy = tmp_path / "py-spy"
    spy.write_text('#!/bin/sh\necho "dumped $4"\n')
    spy.chmod(0o755)
    run = unique_run_id()
    start = "TMN_RUN_ID={run} RANK={rank} sh -c 'sleep 37.123 & wait' & "  # a rank with a child
    script = (
        start.format(run=run, rank=3)
        + start.format(run=unique_run_id(), rank=5)
        + start.format(run=f"{run}-r1", rank=6)
        + "sleep 0.5; "
        + shlex.join(["sh", "-c", hang.STACKS_SCRIPT, "x", str(spy), run])
        + "; kill $(jobs -p) 2>/dev/null; pkill -f 'sleep 37.123'; true"
    )
    out = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=30).stdout
    marks = [line for line in out.splitlines() if line.startswith(hang.MARK)]
    assert len(marks) == 1 and marks[0].startswith(f"{hang.MARK} rank 3 pid "), out
    assert "dumped" in out


def test_the_ranks_of_a_node_are_dumped_at_once_and_printed_whole(tmp_path):
    """8 ranks of 10 s each, one after another, could outlast a node's whole collection: the
    dumps run at once. The stand-in py-spy waits (up to 5 s) until both have started, and says
    how many it saw; each rank's section is printed whole."""
    spy = tmp_path / "py-spy"
    started = tmp_path / "started"
    spy.write_text(
        "#!/bin/sh\n"
        f'echo "$4" >> {started}\n'
        "i=0\n"
        f"while [ $(wc -l < {started}) -lt 2 ] && [ $i -lt 50 ]; do sleep 0.1; i=$((i + 1)); done\n"
        f'echo "dumped $4 beside $(wc -l < {started})"\n'
    )
    spy.chmod(0o755)
    run = unique_run_id()
    start = f"TMN_RUN_ID={run} RANK={{rank}} sh -c 'sleep 37.321 & wait' & "
    script = (
        start.format(rank=3)
        + start.format(rank=4)
        + "sleep 0.5; "
        + shlex.join(["sh", "-c", hang.STACKS_SCRIPT, "x", str(spy), run])
        + "; kill $(jobs -p) 2>/dev/null; pkill -f 'sleep 37.321'; true"
    )
    out = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=30).stdout
    lines = out.splitlines()
    marks = [i for i, line in enumerate(lines) if line.startswith(f"{hang.MARK} rank ")]
    assert len(marks) == 2, out
    for i in marks:  # each rank's mark, then its own dump
        pid = lines[i].rsplit(" ", 1)[1]
        assert lines[i + 1] == f"dumped {pid} beside 2", out


def test_the_command_runs_in_the_jobs_container_in_container_mode():
    words = shlex.split(hang.stacks_command("tmn-x", "py-spy", "tmn-x-node1"))
    assert words[:3] == ["docker", "exec", "tmn-x-node1"]
    assert words[-3:] == ["py-spy", "tmn-x", "-"]
    on_gpus = shlex.split(hang.stacks_command("tmn-x", "/opt/v/bin/py-spy", None, native=True))
    assert on_gpus[0] == "sh" and on_gpus[-1] == "native"


# What py-spy 0.4.3 printed with --native on an H200 (driver 580.159.04, torch 2.11.0+cu130) for
# a process whose GPU was busy with a long kernel when it asked for a result (.item()), and for
# one asleep in time.sleep (C++ names shortened).
GPU_WAIT = """\
Process 488: python3 /tmp/gpuwait.py
Python v3.12.3 (/usr/bin/python3.12)

Thread 488 (active): "MainThread"
    0x7f832c214820 (/usr/local/nvidia/lib64/libcuda.so.580.159.04)
    0x7f832bfd36c3 (/usr/local/nvidia/lib64/libcuda.so.580.159.04)
    cuLaunchKernel (/usr/local/nvidia/lib64/libcuda.so.580.159.04)
    0x7f8357e1376d (/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib/libcudart.so.13)
    cudaLaunchKernel (/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib/libcudart.so.13)
    at::native::gpu_reduce_kernel<float, float, 4, 4, float (float, float), > >, double> \
(/opt/torch/.venv/lib/python3.12/site-packages/torch/lib/libtorch_cuda.so)
    at::native::structured_sum_out::impl (/opt/torch/.venv/lib/python3.12/site-packages/torch/lib/libtorch_cpu.so)
    torch::autograd::THPVariable_sum (/opt/torch/.venv/lib/python3.12/site-packages/torch/lib/libtorch_python.so)
    wait_on_gpu (/tmp/gpuwait.py:6)
    <module> (/tmp/gpuwait.py:7)
    0x7f8358e2a1ca (/usr/lib/x86_64-linux-gnu/libc.so.6)
"""
ASLEEP = """\
Process 523: python3 /tmp/sleepy.py
Python v3.12.3 (/usr/bin/python3.12)

Thread 523 (idle): "MainThread"
    clock_nanosleep (/usr/lib/x86_64-linux-gnu/libc.so.6)
    asleep (/tmp/sleepy.py:3)
    <module> (/tmp/sleepy.py:4)
    0x7f4e62c2a1ca (/usr/lib/x86_64-linux-gnu/libc.so.6)
"""


def test_on_gpus_a_rank_waiting_for_its_gpu_waits_and_a_sleeping_one_is_named():
    """With NCCL a collective returns at once: the waiting rank is found in libcuda at its next
    synchronisation, the native frames say so (read on an H200, see GPU_WAIT)."""
    ranks = hang.parse("gpu1", node((0, 488, GPU_WAIT)))[0]
    ranks += hang.parse("gpu2", node((1, 523, ASLEEP)))[0]
    assert len(ranks[0].main) == 11  # the long C++ name, its parentheses included, is one frame
    verdict = hang.judge(ranks, {}, "/tmp")
    assert verdict.lines == [
        "rank 0 on gpu1: waits for its GPU (a collective or kernel queued there), called at "
        "gpuwait.py:6 in wait_on_gpu",
        "rank 1 on gpu2: not in a collective, at sleepy.py:3 in asleep",
    ]
    assert [r.rank for r in verdict.culprits] == [1]
    assert verdict.cause.endswith("while rank 0 (gpu1) waits in a collective queued on the GPU")


# --- the clock ----------------------------------------------------------------------------------


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_step_lines_set_the_default_stall_and_other_output_does_not_count_once_seen():
    clock = Clock()
    progress = Progress(None, clock)
    assert progress.threshold() is None  # before any progress: the timeouts' business
    clock.now = 1000.0
    assert progress.stalled() is None
    for step in range(1, 6):
        clock.now += 60.0
        progress.note(f"step {step}/100  loss 0.5")
    assert progress.threshold() == 300.0  # 5 x the median 60 s
    clock.now += 200.0
    progress.note("a warning a waiting rank prints")
    clock.now += 101.0
    assert progress.stalled() == pytest.approx(301.0)


def test_the_floor_applies_to_fast_steps_and_output_alone_sets_no_default():
    clock = Clock()
    progress = Progress(None, clock)
    for step in range(1, 6):
        clock.now += 1.0
        progress.note(f"step {step}/10")
    assert progress.threshold() == STALL_FLOOR
    clock.now += STALL_FLOOR - 1
    assert progress.stalled() is None
    clock.now += 1
    assert progress.stalled() == STALL_FLOOR
    sparse = Progress(None, clock)  # the selftest: a header, then minutes of work, then a table
    sparse.note("selftest: 2 rank(s) on 2 node(s), gloo, cpu")
    clock.now += 10 * STALL_FLOOR
    assert sparse.threshold() is None and sparse.stalled() is None


def test_a_given_stall_counts_once_progress_was_seen_output_included_and_a_heartbeat_is_hidden():
    clock = Clock()
    progress = Progress(30.0, clock)
    clock.now = 100.0  # a slow start (a container, torch's import) is not a stall
    assert progress.threshold() is None and progress.stalled() is None
    assert progress.note("rank 1 runs on node2") is True
    clock.now = 129.0
    assert progress.stalled() is None
    clock.now = 131.0
    assert progress.stalled() == 31.0
    assert progress.note(HEARTBEAT) is False and progress.note("step 1/2") is True
    assert progress.stalled() is None
    assert Progress(0.0, clock).threshold() is None  # STALL=0: never
