"""The Flight Recorder in a hang report: the ranks write their traces when asked
(training.distributed.flight), the launcher reads each rank's last collective and names a
mismatch (launch.flight, launch.hang.judge). The real thing runs on this machine: two gloo ranks
over loopback that call different collectives, asked for their traces while they wait."""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import run_cli
from tests.launch.test_hang import in_all_reduce
from torch_multinode.cluster.jobenv import FLIGHT_DUMP, FLIGHT_REQUEST, FLIGHT_TIMEOUT_DUMP
from torch_multinode.launch import flight, hang
from torch_multinode.training.distributed import flight as node_flight

REPO = Path(__file__).resolve().parents[2]

# rank 0 broadcasts where rank 1 waits at a barrier: collective #3 does not match
MISMATCHED = """\
import datetime
import torch
import torch.distributed as dist
from torch_multinode.training.distributed import flight

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
flight.start()
rank = dist.get_rank()
t = torch.ones(1000)
dist.all_reduce(t)
dist.all_reduce(t)
print(f"rank {rank} ready", flush=True)
if rank == 0:
    dist.broadcast(t, 0)
else:
    dist.barrier()
"""


def entry(seq: int, name: str, sizes=((1000,),), p2p: bool = False) -> dict:
    return {
        "collective_seq_id": seq,
        "profiling_name": name,
        "input_sizes": [list(s) for s in sizes],
        "is_p2p": p2p,
        "process_group": ["0", "default_pg"],
    }


def trace(*entries: dict) -> str:
    return json.dumps({"entries": list(entries)})


def test_the_last_collective_of_each_rank_is_read_and_a_mismatch_named():
    text = "\n".join(
        [
            "=== tmn rank 0 pid 10",
            in_all_reduce(10),
            f"{flight.MARK} /r/{FLIGHT_DUMP.format(rank=0)}",
            trace(entry(1, "gloo:all_reduce"), entry(2, "gloo:all_reduce")),
            f"{flight.MARK} /r/{FLIGHT_DUMP.format(rank=1)}",
            trace(entry(1, "gloo:all_reduce"), entry(2, "gloo:barrier", sizes=())),
            f"{flight.MARK} /r/{FLIGHT_DUMP.format(rank=2)}",
            '{"entries": [',  # cut short: no collective for rank 2, nothing else lost
        ]
    )
    rest, flights = flight.split(text)
    assert flight.MARK not in rest and "=== tmn rank 0 pid 10" in rest
    assert flights == {
        0: flight.Collective(2, "all_reduce", "[[1000]]", "default_pg"),
        1: flight.Collective(2, "barrier", "", "default_pg"),
    }
    said = flight.mismatch(flights, {0: "node1", 1: "node2"})
    assert said == (
        "mismatched collectives: rank 0 (node1) in all_reduce #2 (sizes [[1000]]) while "
        "rank 1 (node2) in barrier #2"
    )
    # the same op and sizes at different sequence numbers is no mismatch (a rank behind)
    behind = {0: flights[0], 1: flight.Collective(1, "all_reduce", "[[1000]]", "default_pg")}
    assert flight.mismatch(behind, {}) is None


def test_the_verdict_names_the_mismatch_and_each_ranks_last_collective():
    ranks, _ = hang.parse("node1", "=== tmn rank 0 pid 10\n" + in_all_reduce(10))
    more, _ = hang.parse("node2", "=== tmn rank 1 pid 20\n" + in_all_reduce(20))
    flights = {
        0: flight.Collective(812, "all_reduce", "[[4]]", "default_pg"),
        1: flight.Collective(812, "broadcast", "[[4]]", "default_pg"),
    }
    verdict = hang.judge(ranks + more, {}, None, flights)
    assert verdict.cause == (
        "mismatched collectives: rank 0 (node1) in all_reduce #812 (sizes [[4]]) while "
        "rank 1 (node2) in broadcast #812 (sizes [[4]])"
    )
    assert verdict.lines[0].endswith("; last collective all_reduce #812 (sizes [[4]])")
    # without traces the verdict is the stacks' alone, as before
    assert "mismatched" not in hang.judge(ranks + more, {}, None).cause


