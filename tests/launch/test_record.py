"""Every run remembered (launch.record): a job launched from a directory leaves .runs/ID/run.json
whatever its end, and `runs` lists them newest first, shows one whole, or prints JSON. Jobs on
this machine here; the same record for jobs on the simulated cluster in containers is checked
in test_projects_in_containers.py (failed, rerun, succeeded and interrupted runs in one `make
runs` table, every field, ENV= names) and test_hangs.py (a hang: failed)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.conftest import VENV_BIN, make, run_cli
from tests.helpers import git_repository, inventory, node, read_until
from torch_multinode.cluster.errors import UserError
from torch_multinode.launch import record, runs, snapshot
from torch_multinode.launch.recorder import Recorder
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
    assert failed_record["code"] == {"project": str(tmp_path), "git": None, "snapshot": None}
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
    unnamed = make("rerun", "RUN=", timeout=60)
    assert unnamed.returncode != 0
    assert "Error: RUN is not set (try make rerun RUN=<job id from make runs>)" in unnamed.stdout


JOB = (
    "import pathlib, sys, time\n"
    "version = pathlib.Path(__file__).with_name('version.txt').read_text().strip()\n"
    "print('version', version, flush=True)\n"
    "args = sys.argv[1:]\n"
    "if '--checkpoint-dir' in args:\n"
    "    model = pathlib.Path(args[args.index('--checkpoint-dir') + 1]) / 'model.pt'\n"
    "    if model.exists():\n"
    "        print('resumed from', model, flush=True)\n"
    "    model.parent.mkdir(parents=True, exist_ok=True)\n"
    "    model.write_text(f'{version} {time.time_ns()}')\n"
    "    print('saved checkpoint', model.resolve(), flush=True)\n"
    "print('step 1/1', flush=True)\n"
    "if args == ['fail']:\n"
    "    raise ValueError('bad batch')\n"
)


def _git_project(root: Path) -> tuple[Path, list[str]]:
    """A project in a git repository of its own, one commit: job.py prints its version file,
    and with --checkpoint-dir DIR writes DIR/model.pt (saying so, and whether one was there)."""
    return root, git_repository(root, {"job.py": JOB, "version.txt": "v1\n"})


def test_a_snapshot_keeps_the_whole_work_tree_and_touches_nothing_of_the_users(tmp_path):
    project, git = _git_project(tmp_path / "proj")
    (project / "version.txt").write_text("v2\n")
    (project / "notes.txt").write_text("new\n")
    status = subprocess.run([*git, "status", "--porcelain"], capture_output=True, text=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    found = record.code(project, tmp_path, "tmn-s1")
    assert found["git"] == head.strip() and found["dirty"] and found["diff"] == "code.diff"
    diff = (tmp_path / "code.diff").read_text()
    assert "-v1" in diff and "+v2" in diff and "+new" in diff  # the untracked file's content too
    # the user's index, branch and files are as they were
    after = subprocess.run([*git, "status", "--porcelain"], capture_output=True, text=True)
    assert after.stdout == status.stdout
    assert (
        subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout == head
    )
    refs = subprocess.run(
        [*git, "for-each-ref", "--format=%(refname)"], capture_output=True, text=True
    )
    assert "refs/torch-multinode/runs/tmn-s1" in refs.stdout
    restored = snapshot.restore(found, tmp_path / "restored")
    assert (restored / "version.txt").read_text() == "v2\n"
    assert (restored / "notes.txt").read_text() == "new\n"
    assert snapshot.unchanged(found)
    (project / "version.txt").write_text("v3\n")
    assert not snapshot.unchanged(found)
    outside = tmp_path / "plain"
    outside.mkdir()
    assert record.code(outside, tmp_path, "tmn-s2") == {
        "project": str(outside),
        "git": None,
        "snapshot": None,
    }


def test_untracked_files_over_the_limit_are_not_copied_into_the_users_repository(tmp_path):
    project, git = _git_project(tmp_path / "proj")
    (project / "data.csv").write_bytes(b"x" * 2000)  # untracked, no binary: it looks like code
    found = snapshot.take(project, "tmn-s3", limit=1000)
    assert found["snapshot"] is None
    assert found["why"].startswith("0 MB of untracked files that look like code")
    assert snapshot.said(found) == (f"no code snapshot for make rerun: {found['why']}"), (
        "said at launch, with the remedy"
    )
    assert found["why"].endswith("add them to .gitignore, or commit them")
    refs = subprocess.run([*git, "for-each-ref"], capture_output=True, text=True).stdout
    assert "torch-multinode" not in refs
    kept = tmp_path / "runs" / "tmn-s3"
    kept.mkdir(parents=True)
    remembered = {"id": "tmn-s3", "command": ["train"], "cwd": str(tmp_path), "code": found}
    (kept / record.RECORD).write_text(json.dumps(remembered))
    with pytest.raises(UserError, match="run tmn-s3's code was not kept: 0 MB of untracked"):
        runs.rerun("tmn-s3", tmp_path / "runs")
    (project / ".gitignore").write_text("data.csv\n")  # ignored: no longer counted
    assert snapshot.take(project, "tmn-s4", limit=1000)["snapshot"] is not None


def test_a_rerun_runs_the_recorded_snapshot_not_the_edit_and_fails_the_same_way(tmp_path):
    """Also (issue 49): a relative --checkpoint-dir lands under this machine's checkpoints/,
    where `train` is typed, said first; the snapshot leaves an untracked checkpoint out, said
    at launch; each rerun writes a checkpoint of its own that stays where its record says once
    its temporary copy of the code is gone, and the original's is untouched."""
    project, _ = _git_project(tmp_path / "proj")
    (project / "version.txt").write_text("v2\n")  # uncommitted, as the run saw it
    (project / "weights.pt").write_bytes(b"\0" * 100)  # untracked, and no code
    ran = run_cli(
        "train",
        "--script",
        "proj/job.py",
        "--nproc-per-node",
        "1",
        "--",
        "--checkpoint-dir",
        "ckpt1",
        cwd=tmp_path,
    )
    assert ran.returncode == 0 and "version v2" in ran.stdout, ran.stdout + ran.stderr
    original = tmp_path / "checkpoints" / "ckpt1" / "model.pt"
    assert ran.stdout.splitlines()[0] == (
        f"[launcher] --checkpoint-dir ckpt1 is {original.parent} on this machine"
    ), ran.stdout
    assert f"saved checkpoint {original}\n" in ran.stdout and original.is_file(), ran.stdout
    assert (
        "[launcher] code snapshot for make rerun: 2 files; left out 1 untracked file(s) "
        "(100 bytes: weights.pt: outputs, checkpoints, data and files over 5 MB are not code)\n"
    ) in ran.stdout, ran.stdout
    saved = (original.read_bytes(), original.stat().st_mtime_ns)
    failed = run_cli(
        "train", "--script", "proj/job.py", "--nproc-per-node", "1", "--", "fail", cwd=tmp_path
    )
    assert failed.returncode == 1, failed.stdout + failed.stderr
    first, second = [r["id"] for r in json.loads(_runs(tmp_path, "--json").stdout)][::-1]
    (project / "version.txt").write_text("v3 (an edit after the runs)\n")

    again = _runs(tmp_path, "--rerun", first)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "version v2" in again.stdout and "version v3" not in again.stdout, again.stdout
    assert again.stdout.startswith(f"[rerun] {first}: its code snapshot ")
    ran_again = json.loads(_runs(tmp_path, "--json").stdout)[0]["id"]
    own = tmp_path / "checkpoints" / f"ckpt1-rerun-{ran_again}" / "model.pt"
    assert again.stdout.splitlines()[0].endswith(
        f"; outputs: its own, apart from run {first}'s: run directory .runs/{ran_again}, "
        f"--checkpoint-dir {own.parent}"
    ), again.stdout
    assert f"saved checkpoint {own}\n" in again.stdout and "resumed" not in again.stdout
    assert own.read_text().startswith("v2 "), "where the rerun said, its copy of the code gone"
    assert (original.read_bytes(), original.stat().st_mtime_ns) == saved
    failing = _runs(tmp_path, "--rerun", second)
    assert failing.returncode == 1, failing.stdout + failing.stderr
    assert "ValueError: bad batch" in failing.stdout, failing.stdout
    # each rerun is a run of its own, recorded, with its origin's command and code (not the
    # restored copy's paths, gone once it ended): a rerun can be run again, the same code
    records = json.loads(_runs(tmp_path, "--json").stdout)
    assert len(records) == 4
    origin, rerun = records[-1], records[1]
    assert (rerun["rerun_of"], origin["rerun_of"]) == (first, None)
    assert rerun["command"] == origin["command"] and rerun["workload"] == origin["workload"]
    assert rerun["code"] == origin["code"] and origin["code"]["snapshot"]
    assert (origin["checkpoints"], rerun["checkpoints"]) == (str(original.parent), str(own.parent))
    assert rerun["outputs"] == {"--checkpoint-dir": str(own.parent)}
    assert (tmp_path / ".runs" / rerun["id"] / "code.diff").read_text() == (
        tmp_path / ".runs" / first / "code.diff"
    ).read_text()
    twice = _runs(tmp_path, "--rerun", rerun["id"])
    assert twice.returncode == 0, twice.stdout + twice.stderr
    assert "version v2" in twice.stdout and "version v3" not in twice.stdout, twice.stdout
    third = json.loads(_runs(tmp_path, "--json").stdout)[0]["id"]
    assert f"checkpoints/ckpt1-rerun-{third}/model.pt\n" in twice.stdout, twice.stdout
    assert "resumed" not in twice.stdout and own.read_text().startswith("v2 ")
    assert (original.read_bytes(), original.stat().st_mtime_ns) == saved
    assert (project / "version.txt").read_text() == "v3 (an edit after the runs)\n"


