"""training.fsdp on the simulated cluster, in the training containers, through make train: two
nodes equal one plain process (within 1e-5, as on one machine) with each rank holding half a
replica; a rank killed while writing a checkpoint and RESTARTS=1 ends bit for bit where the
uninterrupted run does; the uninterrupted run, saved on 2 nodes to /shared, resumes on 1;
node-local checkpoints refuse to be resharded; a full node-local disk is one line naming its node,
a full /shared one line naming the directory.

On a pair of nodes of its own in the `fsdp` group (tests/three_nodes.py's jobs_cluster: the roles
jobs need, the twin linked into their engines), not on the `image` group's provisioned cluster,
whose worker decided CI's length alone (docs/ci-time.md, run 46)."""

from __future__ import annotations

import re
import shutil
import subprocess
import uuid
from types import SimpleNamespace

import pytest

from tests.conftest import REPO_ROOT, SMALL_SHARED, VENV_BIN, make
from tests.helpers import interrupt, known_line, on_node, read_until, run_id_in, start_train
from tests.three_nodes import jobs_cluster
from tests.training.conftest import load_state, max_difference
from tests.training.references import SMALL, bench_row, digest, progress, reference
from torch_multinode.cluster.inventory import DEFAULT_CHECKPOINT_ROOT
from torch_multinode.launch.staging import REMOTE_RUN_ROOT

pytestmark = [pytest.mark.sim, pytest.mark.timeout(1800)]
TOLERANCE = 1e-5  # as tests/training/test_fsdp.py states for 2 ranks against one process
PREFIX = re.compile(r"^\[node\d\] ", re.M)


@pytest.fixture(scope="module")
def provisioned(sim_factory, tmp_path_factory):
    """Two nodes for jobs in the training containers, with SMALL_SHARED (a 2 MB filesystem in
    /shared) as the `image` group's cluster has it. Named as that cluster's fixture: the tests
    read its `cluster` and `inventory` alone."""
    cluster, inventory = jobs_cluster(
        sim_factory, tmp_path_factory, 2, tmpfs=((SMALL_SHARED, "2m"),)
    )
    yield SimpleNamespace(cluster=cluster, inventory=inventory)
    sim_factory.down(cluster)


def _args(*more: str) -> str:
    return "ARGS=" + " ".join([*SMALL, *more])


def _train(provisioned, *variables: str, nnodes: int = 2) -> subprocess.CompletedProcess:
    return make(
        "train",
        f"INVENTORY={provisioned.inventory}",
        f"NNODES={nnodes}",
        "MODULE=training.fsdp",
        *variables,
        timeout=600,
    )


def _master_lines(stdout: str) -> str:
    """What node1 (rank 0) printed, without the launcher's prefix."""
    return "\n".join(
        PREFIX.sub("", line) for line in stdout.splitlines() if line.startswith("[node1] ")
    )


SHARED = f"/shared/fsdp-{uuid.uuid4().hex[:8]}/ckpt"  # /shared: storage every node sees


@pytest.fixture(scope="module")
def straight(provisioned):
    """20 uninterrupted steps on 2 nodes, exported into the run directory (which comes back),
    checkpointed every 5 steps to SHARED (removed at the end), which a later run resumes."""
    try:
        run = _train(
            provisioned, _args("--export", "model.pt", "--bench", "--checkpoint-dir", SHARED)
        )
        assert run.returncode == 0, run.stdout + run.stderr
        yield run
    finally:
        on_node(provisioned.cluster, 1, f"rm -rf {SHARED.rsplit('/', 1)[0]}", check=False)


def test_two_nodes_equal_one_process_each_rank_holding_half_a_replica(straight):
    out = straight.stdout
    assert "[node1] world    2 processes on 2 node(s), gloo, cpu" in out, out
    model, steps = reference()
    exported = REPO_ROOT / ".runs" / run_id_in(out) / "model.pt"
    assert max_difference(load_state(exported), model.state_dict()) <= TOLERANCE
    losses = progress(_master_lines(out))
    assert losses[20][0] < losses[1][0] - 1.0, losses
    assert bench_row(_master_lines(out))["bytes_ratio"] <= 0.55


