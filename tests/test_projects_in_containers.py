"""A user's own project on the simulated cluster, with jobs in the training image
(launch_mode: container), as README's "Your own project" describes it:

- a project of several files (a package beside the script, a config read relative to it)
  travels to both nodes, runs there with a setting and a secret given with ENV, writes a
  checkpoint that outlives the containers, and after a one-line edit runs the edit and resumes;
- the secret never shows: not in the output, `.runs/`, any node's command lines or `docker
  inspect`;
- a progress bar redrawn ten times a second shows as a few lines per node, its end included;
- the default job's TensorBoard events and --out come back to `.runs/JOB-ID/`;
- a node whose image differs from the controller's is refused before anything starts;
- a node that changed since netcheck locked its versions is refused, naming what changed;
  ALLOW_DRIFT=1 runs the job anyway and its record says so;
- `make rerun` of a failed run, its project edited since, runs the run's snapshot and fails
  the same way; the edit then runs as a new job, and one more is stopped with Ctrl-C: the
  four are in one `make runs` table with their results, newest first;
- `make data` twice: the second run sends no file;
- a node killed mid-run with RESTARTS=1: the job resumes from the checkpoints on the nodes'
  disks and ends with the parameters of an uninterrupted run; one left dead with MIN_NODES=1:
  dropped, the job ends on the other node alone with the same parameters;
- a node killed mid-checkpoint, Ctrl-C during a checkpoint write, a full or read-only
  checkpoint directory: as README's table of faults says (what a failed job wrote comes back);
- an NCCL job on nodes whose GPUs do not answer stops at start naming the node, and model
  parallel on 1-GPU nodes is refused before anything starts;
- a project whose requirements.txt names packages the image lacks (wheels made here) trains in a layer of its own,
  built and shipped once; the same requirements again build and ship nothing; one more
  requirement ships one new layer; another torch is refused before any build; the record holds
  what was resolved; a local job of the project gets the same packages beside .venv.

Every test runs on the one provisioned cluster of the `provisioned` fixture and leaves it as
it found it.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import uuid
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO_ROOT, TEST_IMAGE, VENV_BIN, make
from tests.helpers import (
    DEPENDENT,
    check_namesake_project_runs,
    dependent_versions,
    digests,
    digests_on_node,
    fill,
    git_repository,
    interrupt,
    leftovers,
    namesake_project,
    no_containers_left,
    on_node,
    read_until,
    run_id_in,
    run_record,
    small_filesystem,
    start_train,
)
from tests.training.conftest import (
    REFERENCE_STEPS,
    TINY,
    kill_node,
    load_state,
    max_difference,
    reference_run,
    wait_until,
)
from torch_multinode.bench.wheels import offline_pip, wheel
from torch_multinode.cluster import version_lock
from torch_multinode.cluster.execution import SshNodes
from torch_multinode.cluster.inventory import DEFAULT_CHECKPOINT_ROOT, DEFAULT_DATA_ROOT
from torch_multinode.cluster.inventory_read import load
from torch_multinode.launch.spec import REMOTE_LOCK_ROOT
from torch_multinode.launch.staging import REMOTE_RUN_ROOT
from torch_multinode.provision import images
from torch_multinode.sim import nodes as sim
from torch_multinode.training.checkpointing.checkpoint import file_name

pytestmark = [pytest.mark.sim, pytest.mark.timeout(2400)]

SECRET = f"s3cret-{uuid.uuid4().hex}"
PROGRESS_SCRIPT = REPO_ROOT / "tests" / "training" / "project_scripts" / "progress_bar.py"

TRAIN = '''\
"""A user's training script: its own package, a config beside it, a checkpoint it resumes."""
import argparse
import os
import pathlib
import time

import torch
import torch.distributed as dist
import yaml

from mylib.model import VERSION, build

here = pathlib.Path(__file__).resolve().parent
config = yaml.safe_load((here / "config.yaml").read_text())
parser = argparse.ArgumentParser()
parser.add_argument("--checkpoint-dir", required=True)
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--hold", type=float, default=0.0)
args = parser.parse_args()
dist.init_process_group("gloo")
rank = dist.get_rank()
state = pathlib.Path(args.checkpoint_dir) / f"rank{rank}.txt"
start = int(state.read_text()) if state.exists() else 0
print(f"rank {rank}: mylib {VERSION}, config {config['name']}, token of "
      f"{len(os.environ.get('PROJECT_TOKEN', ''))} characters, mode "
      f"{os.environ.get('PROJECT_MODE')}, in its project {os.getcwd() == str(here)}, "
      f"start {start}", flush=True)
model = build()
for step in range(start, start + args.steps):
    value = torch.ones(1)
    dist.all_reduce(value)
state.parent.mkdir(parents=True, exist_ok=True)
state.write_text(str(start + args.steps))
if args.hold:
    print(f"rank {rank}: holding", flush=True)
    time.sleep(args.hold)
