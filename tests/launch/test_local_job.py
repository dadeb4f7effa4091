"""A job with no inventory ends as a job on the nodes does: bad input refused before anything
starts, a failure summed up in one line naming the rank with the workers' own last lines, and
never torchrun's ChildFailedError traceback."""

from __future__ import annotations

import collections
import io
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO_ROOT, run_cli
from torch_multinode.launch import ending, local, relay
from torch_multinode.launch.node_output import JobLog
from torch_multinode.launch.progress import HEARTBEAT
from torch_multinode.launch.spec import JobSpec

TAIL = [
    "[launcher] ignored",
    "W1124 14:17:01.311000 19764 .venv/lib/python3.11/site-packages/torch/distributed/run.py:982] "
    "Setting OMP_NUM_THREADS",
    "step 1 loss 2.3",
    "Error: the worker's own last words",
    "E1124 14:17:15.509000 19764 .venv/lib/python3.11/site-packages/torch/distributed/elastic/"
    "multiprocessing/api.py:1002] failed (exitcode: 3) local_rank: 1 (pid: 20052) of binary: x",
    "[torchrun] rank 1 failed first (exit 3)",
]


def test_the_summary_names_the_rank_and_shows_the_workers_lines_not_torchruns():
    lines = ending.local_summary("tmn-1", 3, 12.34, TAIL)
    assert lines[0] == "Job tmn-1 FAILED on this machine after 12.3 s (rank 1, exit 3)."
    assert lines[1:] == [
        "Last lines:",
        "  | [launcher] ignored",
        "  | step 1 loss 2.3",
        "  | Error: the worker's own last words",
    ]
    assert ending.local_summary("tmn-1", 0, 5, TAIL) == [
        "Job tmn-1 succeeded after 5.0 s on this machine."
    ]
    # torchrun died before naming a rank: the exit code it gave.
    assert ending.local_summary("tmn-1", 1, 1, ["boom"])[0] == (
        "Job tmn-1 FAILED on this machine after 1.0 s (exit 1)."
    )


def test_the_local_command_is_torchrun_standalone_through_the_quiet_wrapper():
    spec = JobSpec(module="training.comm_demo", args=("--x", "1"))
    argv = local.command(spec, 2)
    assert argv[1:] == [
        "-m",
        "torch_multinode.training.local_launch",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "torch_multinode.training.comm_demo",
        "--x",
        "1",
    ]


def test_bad_input_to_a_local_job_is_one_line_and_exit_2_before_anything_starts():
    done = run_cli("train", "--", "--steps", "-1", timeout=120)
    assert (done.returncode, done.stdout) == (2, "")  # no "[launcher] local job": nothing ran
    assert done.stderr == "Error: --steps must be positive, got -1\n"