def test_a_rank_killed_while_writing_a_checkpoint_and_restarts_1_end_where_uninterrupted_does(
    provisioned, straight
):
    """The unlucky moment made deterministic: rank 1 pauses in the write of step 15 (the test
    hook), its files in the step's temporary directory, and its rank process is killed
    there. The half-written step never takes its name (swept at the resume); step 10, complete,
    is resumed, and the run ends bit for bit where the uninterrupted one does."""
    directory = f"fsdp-{uuid.uuid4().hex[:8]}"  # node-local, under the inventory's root
    job = start_train(
        provisioned.inventory,
        "MODULE=training.fsdp",
        "RESTARTS=1",
        _args(
            "--checkpoint-dir",
            directory,
            "--checkpoint-pause-step",
            "15",
            "--checkpoint-pause-rank",
            "1",
        ),
    )
    seen = []
    try:
        for line in job.stdout:
            seen.append(line)
            if re.match(r"\[node2\] \[rank 1\] checkpoint step 15: its files written ", line):
                break
        # node2's rank: SIGKILL (torchrun's agent, started with `-m torch.distributed.run`,
        # lives on and reports it; its SSH session ends with an exit status, so the launcher
        # waits the blame grace for node1's own report before it stops the job).
        on_node(provisioned.cluster, 2, "pkill -9 -f ' -u -m torch_multinode[.]training[.]fsdp '")
        rest, _ = job.communicate(timeout=600)
    finally:
        if job.poll() is None:
            job.kill()
    out = "".join(seen) + rest
    assert job.returncode == 0, out
    assert "restart 1 of 1" in out, out
    # A real peer reset, and its Known problem line: rank 0 on node1, waiting in the write's
    # collective, saw gloo's connection to the killed rank close (node2 lives: its kernel
    # closed the socket), and the summary names it from the table of known failures. (Killing
    # node2's SSH session too made the launcher stop node1 at once: CI once saw node1 stopped
    # before gloo said it.)
    first = out.split("restart 1 of 1", 1)[0].splitlines()
    assert any(
        re.match(r"\[node1\] .*gloo.*Connection (closed|reset) by peer", line) for line in first
    ), out[-4000:]
    assert known_line("peer-reset") in first, out[-4000:]
    assert re.search(r"\[node1\] resuming from step 10, the newest step every rank has", out), out
    # The resumed run wrote step 15 whole this time, on both nodes' disks.
    for index in (1, 2):
        listed = on_node(
            provisioned.cluster, index, f"ls -A {DEFAULT_CHECKPOINT_ROOT}/{directory}"
        ).split()
        assert "step-00000015" in listed and not any(n.endswith(".tmp") for n in listed), listed
    assert digest(_master_lines(out.split("restart 1 of 1", 1)[1])) == digest(
        _master_lines(straight.stdout)
    )


def test_a_run_saved_on_two_nodes_in_shared_storage_resumes_on_one(provisioned, straight):
    first = straight  # its checkpoints in SHARED
    assert "(storage every rank sees)" in first.stdout, first.stdout
    on_node(
        provisioned.cluster,
        1,
        f"rm -rf {SHARED}/step-00000015 {SHARED}/step-00000020",
        check=False,
    )
    resumed = _train(provisioned, _args("--checkpoint-dir", SHARED), nnodes=1)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resharded step 10 from world size 2 to 1" in resumed.stdout, resumed.stdout
    before, after = (
        progress(_master_lines(first.stdout)),
        progress(_master_lines(resumed.stdout)),
    )
    assert min(after) == 11 and max(after) == 20, after
    for step in range(11, 21):
        assert after[step][0] == pytest.approx(before[step][0], abs=1e-4), step


