"""A local job (no inventory) that hangs gets the report a job on the nodes gets (issue 49): after
STALL seconds without progress every rank's stacks are read here with py-spy, the rank holding
the others up is named with its line (launch.hang's analysis, launch.watch's report), the
report and the stacks are saved in `.runs/ID/`, and the job is stopped (exit 1), nothing of it
left; with ON_HANG=wait it is left running until Ctrl-C. Real jobs: two CPU ranks, rank 1
asleep in its data loading at step 5 while rank 0 waits in all_reduce. The nodes' side of the
same pieces (launch.watch), on fake nodes, says the same lines."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from tests.conftest import REPO_ROOT, VENV_BIN, run_cli
from tests.fakes import FakeNodes
from tests.helpers import inventory, node, read_until
from torch_multinode.launch import watch
from torch_multinode.launch.commands import run_dir
from torch_multinode.launch.progress import HEARTBEAT, Progress
from torch_multinode.launch.running import RunningJob
from torch_multinode.launch.spec import JobSpec

STALL = "10"  # seconds; a healthy step here takes 0.3 s

# Rank 0 says each step (a step line, or with "heartbeat" a heartbeat the launcher hides);
# rank 1 falls asleep in its data loading at step 5.
SCRIPT = """\
import os
import sys
import time

import torch
import torch.distributed as dist

from torch_multinode.training.distributed import flight

HEARTBEAT = sys.argv[1] == "heartbeat"
dist.init_process_group("gloo")
flight.start()
rank = dist.get_rank()
print(f"rank {rank} runs on {os.environ['TMN_NODE_NAME']}", flush=True)


def load_batch(step):
    if rank == 1 and step == 5:
        time.sleep(3600)  # HANG-LINE
    return torch.ones(1)


for step in range(1, 11):
    batch = load_batch(step)
    dist.all_reduce(batch)
    if rank == 0:
        print("[tmn] heartbeat" if HEARTBEAT else f"step {step}/10", flush=True)
    time.sleep(0.3)
dist.destroy_process_group()
"""
LINE = next(i for i, line in enumerate(SCRIPT.splitlines(), 1) if "HANG-LINE" in line)
HERE = socket.gethostname()
SLEEPER = f"rank 1 on {HERE}: not in a collective, at hang.py:{LINE} in load_batch"
WAITER = f"rank 0 on {HERE}: waits in all_reduce, called at hang.py:"
CAUSE = f"rank 1 ({HERE}) not in a collective (rank 1 at hang.py:{LINE} in load_batch)"


def _script(tmp_path: Path) -> Path:
    project = tmp_path / "proj"
    project.mkdir()
    (project / "hang.py").write_text(SCRIPT)
    return project / "hang.py"


def _run_id(output: str) -> str:
    return re.search(r"\[launcher\] local job (tmn-\w+) in ", output).group(1)


def _marked(run_id: str) -> list[int]:
    """This machine's processes carrying the run's marker (torchrun, its ranks, theirs)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"TMN_RUN_ID={run_id}".encode() in environ:
            found.append(int(entry.name))
    return found


