"""make train on an inventory with scheduler: slurm, in the training containers: the shared
provisioned cluster gets Slurm (the slurm role alone), and jobs go through sbatch. The default
job ends with the parameters of the same job through the SSH launcher, and a project of several
files with those its mathematics gives; a second job waits in the queue behind a running one,
and runs once Ctrl-C has cancelled the first and left nothing of it; a failing node is named
with its last lines, and with RESTARTS the job is requeued; a hung job's report names the rank
and its line; a node whose slurmd dies is named, and with MIN_NODES dropped for a new job on
the other. Slurm is stopped on the nodes afterwards."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import yaml

from tests.ansible.conftest import ansible_playbook
from tests.conftest import REPO_ROOT, VENV_BIN, make
from tests.helpers import (
    DEPENDENT,
    check_namesake_project_runs,
    dependent_versions,
    leftovers,
    namesake_project,
    no_containers_left,
    on_node,
    read_until,
    run_id_in,
    run_record,
    start_train,
)
from tests.training.conftest import SMALL_JOB
from torch_multinode.bench.wheels import offline_pip, wheel
from torch_multinode.cluster.inventory import DEFAULT_CHECKPOINT_ROOT as CHECKPOINT_ROOT
from torch_multinode.cluster.inventory_read import load

pytestmark = [pytest.mark.sim, pytest.mark.timeout(1800)]

TINY = "--model tiny --steps 4 --log-every 2 --no-tensorboard"
SHA = re.compile(r"\[rank 0\] parameters sha256 ([0-9a-f]{64})")

PROJECT_TRAIN = '''\
"""A user's project: its own package and a config beside the script."""
import hashlib
import os
import pathlib

import torch
import torch.distributed as dist
import yaml

from mylib.model import build

here = pathlib.Path(__file__).resolve().parent
config = yaml.safe_load((here / "config.yaml").read_text())
dist.init_process_group("gloo")
rank = dist.get_rank()
mark = pathlib.Path(config.get("fail_once_mark", "/nonexistent/mark"))
if rank == 1 and mark.parent.is_dir() and not mark.exists():
    mark.write_text("failed once")
    raise SystemExit("Error: rank 1 fails its first attempt")
