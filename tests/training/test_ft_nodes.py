"""FT=1 (issue 54) on 3 simulated nodes whose jobs run in the training image (launch_mode:
container, as real clusters do): each node one replica group with its own torchrun, the torchft
lighthouse on this machine. A node killed mid-job and left dead costs the others a few seconds:
they go on at their next step in the same processes, and the job ends well, naming the loss.
On sim3 (tests/three_nodes.py), shared with the node-loss tests: every node up before and after.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
import uuid

import pytest

from tests.conftest import REPO_ROOT
from tests.helpers import leftovers, no_containers_left, on_node, run_id_in
from tests.training.conftest import TINY, TimedOutput, kill_node, launches, with_values
from tests.training.references import SMALL
from tests.training.test_faults import _summary, _wait_for
from torch_multinode.cluster.inventory import DEFAULT_CHECKPOINT_ROOT, DEFAULT_LIGHTHOUSE_PORT
from torch_multinode.cluster.inventory_read import load
from torch_multinode.sim import nodes as sim

pytestmark = pytest.mark.timeout(2400)  # sim3's set-up, where this module's worker makes it

STEPS = 40
# 48 samples a step: 16 per rank on 3 nodes, 5 steps an epoch; a step line every step.
THREE = with_values(TINY, global_batch_size="48", log_every="1")
_STEP = re.compile(r"^\[node(\d)\] step +(\d+)/", re.M)


def _all_back(sim3) -> None:
    cluster, _ = sim3
    sim.up(3, None, cluster.config)
    for index in (1, 2, 3):
        sim.wait_for_engine(cluster.config, index)


def _pids(cluster, index: int, run_id: str) -> set[str]:
    """The processes of run `run_id` on node `index` (its torchrun and ranks, in the job's
    container), by the marker every one of them carries."""
    found = on_node(
        cluster,
        index,
        f"grep -lsaF TMN_RUN_ID={run_id} /proc/[0-9]*/environ | grep -v self",
        check=False,
    )
    return {path.split("/")[2] for path in found.split()}


def _listening(port: int) -> bool:
    """Whether anything on this machine listens on TCP `port`."""
    listed = subprocess.run(
        ["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True, check=False
    )
    return bool(listed.stdout.strip())


def _survivors_went_on(text: str, steps: int, before: dict, after: dict) -> str:
    """node3 lost after step 12, said in one line; node1's and node2's groups went on in the
    processes they started with (`before`, `after`: their PIDs), their steps never going back,
    to the last. The step node3 was lost at."""
    assert "[launcher] FT=1: 3 replica groups, one per node (torchft)" in text, text[:3000]
    assert re.search(r"\[launcher\] torchft lighthouse on [0-9.]+:\d+ \(this machine", text)
    (loss,) = re.findall(
        r"^\[launcher\] node3 lost at step (\d+): continuing on node1, node2 "
        r"\(2 of 3 groups\)",
        text,
        re.M,
    )
    assert 12 <= int(loss) < steps, loss
    assert "2 of 3 replica groups train" in text, text[-4000:]
    assert after == before, (before, after)
    for node in ("1", "2"):
        done = [int(step) for name, step in _STEP.findall(text) if name == node]
        assert done == sorted(done) and done[-1] == steps, (node, done[-20:])
    return loss


@pytest.fixture
def ft3(sim3):
    """sim3 with every node up (the node-loss tests kill some), and again after the test, for
    the tests after it."""
    _all_back(sim3)
    yield sim3
    _all_back(sim3)


@pytest.mark.sim
def test_ft_a_node_killed_and_left_dead_costs_the_others_seconds_not_their_processes(ft3):
    """training.fsdp: FSDP2 within a node (one rank here), torchft across, 4 sequences a rank a
    step, each group's durable checkpoints every 10 steps in a directory of its own on its
    node's disk. node3 is killed inside its write of step 20 (its files written, the step not
    yet named): its disk keeps step 10 whole and step 20 only as the write it was. (training.ddp's
    survivors keep their processes in the restarts test below.)"""
    cluster, inventory = ft3
    directory = f"ft-{uuid.uuid4().hex[:8]}"  # node-local, under the inventory's root
    with launches(*ft3) as start:
        process = start(
            "--ft",
            "--module",
            "training.fsdp",
            "--",
            *with_values(SMALL, global_batch_size="12"),
            "--steps",
            str(STEPS),
            "--step-delay",
            "0.3",
            "--checkpoint-dir",
            directory,
            "--checkpoint-every",
            "10",
            *_NODE3_PAUSES_IN_STEP_20,
        )
        seen = _wait_for(process, re.compile(r"^\[node1\] step +12/"))
        run_id = run_id_in(seen)
        before = {index: _pids(cluster, index, run_id) for index in (1, 2)}
        assert all(before.values()), before
        seen += _wait_for(process, _PAUSED_IN_STEP_20)
        output = kill_node(process, cluster.config.container(3))  # and left dead
        output.first("[node1] step 30/", timeout=300)  # well after the loss
        after = {index: _pids(cluster, index, run_id) for index in (1, 2)}
        output.end(timeout=300)
    text = seen + output.text
    assert process.returncode == 0, text[-4000:]
    loss = _survivors_went_on(text, STEPS, before, after)
    summary = _summary(text)
    assert summary[0].startswith(f"Job {run_id} succeeded after "), summary
    assert any(
        line.startswith(f"Nodes: node3 lost at step {loss}: continuing on node1, node2")
        for line in summary
    ), summary
    record = json.loads((REPO_ROOT / ".runs" / run_id / "run.json").read_text())
    assert any(change.startswith("node3 lost at step") for change in record["nodes_changed"])
    # The survivors' groups each hold their last steps, complete (the manifest is written
    # last, before the rename), in their own directory.
    for index in (1, 2):
        group = f"{DEFAULT_CHECKPOINT_ROOT}/{directory}/group-{index - 1}"
        listed = on_node(cluster, index, f"ls -A {group}").split()
        assert [name for name in listed if name.startswith("step-")] == [
            f"step-{step:08d}" for step in (20, 30, STEPS)
        ], (index, listed)
        assert on_node(cluster, index, f"ls {group}/step-{STEPS:08d}/manifest.pt").strip()
    # Nothing of the job is left: not on the survivors, not the lighthouse here.
    nodes = load(inventory)
    assert leftovers(nodes, run_id, nodes.hosts[:2]) == {"node1": "", "node2": ""}
    no_containers_left(cluster, (1, 2), run_id)
    assert not _listening(DEFAULT_LIGHTHOUSE_PORT)
    # node3's disk, its node back: step 10 whole, step 20 never named a step.
    _all_back(ft3)
    group = f"{DEFAULT_CHECKPOINT_ROOT}/{directory}/group-2"
    listed = on_node(cluster, 3, f"ls -A {group}").split()
    assert [name for name in listed if name.startswith("step-")] == ["step-00000010"], listed
    assert ".step-00000020.tmp" in listed, listed
    assert on_node(cluster, 3, f"ls {group}/step-00000010/manifest.pt").strip()


# node3's group (the job's rank 2: one rank a node) pauses inside its write of step 20, its
# files written and the step not yet named: the moment it is killed in.
_NODE3_PAUSES_IN_STEP_20 = ("--checkpoint-pause-step", "20", "--checkpoint-pause-rank", "2")
_PAUSED_IN_STEP_20 = re.compile(r"^\[node3\] (?:\[rank 0\] )?checkpoint step 20: .*pausing")

# Each group's whole digest: training.ddp's every rank says it, training.fsdp's summary (rank 0).
_DIGEST = re.compile(r"^\[node(\d)\] (?:\[rank \d+\] )?parameters +sha256 ([0-9a-f]{64})$", re.M)


@pytest.mark.sim
def test_ft_with_restarts_a_node_brought_back_heals_from_a_peer_and_the_job_ends_whole(ft3):
    """RESTARTS=1: node3 killed inside its write of step 20 (its file written, not yet named),
    its container started again while the others go on; the launcher starts its group again
    once it answers, it heals from a live peer and trains with the others to the end: the three
    groups end on one set of parameters. Each group keeps durable checkpoints on its node's
    disk: node3's group, started again, resumes from its own newest complete step (10, never
    the write cut short) before it heals, and every node ends holding the last step."""
    cluster, _ = ft3
    steps = 240  # the others' steps while node3 restarts, is waited for and heals
    directory = f"ft-{uuid.uuid4().hex[:8]}"  # node-local, under the inventory's root
    with launches(*ft3) as start:
        process = start(
            "--ft",
            "--restarts",
            "1",
            "--restart-wait",
            "240",
            "--",
            *THREE,
            "--steps",
            str(steps),
            "--step-delay",
            "0.3",
            "--no-tensorboard",
            "--checkpoint-dir",
            directory,
            "--checkpoint-every",
            "10",
            *_NODE3_PAUSES_IN_STEP_20,
        )
        seen = _wait_for(process, re.compile(r"^\[node1\] step +12/"))
        run_id = run_id_in(seen)
        before = {index: _pids(cluster, index, run_id) for index in (1, 2)}
        assert all(before.values()), before
        seen += _wait_for(process, _PAUSED_IN_STEP_20)
        output = kill_node(process, cluster.config.container(3))
        output.first("[launcher] node3 lost at step", timeout=120)
        sim.up(3, None, cluster.config)  # node3's container started again
        output.mark("node3 started again")
        output.first("[node3] healed from a peer", timeout=600)
        after = {index: _pids(cluster, index, run_id) for index in (1, 2)}
        output.end(timeout=900)
    text = seen + output.text
    assert process.returncode == 0, output.stamped[-5000:]
    _survivors_went_on(text, steps, before, after)  # through the loss and the heal
    assert re.search(r"^\[launcher\] node3 answers again: its group starts again", text, re.M)
    healed = re.findall(r"^\[node3\] healed from a peer: at step (\d+) with the others", text, re.M)
    assert len(healed) == 1 and 12 < int(healed[0]) < steps, output.stamped[-5000:]
    assert re.search(rf"^\[node3\] step +{steps}/{steps}", text, re.M), output.stamped[-3000:]
    restarted = text.split("[launcher] node3 answers again")[1]
    assert re.search(r"^\[node3\] resuming from step 10, ", restarted, re.M), restarted[:3000]
    for index in (1, 2, 3):
        listed = on_node(cluster, index, f"ls -A {DEFAULT_CHECKPOINT_ROOT}/{directory}").split()
        assert f"step-{steps:08d}-rank-{index - 1:05d}.pt" in listed, (index, listed)
    assert "all 3 replica groups train" in text.split("[launcher] node3 answers again")[1]
    digests = dict(_DIGEST.findall(text))
    assert sorted(digests) == ["1", "2", "3"] and len(set(digests.values())) == 1, digests
    summary = _summary(text)
    assert summary[0].startswith(f"Job {run_id} succeeded after "), summary
    changes = [line for line in summary if line.startswith("Nodes: node3 ")]
    assert [c.split(":")[1].split(" ")[2] for c in changes] == ["lost", "answers"], changes
    record = json.loads((REPO_ROOT / ".runs" / run_id / "run.json").read_text())
    assert any(change.startswith("node3 lost at step") for change in record["nodes_changed"])
    no_containers_left(cluster, (1, 2, 3), run_id)
    assert not _listening(DEFAULT_LIGHTHOUSE_PORT)


@pytest.mark.sim
def test_ft_a_spare_takes_a_lost_nodes_group_and_heals_from_a_peer(ft3):
    """NNODES=2 of 3 with RESTARTS=1: node2 killed after step 12 and left dead; node3, the
    spare, is readied while node1 goes on alone, runs node2's group and heals from node1; the
    job ends well on node1 and node3, one set of parameters between them."""
    cluster, _ = ft3
    steps = 300  # node1's steps alone while the spare is readied and heals
    with launches(*ft3) as start:
        process = start(
            "--nnodes",
            "2",
            "--ft",
            "--restarts",
            "1",
            "--restart-wait",
            "120",
            "--",
            *with_values(TINY, global_batch_size="32", log_every="1"),
            "--steps",
            str(steps),
            "--step-delay",
            "0.3",
            "--no-tensorboard",
        )
        seen = _wait_for(process, re.compile(r"^\[node1\] step +12/"))
        run_id = run_id_in(seen)
        output = kill_node(process, cluster.config.container(2))  # and left dead
        output.end(timeout=900)
    text = seen + output.text
    assert process.returncode == 0, output.stamped[-5000:]
    assert "[launcher] node2's group goes to spare node3 (restart 1 of 1)" in text, text[-4000:]
    assert re.search(
        r"^\[launcher\] spare node3 takes node2's group at the others' step \d+", text, re.M
    )
    healed = re.findall(r"^\[node3\] healed from a peer: at step (\d+) with the others", text, re.M)
    assert len(healed) == 1 and 12 < int(healed[0]) < steps, output.stamped[-5000:]
    digests = dict(_DIGEST.findall(text))
    assert sorted(digests) == ["1", "3"] and len(set(digests.values())) == 1, digests
    summary = _summary(text)
    assert summary[0].startswith(f"Job {run_id} succeeded after "), summary
    assert re.search(r"^  node3 +exit 0$", text, re.M), summary
    no_containers_left(cluster, (1, 3), run_id)
    assert not _listening(DEFAULT_LIGHTHOUSE_PORT)


def _checkpointing(module: str, steps: int, directory: str, every: int, *more: str) -> list[str]:
    """The launcher's arguments for an FT=1 job of `module` (training.ddp's tiny CNN or
    training.fsdp's small GPT, a step line every step) of `steps` steps, durable checkpoints
    every `every` steps in `directory` under each node's checkpoint root; `more` for the
    workload."""
    workload = (
        [*THREE, "--no-tensorboard"]
        if module == "training.ddp"
        else with_values(SMALL, global_batch_size="12", log_every="1")
    )
    return [
        "--ft",
        "--module",
        module,
        "--",
        *workload,
        "--steps",
        str(steps),
        *more,
        "--checkpoint-dir",
        directory,
        "--checkpoint-every",
        str(every),
    ]


@pytest.mark.sim
@pytest.mark.parametrize(
    # training.fsdp's is extended (make test-all): its FT=1 path stays in CI in the full-disk
    # test below, its Ctrl-C during a checkpoint write in containers in test_fsdp_cluster.py.
    "module",
    ["training.ddp", pytest.param("training.fsdp", marks=pytest.mark.extended)],
)
def test_ft_a_group_lost_before_its_first_checkpoint_then_ctrl_c_keeps_every_complete_step(
    ft3, module
):
    """FT=1 with durable checkpoints every 12 steps on each node's disk. node3 killed at node1's
    step 2, ten steps before any checkpoint, and left dead: it holds no file of the job. Ctrl-C
    at the launcher once node1 has passed step 12: exit 130, the run `interrupted`, nothing of
    the job left on the survivors nor the lighthouse here, and each survivor's step 12 whole.
    Run again with node3 back: node1's and node2's groups resume from step 12, node3's finds
    none and heals from a peer at the first step, and the three end on one set of parameters,
    each node holding the last step."""
    cluster, inventory = ft3
    # Running still when Ctrl-C comes after step 14 (22 steps of 0.3 s at least to go); a
    # checkpoint at 12, 24 and the last.
    steps = 36
    directory = f"ft-{uuid.uuid4().hex[:8]}"  # node-local, under the inventory's root
    arguments = _checkpointing(module, steps, directory, 12, "--step-delay", "0.3")

    def held(index: int) -> list[str]:
        """The job's complete steps on node `index`'s disk, by name (a file a rank for
        training.ddp, a directory a group for training.fsdp)."""
        root = f"{DEFAULT_CHECKPOINT_ROOT}/{directory}"
        if module == "training.fsdp":
            root += f"/group-{index - 1}"
        listed = on_node(cluster, index, f"ls -A {root} 2>/dev/null; true").split()
        return sorted(name for name in listed if name.startswith("step-"))

    def complete(step: int, index: int) -> str:
        if module == "training.fsdp":
            return f"step-{step:08d}"
        return f"step-{step:08d}-rank-{index - 1:05d}.pt"

    with launches(*ft3) as start:
        process = start(*arguments)
        seen = _wait_for(process, re.compile(r"^\[node1\] step +2/"))
        run_id = run_id_in(seen)
        output = kill_node(process, cluster.config.container(3))  # and left dead
        output.first("[launcher] node3 lost at step", timeout=120)
        output.first(f"[node1] step 14/{steps} ", timeout=300)
        process.send_signal(signal.SIGINT)
        output.mark("Ctrl-C")
        output.end(timeout=120)
    text = seen + output.text
    assert process.returncode == 130, output.stamped[-4000:]
    # The unlucky moment as meant: node3 never reached the first checkpoint's step.
    node3 = [int(step) for name, step in _STEP.findall(text) if name == "3"]
    assert max(node3, default=0) < 12, output.stamped[-4000:]
    assert f"Job {run_id} interrupted" in text, output.stamped[-4000:]
    record = json.loads((REPO_ROOT / ".runs" / run_id / "run.json").read_text())
    assert record["result"] == "interrupted", record["result"]
    nodes = load(inventory)
    assert leftovers(nodes, run_id, nodes.hosts[:2]) == {"node1": "", "node2": ""}
    no_containers_left(cluster, (1, 2), run_id)
    assert not _listening(DEFAULT_LIGHTHOUSE_PORT)
    for index in (1, 2):
        assert complete(12, index) in held(index), (index, held(index))
    _all_back(ft3)
    assert held(3) == [], held(3)  # killed ten steps before its first checkpoint

    with launches(*ft3) as start:
        again = start(*arguments)
        rerun = TimedOutput(again, time.monotonic())
        rerun.end(timeout=600)
    text = rerun.text
    assert again.returncode == 0, rerun.stamped[-5000:]
    for node in ("node1", "node2"):
        assert re.search(rf"^\[{node}\] (?:\[rank 0\] )?resuming from step 12", text, re.M), (
            rerun.stamped[:5000]
        )
    assert re.search(r"^\[node3\] (?:\[rank 0\] )?no checkpoints in ", text, re.M), text[:5000]
    healed = re.findall(r"^\[node3\] healed from a peer: at step (\d+) with the others", text, re.M)
    assert healed == ["13"], rerun.stamped[-5000:]
    digests = dict(_DIGEST.findall(text))
    assert sorted(digests) == ["1", "2", "3"] and len(set(digests.values())) == 1, digests
    for index in (1, 2, 3):
        assert complete(steps, index) in held(index), (index, held(index))
    assert not _listening(DEFAULT_LIGHTHOUSE_PORT)


@pytest.mark.sim
@pytest.mark.parametrize(
    # training.ddp's is extended (make test-all): its FT=1 path stays in CI in the Ctrl-C test
    # above, its full checkpoint directory in containers in test_projects_in_containers.py.
    "module",
    [pytest.param("training.ddp", marks=pytest.mark.extended), "training.fsdp"],
)
def test_ft_a_full_disk_ends_that_nodes_group_with_one_line_and_keeps_its_last_step(ft3, module):
    """FT=1 with durable checkpoints every 4 steps on each node's disk, node2's a small
    filesystem of its own (mounted on the node, seen by the job's container through its mount
    of the checkpoint root). A first job writes step 4 on every node; node2's filesystem is then
    filled up. Run again, every group resumes from step 4, and node2's write of step 8 fails:
    its group ends with one line naming the directory, the launcher says node2 lost with that
    line (and again in the summary), node1's and node3's groups train to the end (exit 0), and
    node2's disk holds step 4 whole beside the filler, nothing of step 8."""
    cluster, _ = ft3
    name = f"ft-full-{uuid.uuid4().hex[:8]}"
    mounted = f"{DEFAULT_CHECKPOINT_ROOT}/{name}"
    directory = mounted if module == "training.ddp" else f"{mounted}/group-1"

    def run(steps: int) -> tuple[subprocess.Popen, TimedOutput]:
        with launches(*ft3) as start:
            process = start(*_checkpointing(module, steps, name, 4))
            output = TimedOutput(process, time.monotonic())
            output.end(timeout=600)
        return process, output

    def held() -> list[str]:
        return on_node(cluster, 2, f"ls -A {directory}").split()

    step_4 = "step-00000004" if module == "training.fsdp" else "step-00000004-rank-00001.pt"
    on_node(cluster, 2, f"mkdir -p {mounted} && mount -t tmpfs -o size=2m tmpfs {mounted}")
    try:
        first, output = run(4)
        assert first.returncode == 0, output.stamped[-4000:]
        assert step_4 in held(), held()
        on_node(cluster, 2, f"dd if=/dev/zero of={mounted}/filler bs=4k 2>/dev/null", check=False)
        before = on_node(cluster, 2, f"cd {directory} && find {step_4} -type f | xargs sha256sum")

        full, output = run(12)
        text = output.text
        assert full.returncode == 0, output.stamped[-5000:]
        for node in ("node1", "node2", "node3"):
            assert re.search(rf"^\[{node}\] (?:\[rank 0\] )?resuming from step 4", text, re.M), (
                output.stamped[:5000]
            )
        (error,) = re.findall(
            rf"^\[node2\] (?:\[rank 0\] )?(Error: cannot write checkpoint step 8 to "
            rf"{re.escape(directory)}: No space left on device.*)$",
            text,
            re.M,
        )
        assert "(try freeing space there" in error, error
        (lost,) = re.findall(r"^\[launcher\] node2 lost at step 8: (.*)$", text, re.M)
        assert lost.startswith("continuing on node1, node3 (2 of 3 groups)"), lost
        assert "No space left on device" in lost, lost
        for node in ("1", "3"):
            done = [int(step) for name_, step in _STEP.findall(text) if name_ == node]
            assert done[-1] == 12, (node, done[-10:])
        summary = _summary(text)
        assert summary[0].startswith("Job ") and " succeeded after " in summary[0], summary
        assert any(
            line.startswith("Nodes: node2 lost at step 8") and "No space left on device" in line
            for line in summary
        ), summary
        # Step 4 as it was, byte for byte; step 8 never under a step's name (training.ddp
        # removes its temporary file; training.fsdp's temporary directory goes at its next start).
        cut_short = [".step-00000008.tmp"] if module == "training.fsdp" else []
        assert sorted(entry for entry in held() if entry != "filler") == [*cut_short, step_4]
        after = on_node(cluster, 2, f"cd {directory} && find {step_4} -type f | xargs sha256sum")
        assert after == before
        assert "filler" in on_node(cluster, 2, f"ls -A {mounted}").split()
    finally:
        on_node(cluster, 2, f"umount {mounted}; rm -rf {mounted}", check=False)
        for index in (1, 3):
            on_node(cluster, index, f"rm -rf {mounted}", check=False)