def test_node_local_checkpoints_are_not_resharded(provisioned):
    directory = f"fsdp-local-{uuid.uuid4().hex[:8]}"
    args = _args("--checkpoint-dir", directory, "--no-replicate")
    args = args.replace("--steps 20", "--steps 10")
    first = _train(provisioned, args)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "(node-local disks: each node holds its own ranks' shards)" in first.stdout
    refused = _train(provisioned, args, nnodes=1)
    assert refused.returncode != 0
    assert re.search(
        r"\[node1\] Error: checkpoint step 10 in \S+ was written by 2 ranks on node1, node2 to "
        r"node-local disks .*resharding needs storage every node sees",
        refused.stdout,
    ), refused.stdout


def test_a_full_node_local_disk_in_containers_is_one_error_line_naming_the_node(provisioned):
    """The data-safety matrix's FSDP2 node-local x full disk, in the training containers: node2's
    checkpoint directory is a small filesystem of its own, mounted on the node before the job
    (the container sees it through its mount of checkpoint_root) and filled up. The first write
    fails there, every rank says the same one line naming node2's directory and node2, and
    nothing under a step's name is left on either node."""
    name = f"fsdp-full-{uuid.uuid4().hex[:8]}"
    directory = f"{DEFAULT_CHECKPOINT_ROOT}/{name}"
    on_node(
        provisioned.cluster,
        2,
        f"mkdir -p {directory} && mount -t tmpfs -o size=64k tmpfs {directory} && "
        f"(dd if=/dev/zero of={directory}/filler bs=4k 2>/dev/null; true)",
    )
    try:
        args = _args("--checkpoint-dir", name).replace("--steps 20", "--steps 5")
        full = _train(provisioned, args)
        assert full.returncode != 0, full.stdout[-3000:]
        error = (
            f"Error: cannot write checkpoint step 5 to {directory} on node2: No space left on "
            "device (try freeing space there, or another --checkpoint-dir)"
        )
        lines = full.stdout.splitlines()
        for node in ("node1", "node2"):  # the ranks agree on node2's failure
            assert f"[{node}] {error}" in lines, full.stdout[-3000:]
        for index in (1, 2):
            steps = on_node(provisioned.cluster, index, f"ls -A {directory} | grep '^step-'; true")
            assert steps.split() == [], (index, steps)
    finally:
        on_node(provisioned.cluster, 2, f"umount {directory}; rm -rf {directory}", check=False)
        on_node(provisioned.cluster, 1, f"rm -rf {directory}", check=False)


def test_a_full_shared_directory_in_containers_is_one_error_line_and_step_10_stays(
    provisioned, straight
):
    """The data-safety matrix's FSDP2 on /shared x a full disk, in the training containers: the
    checkpoint directory is on a 2 MB filesystem both nodes see (tests/conftest.py's
    SMALL_SHARED, a tmpfs volume on every node inside its /shared), holding step 10
    of the uninterrupted run, then filled up. The write of step 15 fails, and both nodes print
    the one line naming the directory; step 10 is byte for byte as it was and step 15 never
    takes its name; once there is room again the run resumes from step 10 and ends bit for bit
    where the uninterrupted one does."""
    mounted = on_node(provisioned.cluster, 1, f"df -P {SMALL_SHARED} | tail -n 1").split()
    assert mounted[-1] == SMALL_SHARED, mounted  # a filesystem of its own
    directory = f"{SMALL_SHARED}/ckpt-{uuid.uuid4().hex[:8]}"
    filler = f"{SMALL_SHARED}/filler"
    listing = f"cd {directory} && find step-00000010 -type f | sort | xargs sha256sum"
    try:
        on_node(
            provisioned.cluster,
            1,
            f"mkdir -p {directory} && chown --reference={SHARED} {directory} && "
            f"cp -a {SHARED}/step-00000010 {directory}/ && "
            f"(dd if=/dev/zero of={filler} bs=4k 2>/dev/null; true)",
        )
        before = on_node(provisioned.cluster, 2, listing)  # as node2 sees it
        assert "step-00000010/.metadata" in before, before
        full = _train(provisioned, _args("--checkpoint-dir", directory))
        assert full.returncode != 0, full.stdout[-3000:]
        said = [line for line in full.stdout.splitlines() if " Error: " in line]
        for node in ("node1", "node2"):  # the ranks agree on the error, each node says it
            assert any(
                line.startswith(f"[{node}] Error: cannot write checkpoint step 15 to {directory}")
                and "No space left on device" in line
                and line.endswith("(try freeing space there, or another --checkpoint-dir)")
                for line in said
            ), full.stdout[-3000:]
        # What was complete stays complete: step 10 as it was; the half-written 15 never named.
        assert on_node(provisioned.cluster, 1, listing) == before
        steps = on_node(provisioned.cluster, 2, f"ls -A {directory}").split()
        assert steps == [".step-00000015.tmp", "step-00000010"], steps
        on_node(provisioned.cluster, 2, f"rm {filler}")
        again = _train(provisioned, _args("--checkpoint-dir", directory, "--keep", "1"))
        assert again.returncode == 0, again.stdout[-3000:]
        assert (
            "resuming from step 10, the newest step every rank has (rank 0 has 10; rank 1 has 10)"
            in _master_lines(again.stdout).splitlines()
        ), again.stdout[-3000:]
        assert digest(_master_lines(again.stdout)) == digest(_master_lines(straight.stdout))
        steps = on_node(provisioned.cluster, 1, f"ls -A {directory}").split()
        assert steps == ["step-00000020"], steps  # the half-written 15 swept, --keep 1
    finally:
        on_node(provisioned.cluster, 1, f"rm -rf {directory} {filler}", check=False)