def test_no_watcher_with_the_recorder_off_or_without_a_run_directory(tmp_path):
    environ = {"TMN_RUN_DIR": str(tmp_path), "RANK": "0"}
    assert node_flight.start({**environ, "TORCH_FR_BUFFER_SIZE": "0"}) is None
    assert node_flight.start(environ) is None
    assert node_flight.start({"RANK": "0", "TORCH_FR_BUFFER_SIZE": "8"}) is None


def _ranks_env(run_dir: Path) -> dict[str, str]:
    """Two gloo ranks' environment as the launcher gives it: our code importable, the run
    directory, the Flight Recorder on."""
    return {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "TMN_RUN_DIR": str(run_dir),
        "TORCH_FR_BUFFER_SIZE": "16",
        "OMP_NUM_THREADS": "1",
    }


def test_two_ranks_in_different_collectives_are_named_from_their_own_traces(tmp_path):
    script = tmp_path / "mismatched.py"
    script.write_text(MISMATCHED)
    env = _ranks_env(tmp_path)
    job = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
        + [str(script)],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        seen: list[str] = []
        # Counted in the whole output, not per line: the two ranks share the pipe, and one
        # rank's line can land before the other's newline ("rank 0 readyrank 1 ready").
        for line in job.stdout:
            seen.append(line)
            if "".join(seen).count(" ready") == 2:
                break
        assert "".join(seen).count(" ready") == 2, "".join(seen)[-3000:]
        time.sleep(1)  # both wait in their collective now
        assert not list(tmp_path.glob(FLIGHT_DUMP.format(rank="*")))  # nothing unasked
        subprocess.run(["sh", "-c", flight.request_command(str(tmp_path))], check=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if len(list(tmp_path.glob(FLIGHT_DUMP.format(rank="*")))) == 2:
                break
            time.sleep(0.2)
        printed = subprocess.run(
            ["sh", "-c", flight.collect_command(str(tmp_path))],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
    assert (tmp_path / FLIGHT_REQUEST).exists()
    _, flights = flight.split(printed)
    assert sorted(flights) == [0, 1], printed[:2000] + "".join(seen)[-2000:]
    assert flights[0].op == "broadcast" and flights[1].op == "barrier", flights
    assert flights[0].seq == flights[1].seq == 3
    said = flight.mismatch(flights, {0: "here", 1: "here"})
    assert said is not None and said.startswith(
        "mismatched collectives: rank 0 (here) in broadcast #3"
    )


def test_an_nccl_trace_as_an_h200_wrote_it_gives_its_last_collective():
    # _dump_nccl_trace_json(True, False) of one NCCL rank after three all_reduces, torch 2.11 on
    # an H200 (the fields read here, as it wrote them; only_active=True had left no entry)
    nccl = {
        "comm_lib_version": "2.28.9",
        "entries": [
            {
                "collective_seq_id": seq,
                "profiling_name": "nccl:all_reduce",
                "state": "completed",
                "input_sizes": [[4096]],
                "is_p2p": False,
                "process_group": ["0", "default_pg"],
            }
            for seq in (1, 2, 3)
        ],
        "pg_status": {"0": {"last_completed_collective": "-1", "last_enqueued_collective": "3"}},
        "version": "2.10",
    }
    assert flight.last_collective(nccl) == flight.Collective(
        3, "all_reduce", "[[4096]]", "default_pg"
    )
    assert flight.last_collective({"version": "2.10", "pg_status": {}}) is None  # no entry


def test_an_nccl_rank_waits_in_its_lowest_collective_not_completed_not_its_newest():
    """NCCL's collectives return at once: a rank queues a backward's buckets behind the one
    that blocks, each recorded as queued. The one it waits in is the lowest not completed."""

    def queued(seq: int, state: str, name: str = "nccl:all_reduce") -> dict:
        return {**entry(seq, name), "state": state}

    stuck = [queued(1, "completed"), queued(2, "scheduled"), queued(3, "scheduled")]
    behind = [*stuck, queued(4, "scheduled", "nccl:broadcast")]
    assert flight.last_collective({"entries": behind}).seq == 2
    other = [queued(1, "completed"), queued(2, "scheduled", "nccl:_broadcast_oop")]
    flights = {
        0: flight.last_collective({"entries": behind}),
        1: flight.last_collective({"entries": other}),
    }
    assert flight.mismatch(flights, {0: "node1", 1: "node2"}) == (
        "mismatched collectives: rank 0 (node1) in all_reduce #2 (sizes [[1000]]) while "
        "rank 1 (node2) in _broadcast_oop #2 (sizes [[1000]])"
    )
    # Every one completed: the newest (a rank between collectives).
    done = [queued(1, "completed"), queued(2, "completed")]
    assert flight.last_collective({"entries": done}).seq == 2


def test_sizes_that_differ_by_design_and_other_groups_are_no_mismatch():
    uneven = {
        0: flight.Collective(5, "all_to_all", "[[6]]", "default_pg"),
        1: flight.Collective(5, "all_to_all", "[[2]]", "default_pg"),
    }
    assert flight.mismatch(uneven, {}) is None
    groups = {
        0: flight.Collective(5, "all_reduce", "[[4]]", "default_pg"),
        1: flight.Collective(5, "broadcast", "[[4]]", "1"),
    }
    assert flight.mismatch(groups, {}) is None


# rank 1 skips an all_reduce: both ranks' next collective times out after 5 s and they die
TIMED_OUT = """\
import datetime
import torch
import torch.distributed as dist
from torch_multinode.training.distributed import flight

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=5))
flight.start()
rank = dist.get_rank()
t = torch.ones(4)
for _ in range(3):
    dist.all_reduce(t)
if rank == 0:
    dist.all_reduce(t)
else:
    dist.broadcast(t, 0)
"""


def test_ranks_that_die_of_a_collective_timeout_leave_their_traces_for_the_summary(tmp_path):
    script = tmp_path / "timed_out.py"
    script.write_text(TIMED_OUT)
    env = _ranks_env(tmp_path)
    job = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
        + [str(script)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = job.stdout + job.stderr
    assert job.returncode != 0 and "Timed out" in output, output[-3000:]
    # each rank wrote its trace as it died, unasked (no request was made)
    assert not (tmp_path / FLIGHT_REQUEST).exists()
    flights = flight.from_directory(tmp_path)
    assert sorted(flights) == [0, 1], output[-3000:]
    lines = flight.failure_lines(flights, {0: "node1", 1: "node2"})
    assert lines[1:] == [
        "  rank 0 (node1): all_reduce #4 (sizes [[4]])",
        "  rank 1 (node2): broadcast #4 (sizes [[4]])",
        "  mismatched collectives: rank 0 (node1) in all_reduce #4 (sizes [[4]]) while "
        "rank 1 (node2) in broadcast #4 (sizes [[4]])",
    ]
    # the exception itself is still reported as before
    assert "RuntimeError" in output


PICKLED = """\
import os, pathlib, pickle, sys
import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:0")
t = torch.ones(8)
dist.all_reduce(t)
dist.broadcast(t, 0)
# the pickle torch's watchdog writes on a timeout (TORCH_NCCL_DUMP_ON_TIMEOUT), the same
# dump as the Flight Recorder's Python-side pickle
pathlib.Path(sys.argv[1]).write_bytes(c10d._dump_fr_trace(True, True, False))
"""


def test_the_pickled_trace_torch_writes_on_a_timeout_is_read_and_nothing_else_unpickled(
    tmp_path,
):
    dumped = tmp_path / f"{FLIGHT_TIMEOUT_DUMP}0"
    subprocess.run(
        [sys.executable, "-c", PICKLED, str(dumped)],
        env={**os.environ, "TORCH_FR_BUFFER_SIZE": "16", "OMP_NUM_THREADS": "1"},
        check=True,
        timeout=120,
    )
    assert flight.from_directory(tmp_path) == {
        0: flight.Collective(2, "broadcast", "[[8]]", "default_pg")
    }
    # as a node's collection prints it: base64 on one line after the mark
    printed = subprocess.run(
        ["sh", "-c", flight.collect_command(str(tmp_path))], capture_output=True, text=True
    ).stdout
    assert flight.split(printed)[1][0].op == "broadcast"
    # a file that names a class is refused: reading a trace never runs a node's code
    dumped.write_bytes(pickle.dumps({"entries": [Path("/x")]}))
    assert flight.from_directory(tmp_path) == {}
    with pytest.raises(pickle.UnpicklingError, match="names no class"):
        flight.load_trace(dumped.read_bytes(), pickled=True)


# Written by NCCL's watchdog on an H200 (torch 2.11.0+cu130, NCCL 2.28.9; 2026-11-27) with
# TORCH_NCCL_DUMP_ON_TIMEOUT=1 and TORCH_FR_DUMP_TEMP_FILE as job_environment sets them: one rank
# whose all_reduce #2 waited behind a 100 s kernel (torch.cuda._sleep) timed out after 5 s.
H200_TIMEOUT_DUMP = Path(__file__).parent / "data" / "nccl-timeout-h200.pickle"


def test_the_pickle_nccls_watchdog_wrote_on_an_h200_names_the_timed_out_collective(tmp_path):
    content = H200_TIMEOUT_DUMP.read_bytes()
    trace = flight.load_trace(content, pickled=True)  # plain data only: no class named
    assert [(e["collective_seq_id"], e["state"]) for e in trace["entries"]] == [
        (1, "completed"),
        (2, "scheduled"),  # queued behind the kernel, never started: the timed-out one
    ]
    (tmp_path / f"{FLIGHT_TIMEOUT_DUMP}0").write_bytes(content)
    expected = {0: flight.Collective(2, "all_reduce", "[[1024]]", "default_pg")}
    assert flight.from_directory(tmp_path) == expected
    # as a node's collection prints it (base64 on one line after the mark) and the summary says
    printed = subprocess.run(
        ["sh", "-c", flight.collect_command(str(tmp_path))], capture_output=True, text=True
    ).stdout
    assert flight.split(printed)[1] == expected
    assert flight.failure_lines(expected, {0: "gpu1"}) == [
        "Last collectives (the Flight Recorder's traces, written as the ranks ended):",
        "  rank 0 (gpu1): all_reduce #2 (sizes [[1024]])",
    ]


def test_a_local_job_whose_collective_timed_out_names_the_mismatch_in_its_summary(tmp_path):
    (tmp_path / "timed_out.py").write_text(TIMED_OUT)
    done = run_cli(
        "train",
        "--script",
        str(tmp_path / "timed_out.py"),
        "--workdir",
        str(tmp_path),
        "--nproc-per-node",
        "2",
        timeout=300,
    )
    output = done.stdout + done.stderr
    run_dir = re.search(r"^Run directory: (\S+)", done.stdout, re.M)
    if run_dir:
        shutil.rmtree(run_dir.group(1), ignore_errors=True)
    assert done.returncode == 1, output[-3000:]
    summary = output[output.index("FAILED on this machine") :]
    assert (
        "Last collectives (the Flight Recorder's traces, written as the ranks ended):\n"
        "  rank 0 (this machine): all_reduce #4 (sizes [[4]])\n"
        "  rank 1 (this machine): broadcast #4 (sizes [[4]])\n"
        "  mismatched collectives: rank 0 (this machine) in all_reduce #4 (sizes [[4]]) while "
        "rank 1 (this machine) in broadcast #4 (sizes [[4]])\n"
    ) in summary, summary
