"""Every run remembered (launch.record): a job launched from a directory leaves .runs/ID/run.json
whatever its end, and `runs` lists them newest first, shows one whole, or prints JSON. Jobs on
this machine here; the same record for jobs on the simulated cluster in containers is checked
in test_projects_in_containers.py (succeeded, interrupted, ENV= names) and test_hangs.py
(failed)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

from tests.conftest import VENV_BIN, run_cli
from tests.helpers import inventory, node, read_until
from torch_multinode.launch import record
from torch_multinode.launch.spec import JobResult, JobSpec, NodeOutcome

SCRIPT = """\
import sys
import time

for step in range(1, 4):
    print(f"step {step}/3 loss {1.0 / step:.3f}", flush=True)
if sys.argv[1:] == ["fail"]:
    raise ValueError("bad batch")
if sys.argv[1:] == ["hold"]:
    print("holding", flush=True)
    time.sleep(600)
"""


def _train(where: Path, *args: str) -> subprocess.CompletedProcess:
    return run_cli("train", "--script", "job.py", "--nproc-per-node", "1", *args, cwd=where)


def _runs(where: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(VENV_BIN / "python"), "-m", "torch_multinode.launch.runs", *args],
        cwd=where,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", "")},
    )


def test_three_local_jobs_are_listed_newest_first_with_their_results(tmp_path):
    (tmp_path / "job.py").write_text(SCRIPT)
    done = _train(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    failed = _train(tmp_path, "--", "fail")
    assert failed.returncode == 1, failed.stdout + failed.stderr
    held = subprocess.Popen(
        [str(VENV_BIN / "train"), "--script", "job.py", "--nproc-per-node", "1", "--", "hold"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        read_until(held, "holding", limit=120)
        os.killpg(held.pid, signal.SIGINT)  # Ctrl-C
        held.communicate(timeout=60)
    finally:
        if held.poll() is None:
            os.killpg(held.pid, signal.SIGKILL)
    assert held.returncode == 130

    listed = _runs(tmp_path)
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert lines[0].split() == [
        "ID",
        "STARTED",
        "WORKLOAD",
        "NODES",
        "TIME",
        "RESULT",
        "LAST",
        "STEP",
    ]
    assert [line.split()[6] for line in lines[1:]] == ["interrupted", "failed", "succeeded"]
    assert all("job.py" in line and "step 3/3 loss 0.333" in line for line in lines[1:])

    records = json.loads(_runs(tmp_path, "--json").stdout)
    assert [r["result"] for r in records] == ["interrupted", "failed", "succeeded"]
    assert [r["exit_code"] for r in records] == [130, 1, 0]
    failed_record = records[1]
    assert failed_record["args"] == ["fail"] and failed_record["backend"] == "local"
    assert failed_record["command"][1:] == [
        "--script",
        "job.py",
        "--nproc-per-node",
        "1",
        "--",
        "fail",
    ]
    assert failed_record["code"] == {"project": str(tmp_path), "git": None}
    assert failed_record["seconds"] > 0 and failed_record["ended"] >= failed_record["started"]
    one = _runs(tmp_path, "--run", failed_record["id"], "--json")
    assert json.loads(one.stdout) == failed_record
    shown = _runs(tmp_path, "--run", failed_record["id"]).stdout
    assert "result       failed" in shown and "last_step    step 3/3 loss 0.333" in shown


def test_an_unknown_run_is_one_error_line_and_no_runs_is_said(tmp_path):
    unknown = _runs(tmp_path, "--run", "tmn-nope")
    assert (unknown.returncode, unknown.stdout) == (2, "")
    assert unknown.stderr == (
        "Error: no run 'tmn-nope' is recorded in .runs/ (try make runs, which lists the "
        "recorded runs)\n"
    )
    empty = _runs(tmp_path)
    assert empty.returncode == 0 and empty.stdout.startswith("No run recorded in .runs/")


def test_a_git_projects_commit_and_its_uncommitted_change_are_kept(tmp_path):
    project = tmp_path / "proj"
    project.mkdir()
    (project / "train.py").write_text("print('v1')\n")
    git = ["git", "-C", str(project), "-c", "user.name=t", "-c", "user.email=t@example.com"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "first"], check=True)
    (project / "train.py").write_text("print('v2')\n")
    (project / "notes.txt").write_text("new\n")
    found = record.code(project, tmp_path)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    assert found == {
        "project": str(project),
        "git": head.strip(),
        "dirty": True,
        "diff": "code.diff",
    }
    diff = (tmp_path / "code.diff").read_text()
    assert "-print('v1')" in diff and "+print('v2')" in diff and "untracked: notes.txt" in diff


def test_the_record_names_the_env_variables_never_their_values_and_each_nodes_ranks(tmp_path):
    hosts = inventory({"node1": node(1), "node2": node(2)})
    spec = JobSpec(
        run_id="tmn-r1",
        log_dir=tmp_path / "tmn-r1",
        secret_env=(("HF_TOKEN", "s3cr3t-value"), ("MODE", "fast")),
        nproc_per_node=2,
    )
    started = record.begin(spec, ["-i", "x.yml"], hosts, tmp_path)
    on_disk = json.loads((tmp_path / "tmn-r1" / record.RECORD).read_text())
    assert on_disk["result"] == "running" and on_disk == started
    assert on_disk["env_names"] == ["HF_TOKEN", "MODE"]
    assert on_disk["nodes"] == [
        {"name": "node1", "ranks": [0, 1]},
        {"name": "node2", "ranks": [2, 3]},
    ]
    outcomes = {"node1": NodeOutcome("node1", exit_code=0), "node2": NodeOutcome("node2", 1)}
    result = JobResult("tmn-r1", outcomes, "node2", interrupted=False, seconds=3.0)
    record.finish(started, spec, result, result.exit_code)
    ended = json.loads((tmp_path / "tmn-r1" / record.RECORD).read_text())
    assert (ended["result"], ended["failed_node"], ended["exit_code"]) == ("failed", "node2", 1)
    for path in (tmp_path / "tmn-r1").iterdir():  # nothing half-written left beside it
        assert not path.name.startswith(".")
        assert b"s3cr3t-value" not in path.read_bytes()