# The data-safety matrix's FSDP2 cells in the training containers: where the ranks write
# ("node-local": each node its own disk, with replicas; "shared": /shared, which both see), the
# step whose write node2's rank pauses in (the test hook), and the fault there: the rank
# "killed" (RESTARTS=1: the launcher restarts the job), or Ctrl-C at the launcher; or
# "killed-between": node2's rank held after that step (--hold-after-step, between checkpoints)
# and killed there.
_FAULTS = [
    pytest.param("node-local", 5, "killed", id="node-local-killed-before-the-first-checkpoint"),
    pytest.param("node-local", 7, "killed-between", id="node-local-killed-between-checkpoints"),
    pytest.param("node-local", 10, "ctrl-c", id="node-local-ctrl-c-during-a-checkpoint-write"),
    pytest.param("shared", 10, "ctrl-c", id="shared-ctrl-c-during-a-checkpoint-write"),
    pytest.param("shared", 5, "killed", id="shared-killed-before-the-first-checkpoint"),
    pytest.param("shared", 10, "killed", id="shared-killed-during-a-checkpoint-write"),
]


@pytest.mark.parametrize(("layout", "paused", "fault"), _FAULTS)
def test_a_fault_in_a_checkpoint_write_in_containers_loses_no_complete_step(
    provisioned, straight, layout, paused, fault
):
    """node2's rank pauses inside its write of step `paused`, its files in the step's temporary
    directory (or, killed-between, sleeps after step 7, step 5 written and step 10 not begun);
    then it is killed (--restarts 1: the restart starts over from step 0 when no
    step was complete, else resumes from step 5, the step before) or the launcher gets Ctrl-C
    (exit 130; the step before is there, byte for byte as it was at the pause, and the next run
    resumes from it). The paused step never takes its name, the half-written one is swept, and
    the run ends bit for bit where the uninterrupted one does."""
    name = f"fsdp-{layout}-{uuid.uuid4().hex[:8]}"
    directory = f"/shared/{name}" if layout == "shared" else f"{DEFAULT_CHECKPOINT_ROOT}/{name}"
    nodes = (1,) if layout == "shared" else (1, 2)  # where the steps are: one directory, or two

    def steps() -> dict[int, str]:
        """Each node's complete steps and their files' digests, as `ls` and sha256sum see them."""
        return {
            index: on_node(
                provisioned.cluster,
                index,
                f"cd {directory} && ls -A | grep '^step-' | sort; "
                "find step-* -type f 2>/dev/null | sort | xargs -r sha256sum; true",
            )
            for index in nodes
        }

    where = directory if layout == "shared" else name
    killed = fault.startswith("killed")
    if fault == "killed-between":
        pause = ["--hold-after-step", str(paused), "--hold-rank", "1"]
        moment = f"[node2] [rank 1] held after step {paused} "
    else:
        pause = ["--checkpoint-pause-step", str(paused), "--checkpoint-pause-rank", "1"]
        moment = f"[node2] [rank 1] checkpoint step {paused}: its files written "
    # The launcher itself, not make: its exit code is the one asserted, and Ctrl-C is its own.
    job = subprocess.Popen(
        [str(VENV_BIN / "train"), "-i", str(provisioned.inventory), "--nnodes", "2"]
        + ["--module", "training.fsdp", *(["--restarts", "1"] if killed else [])]
        + ["--", *SMALL, "--checkpoint-dir", where, *pause],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        seen = read_until(job, moment)
        before = steps()
        if killed:
            on_node(
                provisioned.cluster, 2, "pkill -9 -f ' -u -m torch_multinode[.]training[.]fsdp '"
            )
            rest, _ = job.communicate(timeout=600)
        else:
            rest, _ = interrupt(job)
    finally:
        if job.poll() is None:
            job.kill()
    try:
        out = seen + rest
        if killed:
            assert job.returncode == 0, out[-4000:]
            restarted = out.split("restart 1 of 1", 1)[1]
            if paused == 5:  # the first: nothing was complete, the restart starts over
                assert all("step-" not in listed for listed in before.values()), before
                assert re.search(
                    r"\[node1\] no checkpoints in \S+: starting from step 0", restarted
                ), restarted[-3000:]
            else:  # step 5 complete at the kill: the restart resumes from it, not from 10
                if fault == "killed-between":  # node1's rank waited in step 8: 10 never begun
                    first = out.split("restart 1 of 1", 1)[0]
                    assert not re.search(r"^\[node1\] step +8/", first, re.M), first[-3000:]
                for listed in before.values():
                    assert listed.split("\n")[0] == "step-00000005", listed
                    assert "step-00000010" not in listed, listed
                assert re.search(
                    r"\[node1\] resuming from step 5, the newest step every rank has", restarted
                ), restarted[-3000:]
            ended = restarted
            # The master's run directory of each run comes home into the job's one log
            # directory: the failed one's (its rank 0's Flight Recorder trace, written as the
            # peer's death reached it), and the restart's (copied, whatever it holds: no file
            # here, in the runs seen).
            first_id = run_id_in(seen)
            copied = re.search(
                rf"Run directory of node1: \d+ file\(s\) from node1:{REMOTE_RUN_ROOT}/{first_id}-r1$",
                restarted,
                re.M,
            )
            home = REPO_ROOT / ".runs" / first_id
            try:
                assert copied, restarted[-3000:]
                assert (home / "flight-rank-0.json").is_file(), sorted(home.rglob("*"))
            finally:
                shutil.rmtree(home, ignore_errors=True)
        else:
            assert job.returncode == 130, out[-4000:]
            assert f"Job {run_id_in(seen)} interrupted" in rest, rest[-3000:]
            # Step 5 complete and byte for byte as at the pause; step 10 never took its name.
            assert steps() == before, before
            for listed in before.values():
                assert listed.split("\n")[0] == "step-00000005", listed
            again = _train(provisioned, _args("--checkpoint-dir", where))
            assert again.returncode == 0, again.stdout[-4000:] + again.stderr
            assert re.search(
                r"\[node1\] resuming from step 5, the newest step every rank has", again.stdout
            ), again.stdout[-4000:]
            ended = again.stdout
        # The paused write swept, the newest steps (--keep 3) written whole, on every disk.
        for index in nodes:
            listed = on_node(provisioned.cluster, index, f"ls -A {directory}").split()
            named = sorted(n for n in listed if n.startswith("step-"))
            assert named == ["step-00000010", "step-00000015", "step-00000020"], listed
            assert not any(n.endswith(".tmp") for n in listed), listed
        assert digest(_master_lines(ended)) == digest(_master_lines(straight.stdout))
    finally:
        for index in nodes:
            on_node(provisioned.cluster, index, f"rm -rf {directory}", check=False)
