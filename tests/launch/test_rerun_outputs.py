"""Never lose the user's work (issue 49), without running a job: a relative --checkpoint-dir or
--data-dir follows one rule on this machine and on the nodes; a rerun's outputs get places of
their own (or the original's with SAME_OUTPUTS=1); the record names absolute paths; the code
snapshot holds code, not outputs, and says what it left out; `make rerun` of one of our
workloads on a checkout changed since is refused; `make runs | head` ends quietly. The real
local rerun of a run that wrote --checkpoint-dir ckpt1 is in test_record.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import VENV_BIN
from tests.helpers import fill, git_repository, inventory_text, node, small_filesystem
from torch_multinode.cluster import trust
from torch_multinode.cluster.errors import UserError
from torch_multinode.cluster.inventory_read import parse
from torch_multinode.launch import cli, ending, record, runs, snapshot, staging
from torch_multinode.launch.commands import run_dir
from torch_multinode.launch.recorder import Recorder
from torch_multinode.launch.spec import JobResult, JobSpec, NodeOutcome


def _repository(root: Path) -> list[str]:
    """A git repository at `root` with one commit (code.py, and a tracked weights.pt)."""
    return git_repository(root, {"code.py": "print('v1')\n", "weights.pt": b"tracked on purpose"})


def _files(root: Path, commit: str) -> set[str]:
    listed = subprocess.run(
        ["git", "-C", str(root), "ls-tree", "-r", "--name-only", commit],
        capture_output=True,
        text=True,
        check=True,
    )
    return set(listed.stdout.split())


def test_a_relative_checkpoint_or_data_dir_resolves_under_this_machines_roots(tmp_path):
    args, notes = staging.resolve_local_paths(
        ("--checkpoint-dir", "ckpt1", "--data-dir=cifar", "--out", "m.pt", "--lr", "0.1"),
        here=tmp_path,
    )
    assert args == (
        "--checkpoint-dir",
        f"{tmp_path}/checkpoints/ckpt1",
        f"--data-dir={tmp_path}/data/cifar",
        "--out",
        "m.pt",
        "--lr",
        "0.1",
    )
    assert notes == [
        f"--checkpoint-dir ckpt1 is {tmp_path}/checkpoints/ckpt1 on this machine",
        f"--data-dir cifar is {tmp_path}/data/cifar on this machine",
    ]
    assert staging.local_roots(tmp_path) == {
        "checkpoint_root": tmp_path / "checkpoints",
        "data_root": tmp_path / "data",
    }
    # an absolute one stays as it is, and is not said
    assert staging.resolve_local_paths(("--checkpoint-dir", "/scratch/c"), tmp_path) == (
        ("--checkpoint-dir", "/scratch/c"),
        [],
    )
    # refused as on the nodes: '~', and a path that leaves its root
    with pytest.raises(UserError) as home:
        staging.resolve_local_paths(("--checkpoint-dir", "~/c"), tmp_path)
    assert home.value.line() == (
        "Error: --checkpoint-dir '~/c': '~' would mean the home directory of whoever runs the "
        "job on each node, and a job on this machine follows the nodes' rule (try a path "
        f"relative to this machine's checkpoint_root ({tmp_path}/checkpoints), or an absolute "
        "one)"
    )
    with pytest.raises(UserError) as leaving:
        staging.resolve_local_paths(("--data-dir", "../elsewhere"), tmp_path)
    assert leaving.value.line() == (
        f"Error: --data-dir '../elsewhere' leaves this machine's data_root {tmp_path}/data"
    )


def test_a_reruns_outputs_get_places_of_their_own_unless_it_asks_for_the_originals():
    assert runs.apart("ckpt1", "tmn-b") == "ckpt1-rerun-tmn-b"
    assert runs.apart("runs/r1/", "tmn-b") == "runs/r1-rerun-tmn-b"
    assert runs.apart("/o/model.pt", "tmn-b", file=True) == "/o/model-rerun-tmn-b.pt"
    assert runs.apart("/o/exp.v2", "tmn-b") == "/o/exp.v2-rerun-tmn-b"  # a directory's name
    assert runs.apart(".", "tmn-b") == "./rerun-tmn-b"

    local = {"backend": "local", "cwd": "/w", "code": {"project": "/home/u/proj"}}
    command = ["--script", "proj/train.py", "--log-dir", "logs", "--"]
    job = ["--checkpoint-dir", "ckpt1", "--out=model.pt", "--run-dir", "r", "--data-dir", "d"]
    argv, said = runs.outputs_apart([*command, *job, "--lr", "1"], local, "tmn-b", False)
    assert argv == [
        "--script",
        "proj/train.py",
        "--log-dir",
        "logs-rerun-tmn-b",
        "--",
        "--checkpoint-dir",
        "ckpt1-rerun-tmn-b",  # relative: its root takes it, never the copy of the code
        "--out=/home/u/proj/model-rerun-tmn-b.pt",  # beside the original project
        "--run-dir",
        "/home/u/proj/r-rerun-tmn-b",
        "--data-dir",
        "d",  # read, not written: the same data
        "--lr",
        "1",
    ]
    assert said == [
        "--checkpoint-dir /w/checkpoints/ckpt1-rerun-tmn-b",
        "--out /home/u/proj/model-rerun-tmn-b.pt",
        "--run-dir /home/u/proj/r-rerun-tmn-b",
        "--log-dir logs-rerun-tmn-b",
    ]
    # SAME_OUTPUTS=1: the original's places, a relative one still never in the copy of the code
    same, said = runs.outputs_apart([*command, *job], local, "tmn-b", True)
    assert same[3:] == [
        "logs",
        "--",
        "--checkpoint-dir",
        "ckpt1",
        "--out=/home/u/proj/model.pt",
        "--run-dir",
        "/home/u/proj/r",
        "--data-dir",
        "d",
    ]
    assert said[0] == "--checkpoint-dir /w/checkpoints/ckpt1"
    # on the nodes: relative ones resolve there (under checkpoint_root, in the job's directory);
    # our workloads' relative --out lands in the rerun's own run directory already
    nodes = {**local, "backend": "ssh"}
    module = ["--module", "training.ddp", "--", "--checkpoint-dir", "c", "--out", "m.pt"]
    moved, said = runs.outputs_apart([*module, "--run-dir", "/abs/r"], nodes, "tmn-b", False)
    assert moved[4:] == ["c-rerun-tmn-b", "--out", "m.pt", "--run-dir", "/abs/r-rerun-tmn-b"]
    assert said == [
        "--checkpoint-dir c-rerun-tmn-b under each node's checkpoint_root",
        "--out m.pt in its run directory",
        "--run-dir /abs/r-rerun-tmn-b",
    ]
    # nothing after `--`: nothing of the job's own to move
    assert runs.outputs_apart(["--nproc-per-node", "1"], local, "tmn-b", False) == (
        ["--nproc-per-node", "1"],
        [],
    )


def test_the_record_names_the_outputs_by_absolute_paths(tmp_path, monkeypatch):
    monkeypatch.setattr(record, "RUNS_ROOT", tmp_path / "runs")
    monkeypatch.chdir(tmp_path)
    args, _ = staging.resolve_local_paths(("--checkpoint-dir", "ckpt1", "--out", "m.pt"))
    spec = JobSpec(run_id="tmn-o1", log_dir=tmp_path / "runs" / "tmn-o1", args=args)
    begun = record.begin(spec, ["--", "--checkpoint-dir", "ckpt1"], None, tmp_path / "proj")
    assert begun["checkpoints"] == f"{tmp_path}/checkpoints/ckpt1"
    assert begun["outputs"] == {
        "--checkpoint-dir": f"{tmp_path}/checkpoints/ckpt1",
        "--out": f"{tmp_path}/runs/tmn-o1/m.pt",  # our workloads': in the run directory
    }
    script = JobSpec(
        run_id="tmn-o2", script=Path("t.py"), args=("--run-dir", "r", "--out-dir", "/o")
    )
    assert record.outputs(script, tmp_path / "proj") == {
        "--run-dir": f"{tmp_path}/proj/r",  # where the job runs: its project
        "--out-dir": "/o",
    }
    # on the nodes, a relative one is in their copy of the project: as given
    assert record.outputs(script, tmp_path / "proj", here=False)["--run-dir"] == "r"


def test_a_snapshot_holds_code_not_outputs_and_a_rerun_still_gets_the_code(tmp_path):
    top = tmp_path / "repo"
    git = _repository(top)
    (top / "code.py").write_text("print('v2')\n")  # a tracked edit: kept
    (top / "helper.py").write_text("X = 1\n")  # untracked code: kept
    (top / "sub").mkdir()
    (top / "sub" / "config.yaml").write_text("lr: 0.1\n")
    (top / "model.safetensors").write_bytes(b"w" * 10)  # a checkpoint's extension
    (top / "notes.txt").write_bytes(b"n" * (snapshot.LARGE_FILE + 1))  # large
    (top / "ckpt1").mkdir()  # the run's own output directory, named to take
    (top / "ckpt1" / "state.json").write_text("{}")
    (top / "sub" / ".runs" / "x").mkdir(parents=True)  # a run directory, anywhere
    (top / "sub" / ".runs" / "x" / "events.txt").write_text("e")
    (top / ".gitignore").write_text("ignored.txt\n")
    (top / "ignored.txt").write_text("never")
    status = subprocess.run([*git, "status", "--porcelain"], capture_output=True, text=True)

    found = snapshot.take(top, "tmn-c1", outside=(top / "ckpt1", tmp_path / "elsewhere"))
    assert _files(top, found["snapshot"]) == {
        ".gitignore",
        "code.py",
        "helper.py",
        "sub/config.yaml",
        "weights.pt",  # tracked: the user's choice
    }
    assert found["outside"] == ["ckpt1"] and found["files"] == 5
    assert found["left_out"] == {
        "files": 4,
        "bytes": snapshot.LARGE_FILE + 1 + 10 + 2 + 1,
        "examples": ["notes.txt", "model.safetensors", "ckpt1/state.json"],  # largest first
    }
    assert snapshot.said(found) == (
        "code snapshot for make rerun: 5 files; left out 4 untracked file(s) (5 MB: notes.txt, "
        "model.safetensors, ckpt1/state.json, ...: outputs, checkpoints, data and files over "
        "5 MB are not code)"
    )
    after = subprocess.run([*git, "status", "--porcelain"], capture_output=True, text=True)
    assert after.stdout == status.stdout  # the user's index and files as they were
    restored = snapshot.restore(found, tmp_path / "restored")
    assert (restored / "code.py").read_text() == "print('v2')\n"
    assert (restored / "helper.py").read_text() == "X = 1\n"
    assert not (restored / "model.safetensors").exists()
    # more outputs since are not a change of the code; new code is
    (top / "ckpt1" / "more.json").write_text("{}")
    (top / "later.npy").write_bytes(b"a")
    assert snapshot.unchanged(found)
    (top / "new.py").write_text("")
    assert not snapshot.unchanged(found)
    # nothing left out: nothing to say
    whole = _repository(tmp_path / "plain")
    assert whole and snapshot.said(snapshot.take(tmp_path / "plain", "tmn-c2")) is None


def test_the_launch_says_what_the_snapshot_left_out_or_why_there_is_none(tmp_path, monkeypatch):
    """The record's snapshot is taken once the job started (Recorder.started): the launcher's
    one line then, through the emit it was given; the checkpoint root inside the repository
    left out."""
    top = tmp_path / "repo"
    _repository(top)
    monkeypatch.chdir(top)  # `train` typed inside the project: its roots are in the repository
    monkeypatch.setattr(record, "RUNS_ROOT", Path(".runs"))
    (top / "checkpoints" / "ckpt1").mkdir(parents=True)
    (top / "checkpoints" / "ckpt1" / "state.json").write_text("{}")  # a run's, before this one
    (top / ".runs" / "tmn-old").mkdir(parents=True)
    (top / ".runs" / "tmn-old" / "run.json").write_text("{}")
    args, _ = staging.resolve_local_paths(("--checkpoint-dir", "ckpt1"))
    said: list[str] = []

    def job_of(recorder: Recorder, run_id: str):
        def job() -> JobResult:
            recorder.started()
            return JobResult(run_id, {"h": NodeOutcome("h", exit_code=0)}, None, False, 1.0)

        return job

    spec = JobSpec(run_id="tmn-l1", script=top / "code.py", args=args)
    recorder = Recorder(spec, [], None, emit=said.append)
    recorder.kept(job_of(recorder, "tmn-l1"))
    # left out: the run before's record, this run's own begun record, the checkpoint
    ((line,),) = [said]
    assert line.startswith(
        "[launcher] code snapshot for make rerun: 2 files; left out 3 untracked file(s) ("
    ), line
    assert line.endswith(": outputs, checkpoints, data and files over 5 MB are not code)"), line
    for name in (".runs/tmn-old/run.json", ".runs/tmn-l1/run.json", "checkpoints/ckpt1/state"):
        assert name in line, line
    kept = json.loads((top / ".runs" / "tmn-l1" / record.RECORD).read_text())
    assert kept["code"]["outside"] == [
        ".runs",
        ".runs/tmn-l1",
        "checkpoints",
        "checkpoints/ckpt1",
        "data",
    ]
    assert _files(top, kept["code"]["snapshot"]) == {"code.py", "weights.pt"}

    # too big even so: said, with the remedy, and no snapshot
    monkeypatch.setattr(snapshot, "UNTRACKED_LIMIT", 10)
    (top / "more_code.py").write_text("x = 1  # more than 10 bytes of code\n")
    said.clear()
    spec = JobSpec(run_id="tmn-l2", script=top / "code.py", args=args)
    recorder = Recorder(spec, [], None, emit=said.append)
    recorder.kept(job_of(recorder, "tmn-l2"))
    assert len(said) == 1 and said[0].startswith(
        "[launcher] no code snapshot for make rerun: 0 MB of untracked files that look like code "
        "(over 0 MB with outputs and large binaries left out): add them to .gitignore, or "
        "commit them; left out "
    ), said


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small filesystem needs root (CI's)")
def test_a_snapshot_on_a_full_disk_is_said_and_leaves_the_repository_as_it_was(
    tmp_path, monkeypatch
):
    """The data-safety matrix's code snapshot x a full disk: the user's repository on a small
    filesystem of its own, filled, with new code git must write: the launch says in one line
    that there is no snapshot and git's reason, the record keeps why (a rerun refuses with it),
    and the user's files, HEAD, index and refs are as they were."""
    with small_filesystem(tmp_path / "small", "2m") as small:
        top = small / "repo"
        git = _repository(top)
        (top / "code.py").write_text("print('v2')\n" * 50)  # an edit: a new blob to write
        (top / "helper.py").write_text("X = 2\n" * 50)
        fill(small)

        def state() -> tuple[str, ...]:
            return tuple(
                subprocess.run([*git, *args], capture_output=True, text=True).stdout
                for args in (
                    ["status", "--porcelain"],
                    ["rev-parse", "HEAD"],
                    ["for-each-ref"],
                    ["ls-files", "--stage"],
                )
            ) + tuple((top / name).read_text() for name in ("code.py", "helper.py"))

        before = state()
        monkeypatch.chdir(tmp_path)
        monkeypatch.setattr(record, "RUNS_ROOT", tmp_path / ".runs")  # the record has room
        said: list[str] = []
        spec = JobSpec(run_id="tmn-f1", script=top / "code.py")
        recorder = Recorder(spec, [], None, emit=said.append)

        def job() -> JobResult:
            recorder.started()
            return JobResult("tmn-f1", {"h": NodeOutcome("h", exit_code=0)}, None, False, 1.0)

        recorder.kept(job)
        assert len(said) == 1, said
        assert said[0].startswith(
            "[launcher] no code snapshot for make rerun: git could not write it ("
        ), said
        assert said[0].endswith(": No space left on device)"), said  # git's own words
        kept = json.loads((tmp_path / ".runs" / "tmn-f1" / record.RECORD).read_text())
        assert kept["code"]["snapshot"] is None
        assert kept["code"]["why"].startswith("git could not write it ("), kept["code"]
        assert state() == before  # the user's repository as it was


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small filesystem needs root (CI's)")
def test_a_full_disk_never_breaks_a_run_record_nor_the_run(tmp_path, monkeypatch):
    """The data-safety matrix's run record x a full disk: the disk of .runs/ fills while the
    job runs: the job's result stands, the launcher says in one line that the record was not
    updated, and the record is whole as last written (its begun form, its code), with no
    temporary file beside it. Full before the job: one error line, and no job starts."""
    with small_filesystem(tmp_path / "small", "1m") as small:
        monkeypatch.chdir(tmp_path)
        monkeypatch.setattr(record, "RUNS_ROOT", small / ".runs")
        said: list[str] = []
        spec = JobSpec(run_id="tmn-r1", script=None)
        recorder = Recorder(spec, [], None, emit=said.append)

        def job() -> JobResult:
            recorder.started()
            fill(small)
            return JobResult("tmn-r1", {"h": NodeOutcome("h", exit_code=0)}, None, False, 1.0)

        assert recorder.kept(job).exit_code == 0  # the job's own result
        path = small / ".runs" / "tmn-r1" / record.RECORD
        assert said == [
            f"[launcher] the run record {path} was not updated with how it ended: No space left "
            "on device; it stays as last written (free space there for the next run's)"
        ]
        kept = json.loads(path.read_text())  # whole
        assert (kept["id"], kept["result"], kept["ended"]) == ("tmn-r1", "running", None)
        assert not [p.name for p in path.parent.iterdir() if p.name.startswith(".")]

        ran: list[str] = []
        spec = JobSpec(run_id="tmn-r2", script=None)
        with pytest.raises(UserError) as refused:
            Recorder(spec, [], None, emit=said.append).kept(lambda: ran.append("job"))
        assert str(refused.value) == (
            f"cannot write the run record in {small / '.runs' / 'tmn-r2'}: No space left on device"
        )
        assert ran == [] and not (small / ".runs" / "tmn-r2").exists()


def test_a_rerun_of_our_workload_on_a_checkout_changed_since_is_refused(tmp_path, monkeypatch):
    """`make rerun` of one of our workloads (a module, no --script or --workdir) runs this
    checkout as it is: refused when its code changed since the run; outputs written since
    are not a change."""
    checkout = tmp_path / "checkout"
    _repository(checkout)
    monkeypatch.chdir(tmp_path)
    runs_root = tmp_path / ".runs"
    (runs_root / "tmn-m1").mkdir(parents=True)
    code = record.code(checkout, runs_root / "tmn-m1", "tmn-m1", (checkout / "checkpoints",))
    command = ["train", "--module", "training.comm_demo", "--", "--checkpoint-dir", "ckpt1"]
    found = {
        "id": "tmn-m1",
        "command": command,
        "workload": "training.comm_demo",
        "backend": "local",
        "cwd": str(tmp_path),
        "code": code,
    }
    (runs_root / "tmn-m1" / record.RECORD).write_text(json.dumps(found))
    launched: list[tuple] = []
    monkeypatch.setattr(cli, "main", lambda *given: launched.append(given) or 0)

    # unchanged, outputs written since in the checkout: run again, its outputs apart
    (checkout / "checkpoints" / "ckpt1").mkdir(parents=True)
    (checkout / "checkpoints" / "ckpt1" / "state.json").write_text("{}")
    (checkout / "model.pt").write_bytes(b"w")
    assert runs.main(["--rerun", "tmn-m1", "--root", str(runs_root)]) == 0
    ((argv, origin, again),) = launched
    assert argv == [
        "--module",
        "training.comm_demo",
        "--",
        "--checkpoint-dir",
        f"ckpt1-rerun-{again}",
    ]
    assert origin == (found, runs_root / "tmn-m1") and again.startswith("tmn-")

    # the code changed since: refused, one line, nothing run
    (checkout / "code.py").write_text("print('v2')\n")
    launched.clear()
    with pytest.raises(UserError) as refused:
        runs.rerun("tmn-m1", runs_root)
    assert refused.value.line() == (
        "Error: run tmn-m1 ran training.comm_demo of this checkout, which has changed since "
        f"(the run's snapshot: {code['snapshot'][:12]}) (try git stash, or git checkout "
        f"{code['git'][:12]}, then make rerun again)"
    )
    assert launched == []
    (checkout / "code.py").write_text("print('v1')\n")  # as it was: runs again
    assert runs.main(["--rerun", "tmn-m1", "--root", str(runs_root)]) == 0 and launched
    (checkout / "new.py").write_text("")  # untracked code is code
    with pytest.raises(UserError, match="which has changed since"):
        runs.rerun("tmn-m1", runs_root)


def test_same_outputs_is_for_a_rerun(capsys):
    assert runs.main(["--same-outputs"]) == 2
    assert capsys.readouterr().err == (
        "Error: SAME_OUTPUTS=1 is for make rerun (try make rerun RUN=ID SAME_OUTPUTS=1)\n"
    )


def test_make_runs_into_a_reader_that_stopped_ends_quietly(tmp_path):
    """`make runs | head -2`: head exits after two lines and the listing's next write finds
    the pipe closed. Here the reader is gone before the first write: always that case."""
    for index in range(3):
        (tmp_path / f"tmn-p{index}").mkdir()
        (tmp_path / f"tmn-p{index}" / record.RECORD).write_text(
            json.dumps({"id": f"tmn-p{index}", "started": f"2026-01-0{index + 1}T00:00:00"})
        )
    reader, writer = os.pipe()
    os.close(reader)
    try:
        listed = subprocess.run(
            [
                str(VENV_BIN / "python"),
                "-m",
                "torch_multinode.launch.runs",
                "--root",
                str(tmp_path),
            ],
            stdout=writer,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        os.close(writer)
    assert (listed.returncode, listed.stderr) == (0, "")


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small filesystem needs root (CI's)")
def test_a_full_disk_here_leaves_the_masters_run_directory_where_it_is(tmp_path, monkeypatch):
    """The data-safety matrix's run directory brought home x a full disk: the master's run
    directory comes home by rsync (a stand-in for ssh runs it on this machine) into a log
    directory on a small filesystem that cannot hold it: one line says it was not copied and
    why, the master's files are as they were, and no half-copied file lies here."""
    inventory = parse(inventory_text({"n1": node(1)}, ansible_user="trainer"))
    master = inventory.hosts[0]
    rsh = tmp_path / "rsh"  # ssh's place: drops `-l user` and the host, runs the rest here
    rsh.write_text('#!/bin/sh\nwhile [ "$1" = "-l" ]; do shift 2; done\nshift\nexec sh -c "$*"\n')
    rsh.chmod(0o755)
    monkeypatch.setattr(trust, "openssh_command", lambda inventory, host: [str(rsh)])
    spec = JobSpec(run_id=f"tmn-home-{os.getpid()}", log_dir=tmp_path / "small" / "logs")
    remote = Path(run_dir(spec))  # the master's run directory, on this machine here
    remote.mkdir(parents=True)
    try:
        with small_filesystem(tmp_path / "small", "1m"):
            for index in range(4):  # 1.6 MB in all: more than the 1 MB here
                (remote / f"events-{index}.bin").write_bytes(os.urandom(400_000))
            before = {p.name: p.read_bytes() for p in remote.iterdir()}
            said: list[str] = []
            result = JobResult(
                spec.run_id, {master.name: NodeOutcome(master.name, 0)}, None, False, 1
            )
            ending.bring_back(inventory, master, spec, result, said.append)
            where = f"{master.name}:{remote}"
            assert result.brought_back.startswith(f"not copied from {where}: "), result.brought_back
            assert "No space left on device" in result.brought_back, result.brought_back
            assert said == [f"[launcher] the run directory {where} was {result.brought_back}"]
            assert {p.name: p.read_bytes() for p in remote.iterdir()} == before  # as it was
            here = list(spec.log_dir.iterdir())
            assert not [p.name for p in here if p.name.startswith(".")], here  # no half file
            assert all(p.read_bytes() == before[p.name] for p in here)  # what came is whole
    finally:
        shutil.rmtree(remote, ignore_errors=True)