def test_a_local_job_that_fails_ends_with_the_summary_not_torchruns_traceback():
    # Accepted on this machine, refused by each rank before any process group forms (what only
    # a rank's own machine can tell: it has no GPU), so no rank waits on another that died.
    done = run_cli("train", "--", "--sync-bn", "--steps", "1", timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    assert "Traceback" not in output and "ChildFailedError" not in output, output
    summary = output[output.index("Job tmn-") :].splitlines()
    run_id = summary[0].split()[1]
    shutil.rmtree(REPO_ROOT / ".runs" / run_id, ignore_errors=True)
    assert re.fullmatch(
        r"Job tmn-\w+ FAILED on this machine after [\d.]+ s \(rank [01], exit 2\)\.", summary[0]
    ), output
    # Each rank refuses; torchrun stops the other as soon as the first one exits, so under load
    # the second may be gone before it prints its line (seen once in CI).
    assert summary[1] == "Last lines:", output
    refusal = "  | Error: --sync-bn needs GPUs: torch's SyncBatchNorm only runs on CUDA"
    assert summary[2:-1] in ([refusal], [refusal] * 2), output
    assert summary[-1].startswith(f"Run directory: {REPO_ROOT / '.runs' / run_id} "), output


def test_a_hung_local_jobs_summary_names_the_cause_and_its_lines_before_the_stop():
    cause = "rank 1 (vm) not in a collective (rank 1 at hang.py:21 in load_batch)"
    lines = ending.local_summary("tmn-1", 1, 31.04, ["step 3/10", "step 4/10"], ["ignored"], cause)
    assert lines == [
        f"Job tmn-1 FAILED on this machine after 31.0 s (hung: {cause}).",
        "Last lines:",
        "  | step 3/10",
        "  | step 4/10",
    ]


def test_the_relay_hides_heartbeats_however_the_output_is_cut(monkeypatch):
    """A heartbeat (launch.progress) counts as progress and is neither shown nor logged, as on
    the nodes, even cut across two reads; a line that only starts like one is shown whole, and
    a progress bar's carriage returns pass as they came."""
    written = (
        b"step 1/2\n[tmn] hea",
        b"rtbeat\r",
        b"\n10%\r20%\r\n[tmn] he",
        b"llo\n[tmn] heartbeat\nlast words",
    )
    chunks = iter(written)
    read, write = os.pipe()
    real_read = os.read
    monkeypatch.setattr(
        os, "read", lambda fd, n: next(chunks, b"") if fd == read else real_read(fd, n)
    )
    out, log, tail, seen = io.BytesIO(), io.BytesIO(), collections.deque(), []

    def observe(line: str) -> bool:
        seen.append(line)
        return line.strip() != HEARTBEAT

    try:
        with os.fdopen(read, "rb", buffering=0) as stream:
            relay.relay(stream, out, tail, log, observe)
    finally:
        os.close(write)
    shown = b"step 1/2\n10%\r20%\r\n[tmn] hello\nlast words"
    assert (out.getvalue(), log.getvalue()) == (shown, shown)
    assert list(tail) == ["step 1/2", "10%", "20%", "[tmn] hello", "last words"]
    assert seen.count(HEARTBEAT) == 2 and "[tmn] hello" in seen
    # Without a watch (no observer) everything passes, heartbeats included.
    chunks = iter(written)
    out, tail = io.BytesIO(), collections.deque()
    read, write = os.pipe()
    try:
        with os.fdopen(read, "rb", buffering=0) as stream:
            relay.relay(stream, out, tail)
    finally:
        os.close(write)
    assert out.getvalue() == b"".join(written)


def test_a_local_jobs_log_on_a_full_disk_ends_there_said_once_and_the_job_goes_on(tmp_path):
    """NODE.log in the run directory, on a disk that filled (/dev/full: every write fails so):
    the relay goes on to the end, every byte shown on the terminal, and one launcher line says
    where the log stops and why."""
    written = b"".join(f"step {step}/500 {'x' * 40}\n".encode() for step in range(1, 501))
    read, write = os.pipe()
    os.write(write, written)
    os.close(write)
    out, tail, said = io.BytesIO(), collections.deque(maxlen=5), []
    log = JobLog(Path("/dev/full"), said.append)
    with os.fdopen(read, "rb", buffering=0) as stream:
        relay.relay(stream, out, tail, log)
    log.close()
    assert said == [
        "[launcher] the log /dev/full stops here: No space left on device; the job goes on, its "
        "output still shown here"
    ]
    assert out.getvalue() == written
    assert list(tail)[-1] == f"step 500/500 {'x' * 40}"


# A local job that says one line, then nothing for ten minutes; Ctrl-C reaches the launcher in
# a thread other than its main one (the kernel may hand a process's signal to any thread).
_CTRL_C_ELSEWHERE = """
import signal, sys, threading
from pathlib import Path
from torch_multinode.launch import local, relay
from torch_multinode.launch.spec import JobSpec

local.command = lambda spec, nproc: ["sh", "-c", "echo ready; exec sleep 600"]
said = threading.Event()

class Out:
    def write(self, data):
        if b"ready" in data:
            said.set()
    def flush(self):
        pass

def press():
    said.wait()
    signal.pthread_kill(threading.get_ident(), signal.SIGINT)  # to this thread, not the main

threading.Thread(target=press, daemon=True).start()
spec = JobSpec(module="training.ddp", log_dir=Path(sys.argv[1]), stall=0)
print("exit", local.run_local(spec, emit=lambda line: print(line, flush=True), out=Out()))
"""


def test_ctrl_c_handed_to_another_thread_stops_a_silent_local_job(tmp_path):
    """The main thread never blocks on a job's silence: a Ctrl-C that lands in another thread is
    acted on though the job says nothing more (CI once waited out a paused rank's 120 s)."""
    done = subprocess.run(
        [sys.executable, "-c", _CTRL_C_ELSEWHERE, str(tmp_path / "run")],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,  # the job itself would take 600 s
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[-2:] == ["[launcher] Ctrl-C: stopping the local job...", "exit 130"], lines
    assert (tmp_path / "run").is_dir()