dist.barrier()
dist.destroy_process_group()
'''


@pytest.fixture(scope="module")
def reference_ddp(tmp_path_factory):
    """One uninterrupted 2-process DDP run of the tiny model, which other runs must equal."""
    return reference_run(tmp_path_factory.mktemp("reference"))


def _project(root: Path) -> Path:
    (root / "mylib").mkdir(parents=True)
    (root / "mylib" / "__init__.py").write_text("")
    (root / "mylib" / "model.py").write_text(
        'import torch\n\nVERSION = "v1"\n\n\ndef build():\n    return torch.nn.Linear(2, 2)\n'
    )
    (root / "config.yaml").write_text("name: tiny-experiment\n")
    (root / "train.py").write_text(TRAIN)
    # What must not travel: a virtual environment, a cache.
    (root / ".venv").mkdir()
    (root / ".venv" / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (root / "__pycache__").mkdir()
    (root / "__pycache__" / "junk.pyc").write_bytes(b"\0" * 100)
    return root / "train.py"


def _exit_code(returncode: int, output: str) -> int:
    """The launcher's exit code: make exits 2 for any failed recipe and names the recipe's."""
    if returncode == 0:
        return 0
    found = re.search(r"make(\[\d+\])?: \*\*\* \[[^\]]*train\] Error (\d+)", output)
    return int(found.group(2)) if found else -returncode


def _train(provisioned, *variables: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return make(
        "train", f"INVENTORY={provisioned.inventory}", "NNODES=2", *variables, timeout=900, env=env
    )


def _bring_back(provisioned, index: int) -> None:
    """Node `index` started again after a kill, its disk as it was, once its Docker engine
    answers as well as its SSH (a rebooted node is used once it has booted). The shared
    cluster's nodes began as fresh installs (FRESH=1), which sim-up must be told again."""
    sim.up(2, None, provisioned.cluster.config, fresh=True)
    sim.wait_for_engine(provisioned.cluster.config, index)
    # As a rebooted host does, the node kept what provisioning gave it: its name, the other
    # nodes' names in /etc/hosts, its firewall (later tests of this cluster rely on them).
    booted = on_node(
        provisioned.cluster,
        index,
        "hostname; getent hosts node1 node2 | wc -l; ufw status | head -n 1",
        False,
    )
    assert booted.split("\n")[:3] == [f"node{index}", "2", "Status: active"], booted


def test_a_project_of_several_files_runs_in_the_containers_and_its_edit_runs_next_time(
    provisioned, tmp_path
):
    script = _project(tmp_path / "proj")
    checkpoints = f"project-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "PROJECT_MODE": "fast"}
    variables = (f"SCRIPT={script}", f"ENV=PROJECT_TOKEN={SECRET} PROJECT_MODE")
    process = start_train(
        provisioned.inventory,
        *variables,
        f"ARGS=--checkpoint-dir {checkpoints} --steps 3 --hold 6",
        env=env,
    )
    try:
        seen = read_until(process, "[node1] rank 0: holding", "[node2] rank 1: holding")
        # While the job runs: the secret is on no command line of either node, and not in what
        # Docker tells about the containers.
        for index in (1, 2):
            cmdlines = on_node(
                provisioned.cluster, index, "cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' '"
            )
            assert "PROJECT_TOKEN" not in cmdlines and SECRET not in cmdlines, index
            inspect = on_node(provisioned.cluster, index, "docker inspect $(docker ps -q)")
            assert '"Image"' in inspect and SECRET not in inspect, index
        rest, _ = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
    output = seen + rest
    assert process.returncode == 0, output[-4000:]
    run_id = run_id_in(output)
    for rank, node in ((0, "node1"), (1, "node2")):
        assert (
            f"[{node}] rank {rank}: mylib v1, config tiny-experiment, token of {len(SECRET)} "
            "characters, mode fast, in its project True, start 0"
        ) in output
    assert (
        "[launcher] environment for every rank: PROJECT_TOKEN, PROJECT_MODE (values not shown)"
        in output
    )
    assert (
        f"[launcher] --checkpoint-dir {checkpoints} is {DEFAULT_CHECKPOINT_ROOT}/{checkpoints} "
        "on every node (checkpoint_root)"
    ) in output
    # The project travelled without its virtual environment and caches: 4 files.
    assert re.search(rf"\[launcher\] {re.escape(str(script.parent))} \(4 files, ", output), output
    assert SECRET not in output
    runs = REPO_ROOT / ".runs" / run_id
    for path in runs.rglob("*"):  # the run's record (run.json) among them
        assert not path.is_file() or SECRET.encode() not in path.read_bytes(), path
    remembered = json.loads((runs / "run.json").read_text())
    assert remembered["env_names"] == ["PROJECT_MODE", "PROJECT_TOKEN"], remembered
    assert (remembered["backend"], remembered["launch_mode"], remembered["result"]) == (
        "ssh",
        "container",
        "succeeded",
    ), remembered
    assert remembered["nodes"] == [
        {"name": "node1", "ranks": [0, 0]},
        {"name": "node2", "ranks": [1, 1]},
    ]
    # where the checkpoints are on every node, as the launcher resolved it
    assert remembered["checkpoints"] == f"{DEFAULT_CHECKPOINT_ROOT}/{checkpoints}", remembered
    assert remembered["exit_code"] == 0
    assert remembered["inventory"]["path"] == str(provisioned.inventory)
    image = sim.docker("image", "inspect", "--format", "{{.Id}}", "torch-multinode/train:test")
    assert remembered["image"] == {"name": "torch-multinode/train:test", "id": image.stdout.strip()}
    # The containers are gone; the checkpoints are on each node's disk.
    no_containers_left(provisioned.cluster, (1, 2))
    for index, rank in ((1, 0), (2, 1)):
        kept = on_node(
            provisioned.cluster,
            index,
            f"cat {DEFAULT_CHECKPOINT_ROOT}/{checkpoints}/rank{rank}.txt",
        )
        assert kept == "3", (index, kept)

    # A one-line edit of the project's package: the next run runs it, on both nodes, resuming.
    model = script.parent / "mylib" / "model.py"
    model.write_text(model.read_text().replace('"v1"', '"v2"'))
    again = _train(provisioned, *variables, f"ARGS=--checkpoint-dir {checkpoints}", env=env)
    assert again.returncode == 0, again.stdout[-4000:] + again.stderr
    for rank, node in ((0, "node1"), (1, "node2")):
        assert f"[{node}] rank {rank}: mylib v2, config tiny-experiment" in again.stdout
        assert re.search(rf"\[{node}\] rank {rank}: .* start 3\n", again.stdout), again.stdout
    # Only the edited file travelled.
    assert re.search(r"node1 1 changed file\(s\), .* node2 1 changed file\(s\)", again.stdout)
    for index in (1, 2):
        on_node(provisioned.cluster, index, f"rm -rf {DEFAULT_CHECKPOINT_ROOT}/{checkpoints}")
    shutil.rmtree(runs, ignore_errors=True)


def test_a_progress_bar_shows_a_few_lines_per_node_and_its_end(provisioned):
    proc = _train(provisioned, f"SCRIPT={PROGRESS_SCRIPT}")
    assert proc.returncode == 0, proc.stdout[-4000:]
    for node in ("node1", "node2"):
        states = [
            line
            for line in proc.stdout.splitlines()
            if re.match(rf"\[{node}\] progress \d+/80 ", line)
        ]
        # 8 s of redraws at 10 per second: at most one line every 3 s, and the last state.
        assert 2 <= len(states) <= 5, states
        assert states[-1] == f"[{node}] progress 80/80 |##########|", states
        assert any("80/80" not in line for line in states), states  # shown while it ran
        assert f"[{node}] progress bar done" in proc.stdout


def test_the_default_jobs_tensorboard_events_and_out_come_back(small_job_over_ssh):
    proc = small_job_over_ssh
    assert proc.returncode == 0, proc.stdout[-4000:]
    run_id = run_id_in(proc.stdout)
    runs = REPO_ROOT / ".runs" / run_id
    try:
        assert list((runs / "tensorboard").glob("events.out.tfevents.*")), sorted(runs.rglob("*"))
        assert (runs / "model.pt").is_file()
        assert (runs / "node1.log").is_file() and (runs / "node2.log").is_file()
        assert f"TensorBoard: make tensorboard RUN={run_id}" in proc.stdout
        # its record (issue 32): the last step line and where the events are
        remembered = run_record(run_id)
        assert (remembered["result"], remembered["exit_code"]) == ("succeeded", 0), remembered
        assert remembered["last_step"].startswith("step 4/4 "), remembered
        assert remembered["tensorboard"] == str((runs / "tensorboard").resolve()), remembered
        assert remembered["workload"] == "training.ddp" and remembered["code"]["git"], remembered
    finally:
        shutil.rmtree(runs, ignore_errors=True)


def test_a_node_whose_image_differs_is_refused_before_anything_starts(provisioned, tmp_path):
    # An image name of this test's own, so the training image is never touched: here and on
    # node1 it is the test image; on node2 another image under the same name.
    probe = f"tmn-probe:{uuid.uuid4().hex[:8]}"
    image = sim.docker("image", "inspect", "--format", "{{.Id}}", "torch-multinode/train:test")
    image = image.stdout.strip()
    sim.docker("tag", "torch-multinode/train:test", probe)
    on_node(provisioned.cluster, 1, f"docker tag torch-multinode/train:test {probe}")
    on_node(provisioned.cluster, 2, f"tar cf - --files-from /dev/null | docker import - {probe}")
    document = yaml.safe_load(provisioned.inventory.read_text())
    document["all"]["vars"]["training_image"] = probe
    inventory = tmp_path / "inventory.yml"
    inventory.write_text(yaml.safe_dump(document, sort_keys=False))
    try:
        proc = make("train", f"INVENTORY={inventory}", "NNODES=2", timeout=600)
        assert _exit_code(proc.returncode, proc.stderr) == 1, proc.stdout[-3000:] + proc.stderr
        error = proc.stderr.strip().splitlines()[0]
        assert error.startswith(f"Error: on node2: the training image {probe} is "), error
        assert f"not this machine's {image[7:19]}" in error
        assert error.endswith(f"(try make ship INVENTORY={inventory})"), error
        assert "[node1]" not in proc.stdout  # nothing started
    finally:
        for index in (1, 2):
            on_node(provisioned.cluster, index, f"docker rmi {probe}", check=False)
        sim.docker("rmi", probe, check=False)


def test_a_node_that_changed_since_netcheck_is_refused_and_allow_drift_runs_it(
    provisioned, tmp_path
):
    """The version lock (issue 32): netcheck's lock of both nodes, then node2's training image
    replaced by another under the same tag: refused before anything starts, naming the node and
    both IDs. Then a drift the image check lets through (the lock says node1 ran another
    kernel): refused, and run with ALLOW_DRIFT=1, which the run's record keeps."""
    probe = f"tmn-lock:{uuid.uuid4().hex[:8]}"  # the training image under a name of this test's
    image = sim.docker("image", "inspect", "--format", "{{.Id}}", "torch-multinode/train:test")
    image = image.stdout.strip()
    sim.docker("tag", "torch-multinode/train:test", probe)
    for index in (1, 2):
        on_node(provisioned.cluster, index, f"docker tag torch-multinode/train:test {probe}")
    document = yaml.safe_load(provisioned.inventory.read_text())
    document["all"]["vars"]["training_image"] = probe
    path = tmp_path / "inventory.yml"  # its lock beside it, no other test's
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    script = tmp_path / "job.py"
    script.write_text('import os\nprint("rank", os.environ["RANK"], "ran")\n')
    train = ("train", f"INVENTORY={path}", "NNODES=2", f"SCRIPT={script}")
    inventory = load(str(path))
    nodes = SshNodes(inventory)
    try:
        locked = version_lock.lock_nodes(inventory, nodes)  # as netcheck does once it passes
        assert locked == version_lock.default_path(path)
        kernel = version_lock.load(locked)["node1"]["kernel"]
        assert version_lock.load(locked)["node2"]["image"] == image
        on_node(
            provisioned.cluster, 2, f"tar cf - --files-from /dev/null | docker import - {probe}"
        )
        other = on_node(
            provisioned.cluster, 2, f"docker image inspect --format '{{{{.Id}}}}' {probe}"
        )
        proc = make(*train, timeout=600)
        assert _exit_code(proc.returncode, proc.stderr) == 1, proc.stdout[-3000:] + proc.stderr
        error = proc.stderr.strip().splitlines()[0]
        assert error.startswith(
            f"Error: node2 changed since netcheck passed: training image from {image[7:19]} "
            f"to {other.strip()[7:19]}"
        ), error
        assert "[node1]" not in proc.stdout and "[node2]" not in proc.stdout  # nothing started
        assert f"make netcheck INVENTORY={path}" in proc.stderr and "ALLOW_DRIFT=1" in proc.stderr

        on_node(provisioned.cluster, 2, f"docker tag torch-multinode/train:test {probe}")
        on_node(provisioned.cluster, 2, f"docker rmi {other.strip()}", check=False)
        nodes_locked = version_lock.load(locked)
        version_lock.write(locked, {"node1": {**nodes_locked["node1"], "kernel": "5.10.0-old"}})
        drift = f"node1 changed since netcheck passed: kernel from 5.10.0-old to {kernel}"
        proc = make(*train, timeout=600)
        assert _exit_code(proc.returncode, proc.stderr) == 1, proc.stdout[-3000:] + proc.stderr
        assert proc.stderr.startswith(f"Error: {drift} "), proc.stderr
        proc = make(*train, "ALLOW_DRIFT=1", timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
        assert f"[launcher] {drift} (ALLOW_DRIFT=1: running anyway)" in proc.stdout
        assert "[node2] rank 1 ran" in proc.stdout
        remembered = run_record(run_id_in(proc.stdout))
        assert remembered["allow_drift"] is True and remembered["result"] == "succeeded"
        assert remembered["drift"] == {"node1": [f"kernel from 5.10.0-old to {kernel}"]}
        assert {n: v["image"] for n, v in remembered["versions"].items()} == {
            "node1": image,
            "node2": image,
        }
        # The image's torch, CUDA and NCCL, as its labels record what it reported.
        stack = images.stack_labels("torch-multinode/train:test")
        assert stack["nccl"] != "unknown" and stack["cuda"] != "unknown", stack
        for versions in remembered["versions"].values():
            assert {field: versions[field] for field in stack} == stack, versions
    finally:
        nodes.close()
        for index in (1, 2):
            on_node(provisioned.cluster, index, f"docker rmi {probe}", check=False)
        sim.docker("rmi", probe, check=False)


def test_a_rerun_of_a_failed_run_runs_its_snapshot_not_the_edit_and_fails_the_same_way(
    provisioned, tmp_path
):
    """`make rerun RUN=ID` on the nodes, in containers (issue 32): the project (a git
    repository of its own) fails at version v1; edited to v2 (not committed), the rerun of the
    failed run still runs v1, on both nodes, and fails as it did. A new job then runs the edit
    and succeeds, and one more is stopped with Ctrl-C. All four are in one `make runs` table,
    newest first, with their results (failed, failed, succeeded, interrupted); each record
    (JSON=1) holds every field the issue names, and a secret passed with ENV= is in no file of
    any of the four run directories. The failed run's directory brought home (its nodes' logs,
    its record) is byte for byte as it was after the rerun, which has a directory of its own."""
    root = tmp_path / "proj"
    root.mkdir()
    (root / "version.txt").write_text("v1\n")
    (root / "job.py").write_text(
        "import os, sys, time\n"
        "version = open(os.path.join(os.path.dirname(__file__), 'version.txt')).read().strip()\n"
        "print('rank', os.environ['RANK'], 'runs', version, flush=True)\n"
        "print('rank', os.environ['RANK'], 'token of', len(os.environ['PROJECT_TOKEN']), flush=True)\n"
        "time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 0)\n"
        "sys.exit(3 if version == 'v1' else 0)\n"
    )
    secret = f"s3cr3t-{uuid.uuid4().hex}"  # by name on the command line, its value from here
    with_secret = {**os.environ, "PROJECT_TOKEN": secret}
    git = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@example.com"]
    for step in (["init", "-q"], ["add", "."], ["commit", "-qm", "v1"]):
        subprocess.run([*git, *step], check=True, capture_output=True)
    first = _train(provisioned, f"SCRIPT={root / 'job.py'}", "ENV=PROJECT_TOKEN", env=with_secret)
    assert _exit_code(first.returncode, first.stderr) == 1, first.stdout[-3000:] + first.stderr
    assert f"[node2] rank 1 token of {len(secret)}" in first.stdout, first.stdout[-3000:]
    run_id = run_id_in(first.stdout)
    assert re.search(rf"^Job {run_id} FAILED on node\d", first.stdout, re.M), first.stdout
    home = digests(REPO_ROOT / ".runs" / run_id)
    assert {"node1.log", "node2.log", "run.json"} <= set(home), home
    (root / "version.txt").write_text("v2\n")  # an edit since, not committed
    rerun = make("rerun", f"RUN={run_id}", timeout=900, env=with_secret)
    out = rerun.stdout
    assert rerun.returncode != 0, out[-3000:] + rerun.stderr
    assert f"[rerun] {run_id}: its code snapshot " in out, out[-3000:]
    assert "[node1] rank 0 runs v1" in out and "[node2] rank 1 runs v1" in out, out[-3000:]
    assert "runs v2" not in out
    again = run_id_in(out)
    remembered = json.loads((REPO_ROOT / ".runs" / again / "run.json").read_text())
    assert (remembered["result"], remembered["exit_code"]) == ("failed", 1), remembered
    assert digests(REPO_ROOT / ".runs" / run_id) == home  # the original's, as it was
    assert {"node1.log", "node2.log"} <= set(digests(REPO_ROOT / ".runs" / again))
    assert (root / "version.txt").read_text() == "v2\n"  # the edit is left as it was
    # A new job runs the edit, and succeeds; one more, held, is stopped with Ctrl-C.
    edited = _train(provisioned, f"SCRIPT={root / 'job.py'}", "ENV=PROJECT_TOKEN", env=with_secret)
    assert edited.returncode == 0, edited.stdout[-3000:] + edited.stderr
    assert "[node2] rank 1 runs v2" in edited.stdout, edited.stdout[-3000:]
    succeeded = run_id_in(edited.stdout)
    held = start_train(
        provisioned.inventory,
        f"SCRIPT={root / 'job.py'}",
        "ARGS=600",
        "ENV=PROJECT_TOKEN",
        env=with_secret,
    )
    try:
        seen = read_until(held, "[node1] rank 0 runs v2", "[node2] rank 1 runs v2")
        os.killpg(held.pid, signal.SIGINT)  # Ctrl-C, as a terminal sends it: make and train
        rest = held.communicate(timeout=60)[0]
    finally:
        if held.poll() is None:
            os.killpg(held.pid, signal.SIGKILL)
    interrupted = run_id_in(seen)
    assert f"Job {interrupted} interrupted" in rest, rest[-3000:]
    no_containers_left(provisioned.cluster, (1, 2))

    # One table, newest first (other workers' runs may stand between these four).
    table = make("runs", timeout=120).stdout.splitlines()
    ours = {run_id: "failed", again: "failed", succeeded: "succeeded", interrupted: "interrupted"}
    rows = [line.split() for line in table if line.split()[:1] and line.split()[0] in ours]
    assert [row[0] for row in rows] == [interrupted, succeeded, again, run_id], table
    for row in rows:
        assert (row[3], row[4], row[6]) == ("job.py", "node1,node2", ours[row[0]]), row
    image = on_node(provisioned.cluster, 1, "docker image inspect -f '{{.Id}}' " + TEST_IMAGE)
    commit = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    codes = {"failed": 1, "succeeded": 0, "interrupted": 130}
    for listed, origin in ((run_id, None), (again, run_id), (succeeded, None), (interrupted, None)):
        record = run_record(listed)
        assert record["rerun_of"] == origin, record
        assert (record["result"], record["exit_code"]) == (ours[listed], codes[ours[listed]])
        if ours[listed] == "failed":
            assert record["failed_node"] in ("node1", "node2"), record
        assert (record["backend"], record["launch_mode"]) == ("ssh", "container"), record
        assert record["inventory"]["path"] == str(provisioned.inventory)
        assert len(record["inventory"]["sha256"]) == 64
        assert record["nodes"] == [
            {"name": "node1", "ranks": [0, 0]},
            {"name": "node2", "ranks": [1, 1]},
        ]
        assert record["code"]["git"] == commit.strip() and record["code"]["snapshot"], record
        assert record["image"] == {"name": TEST_IMAGE, "id": image.strip()}, record
        assert sorted(record["versions"]) == ["node1", "node2"]
        for found in record["versions"].values():
            assert {"kernel", "driver", "docker", "image", "torch", "cuda", "nccl"} <= set(found)
            assert found["image"] == image.strip() and found["torch"].startswith("2.")
        assert record["env_names"] == ["PROJECT_TOKEN"]
        assert any("PROJECT_TOKEN" in part for part in record["command"])
        assert secret not in json.dumps(record)
        assert record["started"] <= record["ended"] and record["seconds"] > 0
        for path in (REPO_ROOT / ".runs" / listed).rglob("*"):
            assert not path.is_file() or secret.encode() not in path.read_bytes(), path


# A project's job that keeps its state where --checkpoint-dir says (relative: each node's
# checkpoint_root/NAME, the one rule for every job on the nodes), saying what it found there.
# A project's job that keeps its state in --checkpoint-dir, and with --out-dir writes there too
# (a directory every node sees, /shared): each rank says what it found in each before writing.
STATE_JOB = """\
import argparse, os, pathlib
parser = argparse.ArgumentParser()
parser.add_argument("--checkpoint-dir", required=True)
parser.add_argument("--out-dir")
args = parser.parse_args()
for flag, place in (("checkpoint-dir", args.checkpoint_dir), ("out-dir", args.out_dir)):
    if place is None:
        continue
    where = pathlib.Path(place)
    where.mkdir(parents=True, exist_ok=True)
    state = where / f"state-rank{os.environ['RANK']}.pt"
    found = state.read_text().strip() if state.exists() else "none"
    state.write_text(f"written by {os.environ['TMN_RUN_ID']}\\n")
    print("rank", os.environ["RANK"], "found", found, "in its", flag, flush=True)
"""


def test_a_rerun_writes_its_own_checkpoints_on_the_nodes_and_leaves_the_originals(
    provisioned, tmp_path
):
    """The data-safety matrix's `a rerun` column on the nodes, in containers: a project's job
    keeps its state in `--checkpoint-dir NAME` (each node's checkpoint_root/NAME) and in
    `--out-dir /shared/NAME` (the directory every node sees); `make rerun RUN=ID` says where its
    own outputs go, keeps them in NAME-rerun-NEWID on every node's disk and in
    /shared/NAME-rerun-NEWID, never finds the original's (it starts over, as a new run), and
    leaves the original's byte for byte as they were, on the nodes' disks and on /shared."""
    root = tmp_path / "proj"
    root.mkdir()
    (root / "job.py").write_text(STATE_JOB)
    git = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@example.com"]
    for step in (["init", "-q"], ["add", "."], ["commit", "-qm", "state"]):
        subprocess.run([*git, *step], check=True, capture_output=True)
    name = f"state-{uuid.uuid4().hex[:8]}"
    original = f"{DEFAULT_CHECKPOINT_ROOT}/{name}"
    shared = f"/shared/{name}"

    def kept(directory: str, indices=(1, 2)) -> dict[int, str]:
        """Each node's files there: their digests and what they say."""
        return {
            index: on_node(
                provisioned.cluster, index, f"cd {directory} && sha256sum state-*; cat state-*"
            )
            for index in indices
        }

    try:
        first = _train(
            provisioned,
            f"SCRIPT={root / 'job.py'}",
            f"ARGS=--checkpoint-dir {name} --out-dir {shared}",
        )
        assert first.returncode == 0, first.stdout[-3000:] + first.stderr
        run_id = run_id_in(first.stdout)
        before, before_shared = kept(original), kept(shared, (1,))
        for index in (1, 2):
            assert f"written by {run_id}" in before[index], before
        # Both ranks' files on /shared, seen from node1.
        assert before_shared[1].count(f"written by {run_id}") == 2, before_shared
        rerun = make("rerun", f"RUN={run_id}", timeout=900)
        out = rerun.stdout
        assert rerun.returncode == 0, out[-3000:] + rerun.stderr
        again = run_id_in(out)
        apart = f"{name}-rerun-{again}"
        assert f"--checkpoint-dir {apart} under each node's checkpoint_root" in out, out[-3000:]
        assert f"--out-dir /shared/{apart}" in out, out[-3000:]
        for flag in ("checkpoint-dir", "out-dir"):
            for node, rank in (("node1", 0), ("node2", 1)):
                assert f"[{node}] rank {rank} found none in its {flag}" in out, out[-3000:]
        assert kept(original) == before  # the original's, byte for byte
        assert kept(shared, (1,)) == before_shared
        after = kept(f"{DEFAULT_CHECKPOINT_ROOT}/{apart}")
        for index in (1, 2):
            assert f"written by {again}" in after[index], after
        assert kept(f"/shared/{apart}", (1,))[1].count(f"written by {again}") == 2
        assert run_record(again)["rerun_of"] == run_id
    finally:
        for index in (1, 2):
            on_node(provisioned.cluster, index, f"rm -rf {original} {original}-rerun-*")
        on_node(provisioned.cluster, 1, f"rm -rf {shared} {shared}-rerun-*")


def test_make_data_sends_a_dataset_once(provisioned, tmp_path):
    dataset = tmp_path / f"digits-{uuid.uuid4().hex[:6]}"
    (dataset / "train").mkdir(parents=True)
    for index in range(20):
        (dataset / "train" / f"{index}.bin").write_bytes(bytes([index]) * 50_000)
    first = make("data", f"INVENTORY={provisioned.inventory}", f"SRC={dataset}")
    assert first.returncode == 0, first.stdout + first.stderr
    assert re.search(r"node1 +20 file\(s\) sent", first.stdout), first.stdout
    assert re.search(r"node2 +20 file\(s\) sent", first.stdout), first.stdout
    second = make("data", f"INVENTORY={provisioned.inventory}", f"SRC={dataset}")
    assert second.returncode == 0, second.stdout + second.stderr
    assert "Done: 0 file(s)," in second.stdout and "(every node already had it)" in second.stdout
    for index in (1, 2):
        there = on_node(
            provisioned.cluster, index, f"ls {DEFAULT_DATA_ROOT}/{dataset.name}/train | wc -l"
        )
        assert there.strip() == "20"
        on_node(provisioned.cluster, index, f"rm -rf {DEFAULT_DATA_ROOT}/{dataset.name}")


def test_a_node_killed_mid_run_with_restarts_resumes_from_the_checkpoints_on_the_nodes_disks(
    provisioned, reference_ddp, tmp_path
):
    checkpoints = f"restart-{uuid.uuid4().hex[:8]}"
    args = [
        *TINY,
        "--steps",
        str(REFERENCE_STEPS),
        "--checkpoint-every",
        "4",
        "--checkpoint-dir",
        checkpoints,
        "--log-every",
        "1",
        "--step-delay",
        "0.3",
        "--out",
        "model.pt",
    ]
    process = start_train(provisioned.inventory, "RESTARTS=1", "ARGS=" + " ".join(args))
    seen = read_until(process, "[node1] step  9/")  # step 8 saved on both nodes
    first = run_id_in(seen)
    # The master: it holds the rendezvous and the port lock, the harder node to lose.
    output = kill_node(process, provisioned.cluster.config.container(1))
    restarting = "[launcher] restart 1 of 1: waiting up to"
    try:
        # The job stopped everywhere and the restart began (first() waits at most 60 s: a bound
        # against a hang; how long the stop takes is make bench's to measure, never asserted).
        output.first(restarting)
        assert f"Job {first} FAILED on node1" in output.text
    finally:
        _bring_back(provisioned, 1)
    output.end(timeout=600)
    assert process.returncode == 0, output.stamped[-4000:]
    rest = output.text[output.text.index(restarting) :]
    assert re.search(
        rf"\[launcher\] job {first}-r1: every node answers \(waited \d+ s\); restart 1 of 1", rest
    ), rest[-3000:]
    assert re.findall(r"\[node1\] resuming from step (\d+)", rest) == ["8"], rest[-3000:]
    assert re.search(rf"^Job {first}-r1 succeeded after .*, restart 1 of 1\.$", rest, re.M), rest
    inventory = load(provisioned.inventory)
    for run_id in (first, f"{first}-r1"):
        assert leftovers(inventory, run_id) == {"node1": "", "node2": ""}, run_id
    lock = f"{REMOTE_LOCK_ROOT}/port-{inventory.rendezvous_port}"
    assert on_node(provisioned.cluster, 1, f"test -e {lock} && echo still held; true") == ""
    # The master's run directory came back after the restart: the uninterrupted result.
    _out_as_uninterrupted(provisioned, reference_ddp, first, checkpoints, 1e-6)


@pytest.mark.extended
def test_a_node_lost_for_good_is_dropped_and_the_job_ends_on_the_other_as_uninterrupted(
    provisioned, reference_ddp
):
    """Issue 31 in the containers: node2 killed after step 8's checkpoint and left dead past
    the restart's wait; with MIN_NODES=1 the job goes on in node1's container alone, from its
    own disk's step 8, computing both planned ranks' batches, and ends with the parameters of
    the uninterrupted 2-node run."""
    checkpoints = f"drop-{uuid.uuid4().hex[:8]}"
    args = [*TINY, "--steps", str(REFERENCE_STEPS), "--checkpoint-every", "4"]
    args += ["--checkpoint-dir", checkpoints, "--log-every", "1", "--step-delay", "0.3"]
    process = subprocess.Popen(
        [str(VENV_BIN / "train"), "-i", str(provisioned.inventory), "--nnodes", "2"]
        + ["--restarts", "1", "--restart-wait", "10", "--min-nodes", "1"]
        + ["--", *args, "--out", "model.pt"],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    seen = read_until(process, "[node1] step  9/")  # step 8 saved on both nodes
    first = run_id_in(seen)
    output = kill_node(process, provisioned.cluster.config.container(2))
    try:
        output.end(timeout=600)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        _bring_back(provisioned, 2)
    rest = output.text
    assert process.returncode == 0, output.stamped[-4000:]
    assert re.search(r"\[launcher\] node2 lost at restart 1 after step \d+: dropped", rest), rest
    assert "[launcher] continuing on node1: 1 of 2 nodes (--min-nodes 1)" in rest, rest[-3000:]
    again = rest[rest.index(f"job {first}-r1:") :]
    assert "keeping the first run's world of 2 process(es)" in again.splitlines()[0], again[:500]
    assert re.findall(r"\[node1\] resuming from step (\d+)", again) == ["8"], again[-3000:]
    assert "[node2]" not in again, again[-3000:]
    _out_as_uninterrupted(provisioned, reference_ddp, first, checkpoints, 1e-5)
    no_containers_left(provisioned.cluster, (1, 2))


def _out_as_uninterrupted(provisioned, reference_ddp, run_id, checkpoints, within) -> None:
    """The run's --out, back in .runs/RUN-ID/model.pt, within `within` of the uninterrupted
    run's parameters; then the run's directory and its checkpoints on the nodes removed."""
    runs = REPO_ROOT / ".runs" / run_id
    try:
        assert max_difference(load_state(runs / "model.pt"), reference_ddp.state) < within
    finally:
        shutil.rmtree(runs, ignore_errors=True)
        for index in (1, 2):
            on_node(provisioned.cluster, index, f"rm -rf {DEFAULT_CHECKPOINT_ROOT}/{checkpoints}")


def test_a_checkpoint_dir_outside_every_mount_is_refused_before_launch(provisioned):
    proc = _train(provisioned, "ARGS=--checkpoint-dir /var/tmp/ckpt")
    assert _exit_code(proc.returncode, proc.stderr) == 2, proc.stdout + proc.stderr  # bad input
    error = proc.stderr.strip().splitlines()[0]
    assert proc.stdout == "" and error == (
        "Error: --checkpoint-dir /var/tmp/ckpt is outside every directory mounted into the job's "
        f"container ({DEFAULT_CHECKPOINT_ROOT}, {DEFAULT_DATA_ROOT}, /shared): it would vanish "
        f"with the container (try a relative --checkpoint-dir (under checkpoint_root "
        f"{DEFAULT_CHECKPOINT_ROOT}), or adding /var/tmp/ckpt to the inventory's container_mounts)"
    )


def _rerun_ends_as_uninterrupted(provisioned, reference_ddp, args: list[str]) -> str:
    """The same job again, to the end: it resumes and ends with the uninterrupted run's
    parameters (its --out comes back in .runs/JOB-ID/model.pt)."""
    rerun = _train(provisioned, "ARGS=" + " ".join([*args, "--out", "model.pt"]))
    assert rerun.returncode == 0, rerun.stdout[-3000:]
    runs = REPO_ROOT / ".runs" / run_id_in(rerun.stdout)
    try:
        assert max_difference(load_state(runs / "model.pt"), reference_ddp.state) < 1e-6
    finally:
        shutil.rmtree(runs, ignore_errors=True)
    return rerun.stdout


def test_a_node_killed_while_writing_a_checkpoint_keeps_the_previous_one_in_containers(
    provisioned, reference_ddp
):
    checkpoints = f"killed-{uuid.uuid4().hex[:8]}"
    directory = f"{DEFAULT_CHECKPOINT_ROOT}/{checkpoints}"
    args = [
        *TINY,
        "--steps",
        str(REFERENCE_STEPS),
        "--checkpoint-every",
        "4",
        "--keep",
        "1",
        "--checkpoint-dir",
        checkpoints,
    ]
    process = start_train(
        provisioned.inventory,
        "ARGS=" + " ".join([*args, "--checkpoint-pause-step", "8", "--checkpoint-pause-rank", "1"]),
    )
    try:
        seen = read_until(process, "[node2] [rank 1] checkpoint step 8: ")
        output = kill_node(process, provisioned.cluster.config.container(2))
        output.end(timeout=120)  # a bound against a hang; the stop's time is make bench's
        assert _exit_code(process.returncode, output.text) == 1, output.text[-3000:]
        assert " FAILED on node2" in output.text
        remembered = json.loads((REPO_ROOT / ".runs" / run_id_in(seen) / "run.json").read_text())
        assert (remembered["result"], remembered["failed_node"], remembered["exit_code"]) == (
            "failed",
            "node2",
            1,
        ), remembered
        assert remembered["last_step"], remembered  # the step line the job printed last
        # node1, which lived on: no process of the job, no listener on the rendezvous port.
        inventory = load(provisioned.inventory)
        left = leftovers(inventory, run_id_in(seen), inventory.hosts[:1])
        assert left == {"node1": ""}, left
    finally:
        if process.poll() is None:
            process.kill()
        _bring_back(provisioned, 2)
    try:
        # The partial step 8 never got its name on node2; step 4 is there, on the node's disk.
        written = on_node(provisioned.cluster, 2, f"ls -A {directory}").split()
        assert written[0].startswith(f".{file_name(8, 1)}.") and written[1:] == [file_name(4, 1)]
        rerun = _rerun_ends_as_uninterrupted(provisioned, reference_ddp, args)
        assert (
            "[node1] resuming from step 4, the newest step every rank has (rank 0 has 4, 8; "
            "rank 1 has 4)"
        ) in rerun.splitlines()
        assert f"steps          {REFERENCE_STEPS} (resumed from step 4)" in rerun
        # The partial step 8 is swept, and --keep 1 leaves the last step alone.
        assert on_node(provisioned.cluster, 2, f"ls -A {directory}").split() == [
            file_name(REFERENCE_STEPS, 1)  # a multiple of 4: the last step is saved
        ]
    finally:
        for index in (1, 2):
            on_node(provisioned.cluster, index, f"rm -rf {directory}")


def test_a_node_killed_before_or_in_the_first_checkpoint_write_loses_nothing_in_containers(
    provisioned, reference_ddp
):
    """The data-safety matrix's DDP cells "node killed before the first checkpoint" and "killed
    in the first write", in the training containers, one after the other on one checkpoint
    directory (node-local, every 4 steps). The unlucky moments are made certain by test hooks:
    1. node2's rank sleeps after step 1 (--step-delay), so node1's rank waits in step 2's
       all-reduce and no rank can reach step 4 before node2 is killed: no file of the job on
       either disk.
    2. The job again finds nothing of the lost run, says so and starts from step 0; node2's rank
       pauses inside its write of step 4, the first (--checkpoint-pause-step), and node2 is
       killed once node1's rank has named its own file of step 4: node1 holds step 4 whole,
       node2 only a file under a temporary name.
    3. The job again, to the end: DDP's state is the same on every rank, so it resumes from
       node1's step 4 and sends it to node2, sweeps the half-written file, and ends as the
       uninterrupted run does."""
    checkpoints = f"first-{uuid.uuid4().hex[:8]}"
    directory = f"{DEFAULT_CHECKPOINT_ROOT}/{checkpoints}"
    args = [
        *TINY,
        "--steps",
        str(REFERENCE_STEPS),
        "--checkpoint-every",
        "4",
        "--log-every",
        "1",
        "--checkpoint-dir",
        checkpoints,
    ]

    def listed(index: int) -> list[str]:
        return on_node(provisioned.cluster, index, f"ls -A {directory} 2>/dev/null || true").split()

    held = ["--step-delay", "600", "--step-delay-rank", "1"]
    process = start_train(provisioned.inventory, "ARGS=" + " ".join([*args, *held]))
    try:
        seen = read_until(process, f"[node1] step  1/{REFERENCE_STEPS}")
        output = kill_node(process, provisioned.cluster.config.container(2))
        output.end(timeout=120)  # a bound against a hang
        assert _exit_code(process.returncode, output.text) == 1, output.text[-3000:]
        assert " FAILED on node2" in output.text, output.text[-3000:]
        # node1's rank never got past step 2's all-reduce: step 4's checkpoint was never begun.
        said = seen + output.text
        assert f"[node1] step  2/{REFERENCE_STEPS}" not in said, said[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
        _bring_back(provisioned, 2)
    try:
        assert listed(1) == [] and listed(2) == []  # nothing written, nothing half-written
        paused = ["--checkpoint-pause-step", "4", "--checkpoint-pause-rank", "1"]
        process = start_train(provisioned.inventory, "ARGS=" + " ".join([*args, *paused]))
        try:
            seen = read_until(process, "[node2] [rank 1] checkpoint step 4: ")
            assert re.search(
                rf"^\[node1\] no checkpoints in \S*/{checkpoints}: starting from step 0$",
                seen,
                re.M,
            ), seen[-3000:]
            wait_until(lambda: file_name(4, 0) in listed(1), 60, "node1 never named its step 4")
            output = kill_node(process, provisioned.cluster.config.container(2))
            output.end(timeout=120)
            assert _exit_code(process.returncode, output.text) == 1, output.text[-3000:]
        finally:
            if process.poll() is None:
                process.kill()
            _bring_back(provisioned, 2)
        assert listed(1) == [file_name(4, 0)]
        written = listed(2)  # step 4 of rank 1 only under a temporary name, never named
        assert len(written) == 1 and written[0].startswith(f".{file_name(4, 1)}."), written
        rerun = _rerun_ends_as_uninterrupted(provisioned, reference_ddp, args)
        assert (
            "[node1] resuming from step 4, the newest step every rank with checkpoints has "
            "(rank 0 has 4; rank 1 has none); rank 0 sends its state to rank 1, whose node "
            "holds none"
        ) in rerun.splitlines(), rerun[-3000:]
        assert not [name for name in listed(2) if name.startswith(".")]  # swept
    finally:
        for index in (1, 2):
            on_node(provisioned.cluster, index, f"rm -rf {directory}")


def test_ctrl_c_during_a_checkpoint_write_in_containers_ends_with_130_and_keeps_the_last_one(
    provisioned,
):
    checkpoints = f"interrupted-{uuid.uuid4().hex[:8]}"
    directory = f"{DEFAULT_CHECKPOINT_ROOT}/{checkpoints}"
    args = [*TINY, "--steps", str(REFERENCE_STEPS), "--checkpoint-every", "4"]
    # The launcher itself, not make: its exit code is the one asserted.
    process = subprocess.Popen(
        [
            str(VENV_BIN / "train"),
            "-i",
            str(provisioned.inventory),
            "--",
            *args,
            "--checkpoint-dir",
            checkpoints,
            "--checkpoint-pause-step",
            "8",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        seen = read_until(
            process, "[node1] [rank 0] checkpoint step 8: ", "[node2] [rank 1] checkpoint step 8: "
        )
        rest, _ = interrupt(process)
    finally:
        if process.poll() is None:
            process.kill()
    try:
        assert process.returncode == 130, rest[-3000:]
        run_id = run_id_in(seen)
        assert f"Job {run_id} interrupted" in rest
        # the stop reached and confirmed both nodes; how long Ctrl-C takes is make bench's to
        # measure (docs/benchmarks.md), never asserted here
        confirmed = r"\[launcher\] stopped: node1 in [\d.]+ s, node2 in [\d.]+ s\n"
        assert re.search(confirmed, rest), rest[-3000:]
        remembered = run_record(run_id)
        assert (remembered["result"], remembered["exit_code"]) == ("interrupted", 130)
        assert leftovers(load(provisioned.inventory), run_id) == {"node1": "", "node2": ""}
        no_containers_left(provisioned.cluster, (1, 2))
        # The master's run directory is not copied home after Ctrl-C (stopped now, as asked):
        # said, and it stays on the master, where the line says.
        where = f"{REMOTE_RUN_ROOT}/{run_id}"
        assert (
            f"Run directory of node1: not copied (interrupted): it stays in node1:{where}"
        ) in rest.splitlines(), rest[-3000:]
        assert on_node(provisioned.cluster, 1, f"test -d {where} && echo kept").strip() == "kept"
        # Step 4 is complete on each node's disk; step 8 never got its name.
        for index, rank in ((1, 0), (2, 1)):
            written = sorted(on_node(provisioned.cluster, index, f"ls -A {directory}").split())
            assert written[1:] == [file_name(4, rank)], (index, written)
            assert written[0].startswith(f".{file_name(8, rank)}."), (index, written)
            assert written[0].endswith(".tmp"), (index, written)
    finally:
        shutil.rmtree(REPO_ROOT / ".runs" / run_id_in(seen), ignore_errors=True)
        for index in (1, 2):
            on_node(provisioned.cluster, index, f"rm -rf {directory}")


def _summary(stdout: str) -> list[str]:
    """The launcher's summary: from its `Job ...` line on."""
    return stdout[stdout.index("\nJob ") + 1 :].splitlines()


def test_a_full_or_read_only_checkpoint_dir_in_containers_is_one_error_line(
    provisioned, reference_ddp
):
    checkpoints = f"small-{uuid.uuid4().hex[:8]}"
    directory = f"{DEFAULT_CHECKPOINT_ROOT}/{checkpoints}"
    # node2's checkpoint directory is a small filesystem of its own, mounted on the node before
    # the job: the container sees it through its mount of checkpoint_root.
    on_node(
        provisioned.cluster,
        2,
        f"mkdir -p {directory} && mount -t tmpfs -o size=512k tmpfs {directory}",
    )
    args = [
        *TINY,
        "--steps",
        str(REFERENCE_STEPS),
        "--checkpoint-every",
        "4",
        "--checkpoint-dir",
        checkpoints,
    ]
    try:
        first = _train(
            provisioned,
            "ARGS="
            + " ".join(
                [*TINY, "--steps", "4", "--checkpoint-every", "4", "--checkpoint-dir", checkpoints]
            ),
        )
        assert first.returncode == 0, first.stdout[-3000:]
        on_node(
            provisioned.cluster,
            2,
            f"dd if=/dev/zero of={directory}/filler bs=4k 2>/dev/null",
            check=False,
        )
        # With TensorBoard on: what rank 0 wrote comes back although the job failed.
        with_events = [arg for arg in args if arg != "--no-tensorboard"]
        full = _train(provisioned, "ARGS=" + " ".join(with_events))
        assert _exit_code(full.returncode, full.stderr) == 1, full.stdout[-3000:]
        error = (
            f"Error: cannot write checkpoint step 8 to {directory}: No space left on "
            "device; step 4 is kept (try freeing space there, a smaller --keep, or a "
            "--checkpoint-dir with more room)"
        )
        assert f"[node2] {error}" in full.stdout.splitlines(), full.stdout[-3000:]
        summary = _summary(full.stdout)
        assert summary[0].startswith("Job ") and " FAILED on node2 after " in summary[0], summary
        assert f"  | {error}" in summary, summary
        kept = sorted(on_node(provisioned.cluster, 2, f"ls -A {directory}").split())
        assert kept == ["filler", file_name(4, 1)], kept
        failed_run = REPO_ROOT / ".runs" / run_id_in(full.stdout)
        events = list((failed_run / "tensorboard").glob("events.out.tfevents.*"))
        shutil.rmtree(failed_run, ignore_errors=True)
        assert events, full.stdout[-3000:]
        assert f"TensorBoard: make tensorboard RUN={failed_run.name}" in full.stdout
        on_node(provisioned.cluster, 2, f"rm {directory}/filler && mount -o remount,ro {directory}")
        read_only = _train(provisioned, "ARGS=" + " ".join(args))
        assert _exit_code(read_only.returncode, read_only.stderr) == 1
        assert (
            f"[node2] Error: cannot write checkpoints to {directory}: Read-only file system "
            "(try a writable --checkpoint-dir)"
        ) in read_only.stdout.splitlines()
        assert " FAILED on node2 after " in _summary(read_only.stdout)[0]
        assert not re.search(r"\] step +\d+/", read_only.stdout)  # before the first step
        on_node(provisioned.cluster, 2, f"mount -o remount,rw {directory}")
        rerun = _rerun_ends_as_uninterrupted(provisioned, reference_ddp, args)
        assert f"steps          {REFERENCE_STEPS} (resumed from step 4)" in rerun
    finally:
        on_node(provisioned.cluster, 2, f"umount {directory}", check=False)
        for index in (1, 2):
            on_node(provisioned.cluster, index, f"rm -rf {directory}")


def test_an_edit_to_the_projects_own_workloads_runs_without_a_new_image(provisioned, tmp_path):
    """The image holds no project code: training.ddp comes from the controller at every launch.
    A copy of the packages with one edit (WORKDIR) runs the edit on both nodes."""
    copy = tmp_path / "tmn-copy"
    for package in ("cluster", "netcheck", "training"):
        shutil.copytree(
            REPO_ROOT / package, copy / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    init = copy / "training" / "__init__.py"
    init.write_text(init.read_text() + "\nprint('edited workloads here', flush=True)\n")
    proc = _train(
        provisioned,
        f"WORKDIR={copy}",
        "MODULE=training.ddp",
        "ARGS=" + " ".join([*TINY, "--steps", "2"]),
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    for node in ("node1", "node2"):
        assert f"[{node}] edited workloads here" in proc.stdout.splitlines()
    shutil.rmtree(REPO_ROOT / ".runs" / run_id_in(proc.stdout), ignore_errors=True)


def test_an_nccl_job_whose_gpus_do_not_answer_stops_at_start_naming_the_node(provisioned, tmp_path):
    # The inventory promises a GPU on every node; the simulated nodes have none, as a node whose
    # driver broke after a kernel update: NCCL is chosen for the job, and every node is asked.
    document = yaml.safe_load(provisioned.inventory.read_text())
    for host in document["all"]["children"]["nodes"]["hosts"].values():
        host["gpus"] = 1
    inventory = tmp_path / "inventory.yml"
    inventory.write_text(yaml.safe_dump(document, sort_keys=False))
    proc = make("train", f"INVENTORY={inventory}", "NNODES=2", timeout=600)
    assert _exit_code(proc.returncode, proc.stderr) == 1, proc.stdout[-3000:] + proc.stderr
    error = proc.stderr.strip().splitlines()[0]
    assert re.match(r"Error: on node[12]: its GPUs do not answer \(nvidia-smi failed: ", error), (
        error
    )
    assert "set gpus: 0 for it in the inventory" in error
    assert "[node1]" not in proc.stdout and "[node2]" not in proc.stdout  # nothing started
    # Model parallel on 1-GPU nodes is refused before anything is contacted.
    proc = make(
        "train",
        f"INVENTORY={inventory}",
        "NNODES=2",
        "MODULE=training.model_parallel",
        timeout=600,
    )
    assert _exit_code(proc.returncode, proc.stderr) == 2, proc.stdout[-3000:] + proc.stderr
    assert proc.stderr.startswith(
        "Error: training.model_parallel spans 2 GPUs per process, but node 'node1' has 1 for "
        "the job (inventory gpus: 1) (try machines with 2 GPUs"
    ), proc.stderr


HAND_TYPED = """\
import torch, torch.distributed as dist
dist.init_process_group("gloo")
total = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(total)
conf = open("/etc/nccl.conf").read().strip()
try:
    open("/etc/nccl.conf", "a").close()
    write = "writable"
except OSError as error:
    write = error.strerror
print(f"rank {dist.get_rank()} sum {int(total.item())} nccl.conf {conf}; {write}", flush=True)
dist.destroy_process_group()
"""


def test_a_project_with_packages_named_like_ours_runs_unchanged_in_the_containers(
    provisioned, tmp_path
):
    """Its own training/, cluster/ and launch/ packages hide nothing of ours, and ours hide
    nothing of its: a plain script, a --local_rank script, its module training.main with
    WORKDIR=, and our training.ddp with that WORKDIR."""
    root = namesake_project(tmp_path / "namesake")
    check_namesake_project_runs(lambda *variables: _train(provisioned, *variables), root)
    no_containers_left(provisioned.cluster, (1, 2))


def test_a_torchrun_typed_by_hand_in_a_training_container_sees_nccls_configuration(provisioned):
    """No launcher: on each node a training container started with the project's options and a
    plain torchrun typed into it. NCCL reads /etc/nccl.conf in every process (NCCL's
    documentation); the file provisioning wrote is there, read-only, naming the compute
    interface. (gloo, the only backend without GPUs, does not read it: it is given its
    interface here as a user would.) NCCL itself cannot run here: no GPU."""
    from torch_multinode.cluster.containers import NCCL_CONF_GUARD, training_container_options
    from torch_multinode.cluster.inventory_read import load

    inventory = load(provisioned.inventory)
    master = inventory.hosts[0]
    label = f"torch-multinode.test=hand-{uuid.uuid4().hex[:8]}"
    started = []
    for host in inventory.hosts:
        typed = [
            *training_container_options(host, inventory.container_memlock, label),
            "-e",
            f"GLOO_SOCKET_IFNAME={host.compute_interface}",
            inventory.training_image,
            "python3",
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            "--nproc-per-node=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={master.compute_ip}:29611",
            "--rdzv-id=hand-typed",
            f"--local-addr={host.compute_ip}",
            "--no-python",
            "python3",
            "-c",
            HAND_TYPED,
        ]
        command = f"{NCCL_CONF_GUARD} && {shlex.join(typed)}"
        container = provisioned.cluster.config.container(inventory.hosts.index(host) + 1)
        started.append(
            subprocess.Popen(
                ["docker", "exec", container, "sh", "-c", command],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    try:
        outputs = [process.communicate(timeout=240)[0] for process in started]
    finally:
        for index in (1, 2):
            on_node(
                provisioned.cluster,
                index,
                f"docker ps -q --filter label={label} | xargs -r docker rm -f",
                check=False,
            )
            started[index - 1].kill()
    for index, (process, output) in enumerate(zip(started, outputs, strict=True)):
        assert process.returncode == 0, output
        host = inventory.hosts[index]
        # Read-only in the container: a job cannot change what every NCCL process reads.
        wanted = f"sum 3 nccl.conf NCCL_SOCKET_IFNAME=={host.compute_interface}; Read-only"
        assert wanted in output, output


LAYER_LINE = re.compile(r"dependencies: built (torch-multinode/deps:[0-9a-f]+) \(")
SHIPPED = re.compile(
    r"dependencies: Done: (\S+) \(\w+\) on every node, through the registry in .*? \((.*)\)\.$",
    re.M,
)
SIZE = re.compile(r"(node\d) ([\d.]+) (B|KB|MB|GB)")


def _layers(image: str) -> list[str]:
    found = sim.docker("image", "inspect", "--format", "{{json .RootFS.Layers}}", image)
    return json.loads(found.stdout)


def test_a_projects_requirements_are_one_layer_built_once_shipped_by_layers_and_the_same_here(
    provisioned, tmp_path
):
    """Issue 50: a project whose requirements.txt names packages the image lacks trains on both
    nodes in a layer on the training image, built and shipped by the first run; a run with the
    same requirements builds and ships nothing, and says so; one more requirement makes one new
    layer on the same base, and only it travels; a requirement of another torch is refused
    before anything is built, in one line; each run's record holds what was resolved; a local
    job of the project runs with the same packages, beside .venv, which stays as it was. The
    packages are wheels made here, and pip takes them from here alone (the network rule)."""
    index = tmp_path / "index"
    wheel(index, "demo-config", "2.3.0", module="LR = 0.5\n")
    wheel(index, "demo-progress", "4.67.1")
    offline = offline_pip(index)
    project = tmp_path / "dependent"
    project.mkdir()
    script = project / "train.py"
    script.write_text(DEPENDENT)
    wanted = project / "requirements.txt"
    wanted.write_text("demo-config\n")
    base = _layers(TEST_IMAGE)
    made: list[str] = []
    runs: list[str] = []
    try:
        # The first run: resolved here, built, shipped, trained on both nodes.
        first = _train(provisioned, f"SCRIPT={script}", env=offline)
        out = first.stdout
        assert first.returncode == 0, out[-3000:] + first.stderr
        runs.append(run_id_in(out))
        layer = LAYER_LINE.search(out).group(1)
        made.append(layer)
        assert f"[launcher] dependencies: building {layer}, one layer on {TEST_IMAGE} (" in out
        assert _layers(layer) == [*base, _layers(layer)[-1]]  # one layer on the base
        for node, rank in (("node1", "0"), ("node2", "1")):
            assert re.search(
                rf"^\[{node}\] rank {rank}: demo-config 2.3.0 demo-progress none; trained 2 ",
                out,
                re.M,
            ), out[-3000:]
        config_version = dependent_versions(out, "0").split()[1]
        recorded = run_record(runs[0])
        assert recorded["dependencies"]["source"] == "requirements.txt"
        assert recorded["dependencies"]["requirements"] == ["demo-config"]
        assert recorded["dependencies"]["resolved"] == ["demo-config==2.3.0"]
        assert recorded["dependencies"]["image"]["tag"] == layer
        assert recorded["image"]["name"] == layer  # the job ran in the layer
        # The same requirements again: nothing built, nothing shipped, said so.
        second = _train(provisioned, f"SCRIPT={script}", "ARGS=--versions-only", env=offline)
        out = second.stdout
        assert second.returncode == 0, out[-3000:] + second.stderr
        runs.append(run_id_in(out))
        assert (
            f"[launcher] dependencies: {layer} holds requirements.txt's "
            f"{len(recorded['dependencies']['resolved'])} package(s) on {TEST_IMAGE} already: "
            "nothing to build"
        ) in out.splitlines()
        assert re.search(
            rf"^\[launcher\] dependencies: every node holds {re.escape(layer)} \(\w+\) "
            "already: nothing to ship$",
            out,
            re.M,
        ), out[-3000:]
        assert "Step 1/" not in out and "Shipping" not in out
        assert dependent_versions(out, "1") == f"demo-config {config_version} demo-progress none"
        # One more requirement: one new layer on the same base, and only that layer travels.
        wanted.write_text("demo-config\ndemo-progress\n")
        third = _train(provisioned, f"SCRIPT={script}", "ARGS=--versions-only", env=offline)
        out = third.stdout
        assert third.returncode == 0, out[-3000:] + third.stderr
        runs.append(run_id_in(out))
        changed = LAYER_LINE.search(out).group(1)
        made.append(changed)
        assert changed != layer
        assert _layers(changed)[:-1] == base  # on the training image, not on the first layer
        shipped = SHIPPED.search(out)
        assert shipped is not None and shipped.group(1) == changed, out[-3000:]
        sizes = {
            node: float(value) * {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9}[unit]
            for node, value, unit in SIZE.findall(shipped.group(2))
        }
        assert set(sizes) == {"node1", "node2"} and max(sizes.values()) < 20e6, shipped.group(0)
        on_nodes = dependent_versions(out, "0")
        assert on_nodes == f"demo-config {config_version} demo-progress 4.67.1"
        assert dependent_versions(out, "1") == on_nodes
        resolved = run_record(runs[-1])["dependencies"]["resolved"]
        assert resolved == ["demo-config==2.3.0", "demo-progress==4.67.1"]
        # Another torch: refused before anything is resolved or built, in one line.
        wanted.write_text("demo-config\ndemo-progress\ntorch==2.13.0\n")
        refused = _train(provisioned, f"SCRIPT={script}", env=offline)
        assert _exit_code(refused.returncode, refused.stderr) == 2, refused.stdout[-3000:]
        assert refused.stderr.splitlines()[0] == (
            f"Error: requirements.txt: torch==2.13.0, which would replace the torch 2.14.1 of "
            f"the training image {TEST_IMAGE} (try leaving torch out of requirements.txt, or a "
            "range that holds 2.14.1: jobs run with the torch, torchvision and CUDA libraries of "
            "the environment they run in)"
        ), refused.stderr
        assert "dependencies: resolving" not in refused.stdout and "Step 1/" not in refused.stdout
        assert "[node1]" not in refused.stdout and "[node2]" not in refused.stdout
        # The same project here, with the third run's requirements: the same packages, in a
        # directory beside .venv, named on the job's first line; .venv has none of them.
        wanted.write_text("demo-config\ndemo-progress\n")
        here = make(
            "train",
            f"SCRIPT={script}",
            "NPROC=1",
            "ARGS=--versions-only",
            timeout=600,
            env=offline,
        )
        assert here.returncode == 0, here.stdout[-3000:] + here.stderr
        runs.append(re.search(r"\[launcher\] local job (tmn-\w+) in ", here.stdout).group(1))
        header = next(line for line in here.stdout.splitlines() if "] local job " in line)
        assert re.search(
            r"\(environment \S+ \+ \S+/\.cache/torch-multinode/deps/[0-9a-f]+/site\)", header
        ), header
        assert dependent_versions(here.stdout, "0") == on_nodes
        local_record = run_record(runs[-1])["dependencies"]
        assert local_record["image"] is None and local_record["directory"].endswith("/site")
        venv = subprocess.run(
            [
                str(VENV_BIN / "python"),
                "-c",
                "import importlib.util as u; print(u.find_spec('demo_config'))",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        assert venv.stdout.strip() == "None"
    finally:
        for tag in made:
            for index in (1, 2):
                on_node(provisioned.cluster, index, f"docker rmi {tag}", check=False)
            sim.docker("rmi", tag, check=False)
        for run in runs:
            shutil.rmtree(REPO_ROOT / ".runs" / run, ignore_errors=True)


# A user's script that imports nothing of torch's: each rank says it is ready, waits for the
# test's word (a file in /shared, which every node and container sees), and rank 0 then writes
# 1.6 MB of outputs into its run directory (the same bytes each time: digests are known here).
FULL_DISKS_SCRIPT = """\
import os, pathlib, random, sys, time
rank = int(os.environ["RANK"])
print(f"rank {rank} ready", flush=True)
while not pathlib.Path(sys.argv[1]).exists():
    time.sleep(0.2)
if rank == 0:
    for index in range(4):
        out = pathlib.Path(os.environ["TMN_RUN_DIR"]) / f"events-{index}.bin"
        out.write_bytes(random.Random(index).randbytes(400_000))
for line in range(300):  # more than a full disk's last page holds of the nodes' logs
    print(f"rank {rank} line {line} " + "x" * 60)
print(f"rank {rank} done", flush=True)
"""


def test_full_disks_here_lose_no_record_no_output_and_no_repository_in_containers(
    provisioned, tmp_path
):
    """The data-safety matrix's code snapshot, run record and run directory brought home x a
    full disk, with a job in the training containers. The project's repository is on a filled
    2 MB filesystem with an edit git must write: the launch says in one line that there is no
    snapshot and git's reason, and the repository is as it was. `.runs/` is a 1 MB filesystem
    that the test fills while the job runs: the job's result stands (exit 0), one line says the
    record was not updated and stays as last written (whole, with no temporary file beside
    it), one says the master's run directory was not copied, with rsync's cause, and the
    master's files are as they were, nothing half-copied here. Each node's log there ends where
    the disk filled, said once, and every line of the job still shows."""
    here = tmp_path / "here"
    here.mkdir()
    go = f"/shared/go-{uuid.uuid4().hex[:8]}"
    run_id = None
    try:
        with (
            small_filesystem(tmp_path / "repo-disk", "2m") as repo_disk,
            small_filesystem(here / ".runs", "1m") as runs,
        ):
            top = repo_disk / "project"
            git = git_repository(top, {"train.py": FULL_DISKS_SCRIPT})
            (top / "helper.py").write_text("X = 2\n" * 50)  # new code: a blob git must write
            fill(repo_disk)

            def repository() -> tuple[str, ...]:
                return tuple(
                    subprocess.run([*git, *args], capture_output=True, text=True).stdout
                    for args in (["status", "--porcelain"], ["rev-parse", "HEAD"], ["for-each-ref"])
                ) + tuple((top / name).read_text() for name in ("train.py", "helper.py"))

            before = repository()
            job = subprocess.Popen(
                [str(VENV_BIN / "train"), "-i", str(provisioned.inventory), "--nnodes", "2"]
                + ["--script", str(top / "train.py"), "--", go],
                cwd=here,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            try:
                seen = read_until(job, "[node1] rank 0 ready", "[node2] rank 1 ready")
                run_id = run_id_in(seen)
                fill(runs)
                on_node(provisioned.cluster, 1, f"touch {go}")
                rest, _ = job.communicate(timeout=300)
            finally:
                if job.poll() is None:
                    job.kill()
            out = seen + rest
            assert job.returncode == 0, out[-4000:]  # the job's own result
            said = [line for line in out.splitlines() if line.startswith("[launcher] ")]
            # The nodes' logs end where the disk filled, each said once; every line still shows.
            for index, node in enumerate(("node1", "node2")):
                assert (
                    f"[launcher] the log {Path('.runs') / run_id / f'{node}.log'} stops here: No "
                    "space left on device; the job goes on, its output still shown here"
                ) in said, said
                assert f"[{node}] rank {index} line 299 " + "x" * 60 in out, out[-3000:]
                assert f"[{node}] rank {index} done" in out, out[-3000:]
            (snapshot,) = [line for line in said if "code snapshot" in line]
            assert snapshot.startswith(
                "[launcher] no code snapshot for make rerun: git could not write it ("
            ), snapshot
            assert snapshot.endswith(": No space left on device)"), snapshot  # git's own words
            assert repository() == before  # the user's repository as it was

            remote = f"{REMOTE_RUN_ROOT}/{run_id}"
            where = f"node1:{remote}"
            (home,) = [line for line in said if line.startswith("[launcher] the run directory ")]
            assert home.startswith(f"[launcher] the run directory {where} was not copied from "), (
                home
            )
            assert "No space left on device" in home, home
            record_file = runs / run_id / "run.json"
            assert (
                f"[launcher] the run record {Path('.runs') / run_id / 'run.json'} was not updated "
                "with how it ended: No space left on device; it stays as last written (free space "
                "there for the next run's)"
            ) in said, said
            kept = json.loads(record_file.read_text())  # whole, as begun
            assert (kept["id"], kept["result"], kept["ended"]) == (run_id, "running", None), kept
            assert kept["code"]["snapshot"] is None and kept["code"]["why"].startswith(
                "git could not write it ("
            ), kept["code"]
            assert not [p.name for p in (runs / run_id).rglob(".*")], list(
                (runs / run_id).rglob("*")
            )

            # The master's outputs as rank 0 wrote them; what came here is whole.
            expected = {
                f"events-{index}.bin": hashlib.sha256(
                    random.Random(index).randbytes(400_000)
                ).hexdigest()
                for index in range(4)
            }
            on_master = digests_on_node(provisioned.cluster, 1, remote)
            assert {n: d for n, d in on_master.items() if n.startswith("events-")} == expected
            came = {n: d for n, d in digests(runs / run_id).items() if n.startswith("events-")}
            assert all(expected[name] == digest for name, digest in came.items()), came
    finally:
        on_node(provisioned.cluster, 1, f"rm -f {go}", check=False)
        if run_id is not None:
            for index in (1, 2):
                on_node(
                    provisioned.cluster, index, f"rm -rf {REMOTE_RUN_ROOT}/{run_id}", check=False
                )
