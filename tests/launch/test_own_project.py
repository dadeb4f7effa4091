"""An own project runs the same way here and on the nodes (issue 28, finding 1), and every job
has one name: the ID its summary prints is its directory under .runs/ (finding 2).

- A local job runs in its project's root (the directory that would travel to the nodes), with
  the project on the import path and the variables a node's ranks get (TMN_RUN_DIR,
  TMN_BACKEND, TMN_NODE_NAME); WORKDIR is accepted locally.
- A local job's TensorBoard events land in .runs/JOB-ID/, which `make tensorboard` accepts.
- A job refused before it starts leaves no .runs/JOB-ID/.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, make, run_cli
from tests.fakes import FakeNodes
from tests.helpers import inventory_text, node, run_id_in
from torch_multinode.cluster.errors import UserError
from torch_multinode.cluster.inventory_read import parse
from torch_multinode.cluster.remote import Result
from torch_multinode.launch.job import Launcher
from torch_multinode.launch.spec import LOCK_BUSY_EXIT, JobSpec
from torch_multinode.launch.staging import Project

# What rank 0 of the project's script found, written into its run directory: the same here and
# on the cluster.
TRAIN = """\
import json
import os

from mylib.model import build

with open("config.txt") as config:  # beside the script, read with a relative path
    setting = config.read().strip()
found = {
    "setting": setting,
    "built": build(setting),
    "in_project_root": os.path.isfile("train.py"),
    "backend": os.environ.get("TMN_BACKEND"),
    "node_name_set": bool(os.environ.get("TMN_NODE_NAME")),
    "world_size": os.environ["WORLD_SIZE"],
}
print(f"rank {os.environ['RANK']} found {found}")
if os.environ["RANK"] == "0":
    with open(os.path.join(os.environ["TMN_RUN_DIR"], "found.json"), "w") as out:
        json.dump(found, out, sort_keys=True)
"""


def _project(root: Path) -> Path:
    """proj/: a package, a config file beside the script, the script; not in a git tree."""
    project = root / "proj"
    (project / "mylib").mkdir(parents=True)
    (project / "mylib" / "__init__.py").write_text("")
    (project / "mylib" / "model.py").write_text(
        "def build(setting):\n    return 'model/' + setting\n"
    )
    (project / "config.txt").write_text("lr=0.5\n")
    (project / "train.py").write_text(TRAIN)
    return project


def _local_run_id(stdout: str) -> str:
    return re.search(r"^\[launcher\] local job (tmn-\w+)[ :]", stdout, re.M).group(1)


def _found(runs: Path, run_id: str) -> dict:
    return json.loads((runs / run_id / "found.json").read_text())


EXPECTED = {
    "setting": "lr=0.5",
    "built": "model/lr=0.5",
    "in_project_root": True,
    "backend": "gloo",
    "node_name_set": True,
    "world_size": "2",
}


@pytest.mark.parametrize("workdir", [False, True], ids=["script", "workdir"])
def test_a_local_job_runs_in_its_projects_root_with_the_nodes_variables(tmp_path, workdir):
    """Typed where the project is not (as `make train SCRIPT=proj/train.py` in this checkout)."""
    _project(tmp_path)
    extra = ["--workdir", "proj"] if workdir else []
    done = run_cli("train", "--script", "proj/train.py", *extra, cwd=tmp_path, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    run_id = _local_run_id(done.stdout)
    assert _found(tmp_path / ".runs", run_id) == EXPECTED
    summary = done.stdout[done.stdout.index(f"Job {run_id} succeeded") :].splitlines()
    assert summary[1].startswith(f"Run directory: {tmp_path / '.runs' / run_id} "), done.stdout
    assert "rank 0 found" in next((tmp_path / ".runs" / run_id).glob("*.log")).read_text()


@pytest.mark.sim
def test_the_same_project_writes_the_same_here_and_on_the_cluster(sim2, tmp_path):
    _project(tmp_path)
    here = run_cli("train", "--script", "proj/train.py", cwd=tmp_path, timeout=180)
    assert here.returncode == 0, here.stdout + here.stderr
    there = run_cli(
        "train",
        "-i",
        str(sim2.config.inventory_path),
        "--nnodes",
        "2",
        "--script",
        "proj/train.py",
        cwd=tmp_path,
        timeout=300,
    )
    assert there.returncode == 0, there.stdout + there.stderr
    runs = tmp_path / ".runs"
    local = _found(runs, _local_run_id(here.stdout))
    cluster = _found(runs, run_id_in(there.stdout))
    assert local == cluster == EXPECTED


def test_a_local_jobs_summary_names_its_run_directory_which_make_tensorboard_accepts(tmp_path):
    """The default workload with TensorBoard on (its default), as `make train` runs it."""
    before = set((REPO_ROOT / ".runs").glob("ddp-*"))
    done = make("train", "ARGS=--steps 2 --log-every 1", timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    run_id = _local_run_id(done.stdout)
    runs = REPO_ROOT / ".runs" / run_id
    try:
        assert re.search(rf"^Job {run_id} succeeded after ", done.stdout, re.M), output
        assert f"TensorBoard: make tensorboard RUN={run_id}\n" in done.stdout, output
        assert list((runs / "tensorboard").glob("events.out.tfevents.*")), output
        # No second directory named by no summary (the trainer's own .runs/ddp-<id>).
        assert set((REPO_ROOT / ".runs").glob("ddp-*")) == before, output
        # The Makefile's own checks pass; a stand-in for TensorBoard says what it was given.
        fake = tmp_path / "bin"
        fake.mkdir()
        (fake / "tensorboard").write_text('#!/bin/sh\necho "tensorboard $*"\n')
        (fake / "tensorboard").chmod(0o755)
        served = make("tensorboard", f"RUN={run_id}", f"BIN={fake}", "STAMP=", timeout=60)
        assert served.returncode == 0, served.stdout + served.stderr
        assert served.stdout.splitlines()[-1] == f"tensorboard --logdir .runs/{run_id}"
    finally:
        shutil.rmtree(runs, ignore_errors=True)


def test_an_inventory_job_refused_before_it_starts_leaves_no_run_directory(tmp_path):
    """The master's rendezvous port is taken by another job: refused, nothing started."""
    inventory = parse(
        inventory_text({"n1": node(1), "n2": node(2)}, rendezvous_port=29400, launch_mode="host"),
        "/nonexistent/inv.yml",
    )

    def answer(host, command):
        if "port-29400" in command and "mkdir" in command:
            return Result(host.name, command, LOCK_BUSY_EXIT, "busy tmn-other\n", "")
        return ""

    log_dir = tmp_path / ".runs" / "tmn-refused"
    spec = JobSpec(run_id="tmn-refused", log_dir=log_dir)
    project = Project(trees=(), workdir="/w", script=None)
    nodes = FakeNodes(list(inventory.hosts), responder=answer)
    with pytest.raises(UserError, match="job tmn-other is already running on n1"):
        Launcher(inventory, spec, lambda _: None, project=project, nodes=nodes).run()
    assert not (tmp_path / ".runs").exists()