def _gone(run_id: str, within: float = 60) -> list[int]:
    """The run's processes still there once they had `within` seconds to end."""
    deadline = time.monotonic() + within
    while (left := _marked(run_id)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def test_a_local_job_that_hangs_is_reported_with_its_line_and_stopped(tmp_path):
    done = run_cli("train", "--script", str(_script(tmp_path)), "--stall", STALL, "--", "steps")
    output = done.stdout + done.stderr
    run_id = _run_id(output)
    run_dir = REPO_ROOT / ".runs" / run_id
    try:
        assert done.returncode == 1, output[-3000:]
        assert re.search(
            r"\[launcher\] no step lines or heartbeats for \d+ s \(stall after 10 s\): the job "
            r"hangs; reading every rank's stacks\.\.\.",
            output,
        ), output[-3000:]
        # The report's lines as on the nodes, this machine's name for the node.
        assert f"[launcher]   {SLEEPER}" in output, output[-3000:]
        assert f"[launcher]   {WAITER}" in output, output[-3000:]
        assert f"[launcher] hang: {CAUSE} while rank 0 ({HERE}) waits in all_reduce" in output
        assert f"[launcher] hang report: {run_dir}/hang-report.txt" in output, output[-3000:]
        summary = output[output.index(f"Job {run_id} ") :].splitlines()
        assert re.fullmatch(
            rf"Job {run_id} FAILED on this machine after [\d.]+ s \(hung: {re.escape(CAUSE)} "
            r"while rank 0 \(\S+\) waits in all_reduce\)\.",
            summary[0],
        ), output[-3000:]
        assert "Traceback" not in output, output[-3000:]  # torchrun ends as for a failed rank
        # The report and every rank's stacks, saved as a node's are.
        report = (run_dir / "hang-report.txt").read_text()
        assert report.startswith(f"Hang report, job {run_id}: no step lines"), report
        assert f"  {SLEEPER}" in report and f"Cause: {CAUSE}" in report, report
        stacks = (run_dir / f"hang-stacks-{HERE}.txt").read_text()
        assert "=== tmn rank 0 pid " in stacks and "=== tmn rank 1 pid " in stacks, stacks
        assert f"load_batch ({tmp_path}/proj/hang.py:{LINE})" in stacks, stacks
        assert _gone(run_id) == [], "the hung job's processes were left running"
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def test_on_hang_wait_leaves_a_local_job_running_until_ctrl_c(tmp_path):
    # Rank 0 shows it is alive with heartbeats only: the launcher counts them and hides them.
    process = subprocess.Popen(
        [str(VENV_BIN / "train"), "--script", str(_script(tmp_path)), "--stall", STALL]
        + ["--on-hang", "wait", "--", "heartbeat"],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    run_id = None
    try:
        seen = read_until(process, "--on-hang wait: the job is left running", limit=2000)
        run_id = _run_id(seen)
        assert "[launcher] no step lines or heartbeats for" in seen, seen[-3000:]
        assert HEARTBEAT not in seen, seen[-3000:]
        assert f"[launcher]   {SLEEPER}" in seen and f"[launcher]   {WAITER}" in seen, seen
        assert (REPO_ROOT / ".runs" / run_id / "hang-report.txt").is_file()
        assert _marked(run_id), "the job was stopped, not left running"
        os.killpg(process.pid, signal.SIGINT)  # Ctrl-C, as a terminal sends it
        rest, _ = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    try:
        assert process.returncode == 130 and "Ctrl-C" in rest, rest[-2000:]
        assert "FAILED" not in rest, rest[-2000:]
        assert _gone(run_id) == [], "the job's processes were left after Ctrl-C"
        log = (REPO_ROOT / ".runs" / run_id / f"{HERE}.log").read_text()
        assert "rank 0 runs on" in log and HEARTBEAT not in log, log
    finally:
        shutil.rmtree(REPO_ROOT / ".runs" / run_id, ignore_errors=True)


def test_the_nodes_report_is_the_same_watch_and_words_without_a_cluster(tmp_path):
    """The SSH launcher's side of the shared pieces (watch.stall: progress.until_hang, collection_command,
    tell), on fake nodes that print what py-spy printed there: the same lines as a local job's,
    the node named, the report and each node's stacks saved."""
    workdir = "/tmp/torch-multinode/projects/proj"
    dumps = {
        "node1": f"""=== tmn rank 0 pid 101
Thread 101 (idle): "MainThread"
    all_reduce (/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py:3013)
    <module> ({workdir}/hang.py:25)
""",
        "node2": f"""=== tmn rank 1 pid 202
Thread 202 (idle): "MainThread"
    load_batch ({workdir}/hang.py:{LINE})
    <module> ({workdir}/hang.py:23)
""",
    }
    hosts = inventory({"node1": node(1), "node2": node(2)}).hosts
    nodes = FakeNodes(list(hosts), responder=lambda host, command: dumps[host.name])
    lines: list[str] = []
    spec = JobSpec(run_id="tmn-fake", stall=10, log_dir=tmp_path)
    job = RunningJob(spec, hosts, nodes, lines.append, 29500, False, workdir)
    now = [0.0]
    job.progress = Progress(10, clock=lambda: now[0])
    job.progress.note("step 4/10")
    now[0] = 11.0  # 11 s without a step line
    watch.stall(job)
    assert lines == [
        "[launcher] no step lines or heartbeats for 11 s (stall after 10 s): the job hangs; "
        "reading every rank's stacks...",
        "[launcher]   rank 0 on node1: waits in all_reduce, called at hang.py:25 in <module>",
        f"[launcher]   rank 1 on node2: not in a collective, at hang.py:{LINE} in load_batch",
        f"[launcher] hang: rank 1 (node2) not in a collective (rank 1 at hang.py:{LINE} in "
        "load_batch) while rank 0 (node1) waits in all_reduce",
        f"[launcher] hang report: {tmp_path}/hang-report.txt; every rank's stacks: "
        "hang-stacks-NODE.txt",
    ]
    assert job.first_failure == "node2" and job.hang_reported
    assert job.outcomes["node2"].error.startswith("hung: rank 1 (node2) not in a collective")
    assert (tmp_path / "hang-stacks-node2.txt").read_text() == dumps["node2"]
    assert "Cause: rank 1 (node2) not in a collective" in (tmp_path / "hang-report.txt").read_text()
    # Each node ran the one collection command a local job runs too: the ranks asked for their
    # traces, every rank's stacks, the traces printed.
    command = watch.collection_command("tmn-fake", run_dir(spec), "py-spy")
    assert [c for _, c in nodes.commands] == [command, command]