torch.manual_seed(0)
model = build()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(config["steps"]):
    torch.manual_seed(100 * step + rank)
    loss = model(torch.randn(8, 4)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    for parameter in model.parameters():
        dist.all_reduce(parameter.grad)
        parameter.grad /= dist.get_world_size()
    optimizer.step()
digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
token = os.environ.get("PROJECT_TOKEN", "")
print(f"rank {rank}: project parameters {digest.hexdigest()}, token of {len(token)} characters",
      flush=True)
dist.destroy_process_group()
'''


@pytest.fixture(scope="module")
def slurm_inventory(provisioned, tmp_path_factory):
    """The provisioned cluster's inventory with scheduler: slurm, Slurm set up on its nodes;
    stopped there again at the end (the nodes as other tests found them)."""
    name = f"tmn-test-{uuid.uuid4().hex[:8]}"
    document = yaml.safe_load(provisioned.inventory.read_text())
    document["all"]["vars"]["scheduler"] = "slurm"
    path = tmp_path_factory.mktemp("slurm") / "inventory.yml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    # Slurm comes to nodes that already ran containers, as on a cluster in use: a container
    # runtime's cgroups there once hid from the role that slurmd's hierarchy was missing.
    for index in (1, 2):
        on_node(
            provisioned.cluster,
            index,
            f"docker run --rm {document['all']['vars']['training_image']} true",
        )
    try:
        run = ansible_playbook(path, "--tags", "slurm", "-e", f"slurm_cluster_name={name}")
        assert run.returncode == 0, run.describe()
        yield path
    finally:
        for index in (1, 2):
            on_node(
                provisioned.cluster,
                index,
                "pkill -x slurmctld; pkill -x slurmd; pkill -x munged",
                check=False,
            )
        (REPO_ROOT / ".slurm" / f"{name}.munge.key").unlink(missing_ok=True)


def _train(
    inventory: Path, *variables: str, env: dict | None = None
) -> subprocess.CompletedProcess:
    return make("train", f"INVENTORY={inventory}", "NNODES=2", *variables, timeout=600, env=env)


def _project(root: Path, **config) -> Path:
    (root / "mylib").mkdir(parents=True)
    (root / "mylib" / "__init__.py").write_text("")
    (root / "mylib" / "model.py").write_text(
        "import torch\n\n\ndef build():\n    return torch.nn.Linear(4, 2)\n"
    )
    (root / "config.yaml").write_text(yaml.safe_dump({"steps": 5, **config}))
    (root / "train.py").write_text(PROJECT_TRAIN)
    return root / "train.py"


def _nothing_left(provisioned, inventory: Path, run_id: str) -> None:
    queue = on_node(provisioned.cluster, 1, "squeue --noheader", check=False)
    assert queue.strip() == "", queue
    assert leftovers(load(inventory), run_id) == {"node1": "", "node2": ""}
    # The run's containers' processes are gone (above); Docker removes the containers
    # themselves when their cleanup is done (a CI run here found node1's still there at once).
    no_containers_left(provisioned.cluster, (1, 2), run_id)


def test_the_default_job_and_a_project_end_through_slurm_as_through_ssh(
    slurm_inventory, provisioned, small_job_over_ssh, tmp_path
):
    """The default job ends with the parameters of the same job over SSH (the shared run of
    `small_job_over_ssh`); a project of several files with those its mathematics gives,
    computed here (`_project_parameters`)."""
    by_ssh = small_job_over_ssh
    assert by_ssh.returncode == 0, by_ssh.stdout + by_ssh.stderr
    through_slurm = _train(slurm_inventory, "ARGS=" + " ".join(SMALL_JOB))
    out = through_slurm.stdout
    assert through_slurm.returncode == 0, out + through_slurm.stderr
    assert re.search(r"\[launcher\] Slurm job \d+ submitted", out), out
    assert SHA.search(out).group(1) == SHA.search(by_ssh.stdout).group(1)
    assert "[node2] [rank 1] parameters sha256" in out
    assert re.search(r"  node1 +exit 0\n  node2 +exit 0\n", out), out

    # The script is saved, runs the job in the training container, and is valid shell.
    run_id = run_id_in(out)
    script = REPO_ROOT / ".runs" / run_id / "job.sbatch"
    text = script.read_text()
    assert "#SBATCH --nodelist=node1,node2" in text and "docker run" in text
    assert subprocess.run(["bash", "-n", str(script)], check=False).returncode == 0
    _nothing_left(provisioned, slurm_inventory, run_id)

    # A project of several files, with a secret: the parameters its mathematics gives, the
    # secret seen by every rank and written nowhere (not in the saved script, not in the output).
    train = _project(tmp_path / "project")
    secret = f"s3cret-{uuid.uuid4().hex}"
    result = _train(
        slurm_inventory, f"SCRIPT={train}", "ENV=PROJECT_TOKEN", env={"PROJECT_TOKEN": secret}
    )
    assert result.returncode == 0, result.stdout + result.stderr
    found = re.findall(
        r"\[node\d\] rank (\d): project parameters ([0-9a-f]{64}), token of (\d+) ",
        result.stdout,
    )
    assert sorted(rank for rank, _, _ in found) == ["0", "1"], result.stdout
    expected = _project_parameters(steps=5, world_size=2)
    assert {(digest, size) for _, digest, size in found} == {(expected, str(len(secret)))}
    assert secret not in result.stdout + result.stderr
    script = REPO_ROOT / ".runs" / run_id_in(result.stdout) / "job.sbatch"
    assert secret not in script.read_text()


def _project_parameters(steps: int, world_size: int) -> str:
    """PROJECT_TRAIN's parameters after `steps`, computed in this process: every rank's
    gradient from its own seeded batch, averaged as the job's all_reduce and division do (with
    two ranks, one addition per element, the same in either order), one thread as in the
    containers (OMP_NUM_THREADS=1)."""
    import hashlib

    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(steps):
            grads = []
            for rank in range(world_size):
                torch.manual_seed(100 * step + rank)
                loss = model(torch.randn(8, 4)).pow(2).mean()
                optimizer.zero_grad()
                loss.backward()
                grads.append([parameter.grad for parameter in model.parameters()])
            for parameter, *each in zip(model.parameters(), *grads, strict=True):
                total = each[0].clone()
                for grad in each[1:]:
                    total += grad
                total /= world_size
                parameter.grad = total
            optimizer.step()
        parameters = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
        return hashlib.sha256(parameters).hexdigest()
    finally:
        torch.set_num_threads(threads)


@pytest.mark.extended
def test_a_project_with_packages_named_like_ours_runs_unchanged_under_slurm(
    slurm_inventory, provisioned, tmp_path
):
    """As in containers over SSH (test_projects_in_containers): the project's own training/,
    cluster/ and launch/ packages and ours stay apart."""
    root = namesake_project(tmp_path / "namesake")
    check_namesake_project_runs(lambda *variables: _train(slurm_inventory, *variables), root)


def test_a_project_with_requirements_runs_in_its_layer_under_slurm(
    slurm_inventory, provisioned, tmp_path
):
    """Issue 50 under Slurm: the project's requirements.txt makes the same layer on the
    training image as over SSH (built and shipped through the registry here, from wheels made
    here), and the batch script runs the job in it on both nodes; the record names it."""
    index = tmp_path / "index"
    wheel(index, "demo-config", "2.3.0", module="LR = 0.5\n")
    project = tmp_path / "dependent"
    project.mkdir()
    (project / "train.py").write_text(DEPENDENT)
    (project / "requirements.txt").write_text("demo-config\n")
    layer = None
    try:
        done = _train(
            slurm_inventory,
            f"SCRIPT={project / 'train.py'}",
            "ARGS=--versions-only",
            env=offline_pip(index),
        )
        out = done.stdout
        assert done.returncode == 0, out[-3000:] + done.stderr
        layer = re.search(
            r"^\[launcher\] dependencies: .*?(torch-multinode/deps:[0-9a-f]+)", out, re.M
        )
        assert layer is not None, out[-3000:]
        layer = layer.group(1)
        assert re.search(r"\[launcher\] Slurm job \d+ submitted", out), out[-3000:]
        for node, rank in (("node1", "0"), ("node2", "1")):
            assert re.search(rf"^\[{node}\] rank {rank}: demo-config 2.3.0 ", out, re.M), out
        assert dependent_versions(out, "0") == "demo-config 2.3.0 demo-progress none"
        run_id = run_id_in(out)
        script = (REPO_ROOT / ".runs" / run_id / "job.sbatch").read_text()
        assert "docker run" in script and layer in script, script
        recorded = run_record(run_id)
        assert recorded["image"]["name"] == layer
        assert recorded["dependencies"]["resolved"] == ["demo-config==2.3.0"]
        _nothing_left(provisioned, slurm_inventory, run_id)
    finally:
        if layer is not None:
            for node in (1, 2):
                on_node(provisioned.cluster, node, f"docker rmi {layer}", check=False)
            subprocess.run(["docker", "rmi", layer], capture_output=True, check=False)


def test_a_second_job_waits_in_the_queue_and_runs_once_ctrl_c_cancels_the_first(
    slurm_inventory, provisioned
):
    """One running job, one held behind it: the second says it waits in the queue, behind the
    first. Ctrl-C at the first cancels its Slurm job and leaves nothing of it on any node; the
    second then runs and succeeds. (One endless job for both: a queue needs a job that runs.)"""
    first = start_train(
        slurm_inventory, "ARGS=--model tiny --steps 100000 --log-every 20 --no-tensorboard"
    )
    second = None
    try:
        seen = read_until(first, "40/100000")
        first_job = re.search(r"Slurm job (\d+) submitted", seen).group(1)
        second = start_train(slurm_inventory, f"ARGS={TINY}")
        waiting = read_until(second, "waits in the queue")
        assert re.search(
            rf"Slurm job \d+ waits in the queue: position 2, behind job {first_job} \(tmn-",
            waiting,
        ), waiting

        os.killpg(first.pid, signal.SIGINT)  # as a terminal's Ctrl-C does: make and its children
        rest, _ = first.communicate(timeout=120)
        output = seen + rest
        assert first.returncode != 0, output
        assert re.search(r"\[launcher\] Ctrl-C: cancelling Slurm job \d+", output), output
        assert "interrupted after" in output

        after, _ = second.communicate(timeout=600)
        assert second.returncode == 0, waiting + after
        assert "succeeded" in after
        _nothing_left(provisioned, slurm_inventory, run_id_in(output))
    finally:
        for process in (first, second):
            if process is not None and process.poll() is None:
                process.kill()


@pytest.mark.extended
def test_a_hang_under_slurm_names_the_rank_and_its_line(slurm_inventory, provisioned, tmp_path):
    """tests/test_hangs.py's sleeping rank, through sbatch: the same report, then scancel."""
    from tests.test_hangs import SCRIPT, line_of

    (tmp_path / "project").mkdir()
    script = tmp_path / "project" / "hang.py"
    script.write_text(SCRIPT)
    result = _train(slurm_inventory, f"SCRIPT={script}", "STALL=10", "ARGS=sleep")
    out = result.stdout
    assert result.returncode != 0, out
    where = dict(re.findall(r"rank (\d) runs on (node\d)", out))
    assert sorted(where) == ["0", "1"], out[-3000:]
    assert (
        f"rank 1 on {where['1']}: not in a collective, at hang.py:{line_of('sleep')} in load_batch"
    ) in out, out[-3000:]
    assert f"rank 0 on {where['0']}: waits in all_reduce" in out, out[-3000:]
    _nothing_left(provisioned, slurm_inventory, run_id_in(out))
    # Its record, as for a job over SSH (issue 32).
    record = run_record(run_id_in(out))
    assert (record["backend"], record["launch_mode"]) == ("slurm", "container"), record
    assert (record["result"], record["failed_node"]) == ("failed", where["1"]), record
    assert [node["name"] for node in record["nodes"]] == ["node1", "node2"], record
    assert record["inventory"]["path"] == str(slurm_inventory), record
    assert record["workload"] == str(script) and record["seconds"] > 0, record


def test_restarts_requeue_the_job_in_slurm_and_it_runs_again(
    slurm_inventory, provisioned, tmp_path
):
    mark = f"/shared/slurm-test-{uuid.uuid4().hex[:8]}"  # /shared is mounted in the containers
    train = _project(tmp_path / "project", fail_once_mark=mark)
    try:
        result = _train(slurm_inventory, f"SCRIPT={train}", "RESTARTS=1")
    finally:
        on_node(provisioned.cluster, 2, f"rm -f {mark}", check=False)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    # The first attempt's failure, named with the failing node's last lines.
    assert "FAILED on node2" in out, out
    excerpt = out.split("Last lines from node2:", 1)[1]
    assert "Error: rank 1 fails its first attempt" in excerpt, out
    job = re.search(r"restart 1 of 1: requeueing Slurm job (\d+)", out).group(1)
    assert f"Slurm job {job} runs on node[1-2], requeued 1 time(s)" in out, out
    assert re.search(r"succeeded after [\d.]+ s on 2 node\(s\), restart 1 of 1\.", out), out
    assert len(re.findall(r"rank \d: project parameters", out)) == 2, out
    _nothing_left(provisioned, slurm_inventory, run_id_in(out))
    record = run_record(run_id_in(out))
    assert (record["backend"], record["result"], record["restarts"]) == ("slurm", "succeeded", 1)


def test_a_node_whose_slurmd_dies_is_named_dropped_down_to_min_nodes_and_idle_once_restarted(
    slurm_inventory, provisioned
):
    """Issue 31 under Slurm: node2's slurmd dies mid-run and stays dead; Slurm has node2 down
    and ends the job, which is named; with RESTARTS=1 MIN_NODES=1 the launcher cancels the job
    (Slurm would requeue it onto node2) and submits a new one on node1, which resumes from its
    own checkpoint, keeping the first run's world of 2."""
    directory = f"slurm-loss-{uuid.uuid4().hex[:8]}"  # under each node's checkpoint_root
    # 560 steps of at least 0.1 s after the kill (rank 1 sleeps, rank 0 waits for it in each
    # step's all_reduce): the job still runs when Slurm has node2 down (slurm_node_timeout,
    # 30 s, after its last answer). The resumed job, rank 0 alone, does not sleep.
    job = subprocess.Popen(
        [
            str(VENV_BIN / "train"),
            "-i",
            str(slurm_inventory),
            "--nnodes",
            "2",
            "--restarts",
            "1",
            "--restart-wait",
            "10",
            "--min-nodes",
            "1",
            "--",
            *f"--model tiny --steps 600 --log-every 20 --no-tensorboard --step-delay 0.1 "
            f"--step-delay-rank 1 --checkpoint-every 20 --checkpoint-dir {directory}".split(),
        ],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        seen = read_until(job, "40/600")
        on_node(provisioned.cluster, 2, "pkill -x slurmd", check=False)
        rest, _ = job.communicate(timeout=600)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
        on_node(
            provisioned.cluster, 2, "pgrep -x slurmd >/dev/null || slurmd -N node2", check=False
        )
        for index in (1, 2):
            on_node(
                provisioned.cluster, index, f"rm -rf {CHECKPOINT_ROOT}/{directory}", check=False
            )
    output = seen + rest
    assert job.returncode == 0, output[-4000:]
    first = run_id_in(output)
    # The first run: node2 named as Slurm has it.
    assert "FAILED on node2" in output, output[-4000:]
    assert re.search(r"  node2 +Slurm has node2 down \(", output), output[-4000:]
    # The restart: node2 still without slurmd after the wait, dropped; a new job on node1.
    assert re.search(r"\[launcher\] node2 lost at restart 1 after step \d+: dropped", output)
    assert "[launcher] continuing on node1: 1 of 2 nodes (--min-nodes 1)" in output
    assert re.search(r"\[launcher\] cancelling Slurm job \d+ \(it holds a lost node\)", output)
    again = output[output.index(f"job {first}-r1:") :]
    assert "keeping the first run's world of 2 process(es)" in again.splitlines()[0], again[:500]
    assert re.search(r"\[launcher\] Slurm job \d+ submitted", again), again[-4000:]
    assert re.search(r"\[node1\] resuming from step \d+", again), again[-4000:]
    assert re.search(r"succeeded after [\d.]+ s on 1 node\(s\), restart 1 of 1\.", again), again
    assert "Nodes: continuing on node1: 1 of 2 nodes (--min-nodes 1)" in again
    queue = on_node(provisioned.cluster, 1, "squeue --noheader", check=False)
    assert queue.strip() == "", queue
    assert leftovers(load(slurm_inventory), f"{first}-r1") == {"node1": "", "node2": ""}
    # node2 back in Slurm once its slurmd runs again (ReturnToService=2).
    for _ in range(120):
        state = on_node(
            provisioned.cluster, 1, "sinfo --Node --noheader --format '%N %T' -n node2", check=False
        )
        if state.split() == ["node2", "idle"]:
            break
        time.sleep(1)
    assert state.split() == ["node2", "idle"], state