def test_a_run_of_a_project_outside_git_cannot_be_run_again_and_says_why(tmp_path):
    (tmp_path / "job.py").write_text(SCRIPT)
    assert _train(tmp_path).returncode == 0
    (run,) = json.loads(_runs(tmp_path, "--json").stdout)
    refused = _runs(tmp_path, "--rerun", run["id"])
    assert (refused.returncode, refused.stdout) == (2, "")
    assert refused.stderr == (
        f"Error: run {run['id']}'s project {tmp_path} is not in a git repository, so its code "
        "was not kept: it cannot be run again exactly (try git init in the project: each run "
        "from then on can be run again)\n"
    )


def test_env_values_never_reach_the_recorded_command():
    argv = ["-i", "c.yml", "--env", "HF_TOKEN=abc MODE", "--env=KEY=xyz", "--", "--env", "A=1"]
    assert record.redacted(argv) == [
        "-i",
        "c.yml",
        "--env",
        "HF_TOKEN MODE",
        "--env=KEY",
        "--",
        "--env",
        "A=1",
    ]


def test_the_record_names_the_env_variables_never_their_values_and_each_nodes_ranks(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(record, "RUNS_ROOT", tmp_path)
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
    assert ended["nodes_changed"] == []
    # a restart that went on without a lost node (MIN_NODES) says so in the record
    (tmp_path / "tmn-r1" / "node1.log").write_text("[node1] step  9/12  loss 1.0\nbye\n")
    assert record.last_step_number(tmp_path / "tmn-r1") == 9
    result.nodes_changed = ("node2 lost at restart 1 after step 9: dropped",)
    record.finish(started, spec, result, result.exit_code)
    ended = json.loads((tmp_path / "tmn-r1" / record.RECORD).read_text())
    assert ended["nodes_changed"] == ["node2 lost at restart 1 after step 9: dropped"]
    assert ended["last_step"] == "[node1] step  9/12  loss 1.0"
    for path in (tmp_path / "tmn-r1").iterdir():  # nothing half-written left beside it
        assert not path.name.startswith(".")
        assert b"s3cr3t-value" not in path.read_bytes()


def test_a_job_refused_before_it_ran_leaves_no_run_and_one_that_broke_off_is_recorded(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(record, "RUNS_ROOT", tmp_path)
    spec = JobSpec(run_id="tmn-r2", log_dir=tmp_path / "tmn-r2")

    def refused() -> JobResult:
        raise UserError("job tmn-other is already running on n1", hint="waiting for it")

    with pytest.raises(UserError):
        Recorder(spec, ["--script", "x.py"], None).kept(refused)
    assert not (tmp_path / "tmn-r2").exists()

    def broke_off() -> JobResult:
        (tmp_path / "tmn-r2" / "node1.log").write_text("step 4/10 loss 1.2\n")
        raise UserError("node2 did not answer within --restart-wait 300 s", exit_code=1)

    with pytest.raises(UserError):
        Recorder(spec, ["--script", "x.py"], None).kept(broke_off)
    kept = json.loads((tmp_path / "tmn-r2" / record.RECORD).read_text())
    assert (kept["result"], kept["exit_code"], kept["last_step"]) == (
        "error",
        1,
        "step 4/10 loss 1.2",
    )


def test_a_job_with_its_logs_elsewhere_is_listed_with_the_others_and_described_beside_them(
    tmp_path, monkeypatch
):
    """--log-dir elsewhere: the record in .runs/ID, which make runs lists, and a copy beside
    the logs; a refusal leaves neither."""
    monkeypatch.setattr(record, "RUNS_ROOT", tmp_path / "runs")
    spec = JobSpec(run_id="tmn-r3", log_dir=tmp_path / "logs" / "mine")
    assert record.places(spec) == [tmp_path / "runs" / "tmn-r3", tmp_path / "logs" / "mine"]

    def ran() -> JobResult:
        (spec.log_dir / "node1.log").write_text("step 7/7 loss 0.5\n")
        return JobResult("tmn-r3", {"n1": NodeOutcome("n1", exit_code=0)}, None, False, 1.0)

    Recorder(spec, ["--log-dir", str(spec.log_dir)], None).kept(ran)
    listed = runs.every(tmp_path / "runs")
    assert [(r["id"], r["result"], r["last_step"]) for r in listed] == [
        ("tmn-r3", "succeeded", "step 7/7 loss 0.5")
    ]
    assert json.loads((spec.log_dir / record.RECORD).read_text()) == listed[0]

    refused = JobSpec(run_id="tmn-r4", log_dir=tmp_path / "logs" / "other")

    def no() -> JobResult:
        raise UserError("job tmn-other is already running on n1")

    with pytest.raises(UserError):
        Recorder(refused, [], None).kept(no)
    assert not (tmp_path / "runs" / "tmn-r4").exists() and not refused.log_dir.exists()
