"""Per-step fault tolerance (FT=1, training.distributed.replicas) on this machine: torchft's
lighthouse (launch.lighthouse) and three replica groups of training.ddp, each its own torchrun,
all on loopback: without a fault they train DDP's steps, a group killed mid-write keeps its
durable checkpoints, a user's own script runs as groups. A group killed mid-run and healing when
started again is tests/training/test_ft_nodes.py's, in the training image on 3 simulated nodes."""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import REPO_ROOT
from tests.helpers import SCRIPTS
from tests.training.conftest import (
    REFERENCE_STEPS,
    TINY,
    TimedOutput,
    free_port,
    load_state,
    max_difference,
    run_environment,
    torchrun_command,
    with_values,
)
from torch_multinode.cluster.errors import UserError
from torch_multinode.cluster.jobenv import (
    FLIGHT_TIMEOUT_DUMP,
    LIGHTHOUSE_VARIABLE,
    REPLICA_ADDRESS_VARIABLE,
    REPLICA_GROUP_VARIABLE,
    REPLICA_GROUPS_VARIABLE,
    REPLICA_MIN_GROUPS_VARIABLE,
    REPLICA_START_WAIT_VARIABLE,
    REPLICA_TIMEOUT_VARIABLE,
)
from torch_multinode.launch import lighthouse
from torch_multinode.training.distributed import replicas
from torch_multinode.training.settings.config import STOP_EXIT_CODE, DDPConfig

LOOPBACK = "127.0.0.1"
STEPS = 300
TIMEOUT = 3  # seconds a cross-group collective waits for a silent group


def test_no_replica_variables_is_no_replication_and_partial_ones_are_refused():
    assert replicas.read({}) is None
    with pytest.raises(
        UserError, match=f"needs {REPLICA_GROUP_VARIABLE}, {REPLICA_GROUPS_VARIABLE}"
    ):
        replicas.read({LIGHTHOUSE_VARIABLE: "http://127.0.0.1:1"})
    base = {
        LIGHTHOUSE_VARIABLE: "http://127.0.0.1:1",
        REPLICA_GROUP_VARIABLE: "3",
        REPLICA_GROUPS_VARIABLE: "3",
    }
    with pytest.raises(UserError, match="is not a group of TMN_REPLICA_GROUPS=3 .0 to 2."):
        replicas.read(base)
    with pytest.raises(UserError, match="must be 1 to the 3 groups"):
        replicas.read({**base, REPLICA_GROUP_VARIABLE: "2", REPLICA_MIN_GROUPS_VARIABLE: "4"})
    with pytest.raises(UserError, match="'soon' is not a number"):
        replicas.read({**base, REPLICA_TIMEOUT_VARIABLE: "soon"})
    group = replicas.read({**base, REPLICA_GROUP_VARIABLE: "2", REPLICA_ADDRESS_VARIABLE: "n3"})
    assert group == replicas.ReplicaGroup(2, 3, "http://127.0.0.1:1", 1, 10.0, "n3")
    # Rank 1 of a node's 2: the third group's share comes after the others'.
    assert group.data_position(1, 2) == (5, 6)
    # A test hook's rank is the job's, counted across the groups: rank 5 of 6 is this group's
    # rank 1; rank 1 is another group's.
    assert [group.own_rank(rank, 2) for rank in (5, 4, 1, None)] == [1, 0, -1, None]


def test_ddp_options_that_would_change_the_buckets_or_their_all_reduce_are_refused():
    """Replica groups carry DDP's buckets across the nodes through torchft, one layout on every
    group: no compression hook beside theirs, no static graph (it rebuilds the buckets)."""
    plain = DDPConfig()
    replicas.check_ddp(plain)  # the defaults run
    with pytest.raises(UserError, match="--comm-hook fp16 with replica groups") as refused:
        replicas.check_ddp(dataclasses.replace(plain, comm_hook="fp16"))
    assert refused.value.hint == "--comm-hook none"
    with pytest.raises(UserError, match="--static-graph with replica groups"):
        replicas.check_ddp(dataclasses.replace(plain, static_graph=True))


class _Manager:
    """torchft's Manager as `Replication._across` asks it: this step's quorum and its errors
    (wrap_future as torchft 0.2.0's: an error reported, the default value given)."""

    def __init__(self, errored: bool = False, participating: bool = True):
        self.failed, self.participating, self.reported = errored, participating, []

    def errored(self) -> bool:
        return self.failed

    def wait_quorum(self) -> None:
        pass

    def num_participants(self) -> int:
        return 2

    def is_participating(self) -> bool:
        return self.participating

    def report_error(self, error: Exception) -> None:
        self.reported.append(error)

    def wrap_future(self, future, default):
        def swallowed(done):
            try:
                return done.value()
            except Exception as error:
                self.report_error(error)
                return default

        return future.then(swallowed)


class _Gloo:
    """The groups' process group: an all-reduce in flight until the test completes it with
    the other group's tensor added, or fails it; or refused as it is issued."""

    def __init__(self, refuse: bool = False):
        self.refuse, self.issued = refuse, []

    def allreduce(self, tensors, options):
        if self.refuse:
            raise RuntimeError("the quorum's group is not configured")
        future = torch.futures.Future()
        self.issued.append((future, tensors[0], options.reduceOp))
        return SimpleNamespace(get_future=lambda: future)


def _across(manager: _Manager, gloo: _Gloo) -> Callable[[torch.Tensor], torch.futures.Future]:
    replication = replicas.Replication.__new__(replicas.Replication)
    replication.manager, replication._pg = manager, gloo
    return replication._across


def test_a_bucket_crosses_the_groups_while_the_backward_pass_goes_on():
    """On the CPU the hook's all-reduce across the groups is issued and left in flight (the
    backward pass goes on; torchft 0.2.0's own work would be waited for), its future averaging
    over the participants once gloo's thread completes it; a failure in flight is reported to
    the Manager (the step is then not committed) and the bucket given back as it was."""
    manager, gloo = _Manager(), _Gloo()
    bucket = torch.tensor([1.0, 2.0])
    future = _across(manager, gloo)(bucket)
    assert not future.done()  # in flight: nothing waited for
    ((issued, tensor, op),) = gloo.issued
    assert tensor is bucket and op == torch.distributed.ReduceOp.SUM
    tensor += torch.tensor([3.0, 4.0])  # the other group's
    issued.set_result([tensor])
    assert future.wait().tolist() == [2.0, 3.0] and not manager.reported

    failing = _Gloo()
    future = _across(manager, failing)(torch.tensor([1.0]))
    failing.issued[0][0].set_exception(RuntimeError("group1 timed out"))
    assert future.wait().tolist() == [1.0]
    (reported,) = manager.reported
    assert "RuntimeError: group1 timed out" in str(reported), reported


def test_a_bucket_of_a_lost_step_a_healing_group_or_an_unconfigured_group_sends_nothing_wrong():
    # A step already lost: no collective, the bucket back at once.
    gloo = _Gloo()
    assert _across(_Manager(errored=True), gloo)(torch.tensor([5.0])).wait().tolist() == [5.0]
    assert gloo.issued == []
    # A healing group counts as zero in the others' sum.
    bucket = torch.tensor([5.0])
    _across(_Manager(participating=False), gloo)(bucket)
    assert bucket.tolist() == [0.0] and len(gloo.issued) == 1
    # Refused as it is issued: reported, the bucket back at once.
    manager = _Manager()
    future = _across(manager, _Gloo(refuse=True))(torch.tensor([5.0]))
    assert future.done() and future.wait().tolist() == [5.0] and len(manager.reported) == 1


def test_a_lighthouse_that_cannot_bind_is_one_error_line(tmp_path):
    with lighthouse.running(LOOPBACK, free_port(), 1, tmp_path / "first.log") as url:
        port = int(url.rsplit(":", 1)[1])
        with pytest.raises(UserError, match=f"the torchft lighthouse on 127.0.0.1:{port} exited"):
            with lighthouse.running(LOOPBACK, port, 1, tmp_path / "second.log"):
                pass


def test_two_groups_without_a_fault_train_the_steps_of_ddp_on_two_ranks(tmp_path, reference_ddp):
    """The same data shares, the gradients averaged over the same ranks: the groups end where
    2-process DDP does (within float rounding: torchft sums in another order)."""
    with lighthouse.running(LOOPBACK, free_port(), 1, tmp_path / "lighthouse.log") as url:
        processes = [
            _group(index, url, tmp_path, 120, groups=2, steps=REFERENCE_STEPS, step_delay=0)
            for index in range(2)
        ]
        outputs = [TimedOutput(process, time.monotonic()) for process in processes]
        for output in outputs:
            output.end(timeout=180)
    for index, (process, output) in enumerate(zip(processes, outputs, strict=True)):
        assert process.returncode == 0, output.stamped
        assert "step 1: all 2 replica groups train" in output.text, output.stamped
        state = load_state(tmp_path / f"group{index}.pt")
        assert max_difference(state, reference_ddp.state) < 1e-5, output.stamped
    # torchft left the Flight Recorder's path as it was: no folder per quorum beside it.
    assert not list(tmp_path.glob(f"{FLIGHT_TIMEOUT_DUMP}*")), sorted(tmp_path.iterdir())


def group_environment(index: int, url: str, groups: int, start_wait: float) -> dict[str, str]:
    """The environment of replica group `index` of `groups` on loopback, as the launcher's FT=1
    gives it on a node."""
    return run_environment(
        {
            LIGHTHOUSE_VARIABLE: url,
            REPLICA_GROUP_VARIABLE: str(index),
            REPLICA_GROUPS_VARIABLE: str(groups),
            REPLICA_MIN_GROUPS_VARIABLE: "1",
            REPLICA_TIMEOUT_VARIABLE: str(TIMEOUT),
            REPLICA_ADDRESS_VARIABLE: LOOPBACK,
            REPLICA_START_WAIT_VARIABLE: str(start_wait),
            # As the launcher sets it (launch.environment): where torch dumps the Flight
            # Recorder on a timeout, in the run directory (here the group's working directory).
            "TORCH_FR_DUMP_TEMP_FILE": FLIGHT_TIMEOUT_DUMP,
        }
    )


def _group(
    index: int,
    url: str,
    tmp_path,
    start_wait: float = 0,
    groups: int = 3,
    steps: int = STEPS,
    step_delay: float = 0.12,
) -> subprocess.Popen:
    command = torchrun_command(
        "training.ddp",
        *with_values(TINY, global_batch_size=str(16 * groups)),  # TINY's 32 on 2 groups
        "--steps",
        str(steps),
        "--out",
        f"group{index}.pt",
        *(["--step-delay", str(step_delay)] if step_delay else []),
        nproc=1,
        run_id=f"group{index}",
    )
    return start_group(command, tmp_path, group_environment(index, url, groups, start_wait))


def start_group(command: list[str], directory, environ: dict[str, str]) -> subprocess.Popen:
    """A replica group's torchrun, its output piped."""
    return subprocess.Popen(
        command,
        cwd=directory,
        env=environ,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its torchrun (and the test's pkill) alone in its group
    )


def kill_group(process: subprocess.Popen) -> None:
    """The group's torchrun and its rank, which torchrun starts in a session of its own: the
    whole group gone at once, as with its node."""
    subprocess.run(["pkill", "-9", "-P", str(process.pid)], check=False)
    os.killpg(process.pid, signal.SIGKILL)


def _digest(text: str) -> str:
    found = re.findall(r"\[rank 0\] parameters sha256 ([0-9a-f]{64})", text)
    assert len(found) == 1, text
    return found[0]


def _checkpointing_group(index: int, url: str, tmp_path, *args: str, start_wait: float):
    """training.ddp as group `index` of 2, checkpoints every 4 steps in its own directory (a
    node's own disk)."""
    command = torchrun_command(
        "training.ddp",
        *with_values(TINY, log_every="1"),
        "--steps",
        "16",
        "--checkpoint-dir",
        f"ck{index}",
        "--checkpoint-every",
        "4",
        "--step-delay",
        "0.2",
        *args,
        nproc=1,
        run_id=f"group{index}",
    )
    return start_group(command, tmp_path, group_environment(index, url, 2, start_wait))


def test_groups_checkpoints_survive_a_group_killed_mid_write_and_a_rerun_goes_on_from_the_newest(
    tmp_path,
):
    """Durable checkpoints with FT=1: each group writes its own ranks' files. Group 1 is killed
    while it writes step 8 (held between its file's write and its rename); group 0 goes on
    alone and stops after step 12. Run again, each group resumes from the newest step complete
    on its own disk (group 0: 12; group 1: 4, its step 8 never loaded) and torchft makes the
    newest the resume point: group 1 heals from group 0 at its first step, and both end on one
    set of parameters."""
    _, rerun = killed_mid_write_then_run_again(_checkpointing_group, tmp_path, 240)
    assert "resuming from step 4" in rerun[1].text, rerun[1].stamped
    assert _steps16(rerun[0].text) == [13, 14, 15, 16], rerun[0].stamped
    assert _digest(rerun[0].text) == _digest(rerun[1].text)
    # Group 1's file of step 8 never got its name; group 0 holds every step to the last.
    assert not list((tmp_path / "ck1").glob("step-00000008-*.pt")), sorted(
        path.name for path in (tmp_path / "ck1").iterdir()
    )
    assert list((tmp_path / "ck0").glob("step-00000016-*.pt"))


def killed_mid_write_then_run_again(
    group: Callable[..., subprocess.Popen], tmp_path, timeout: float
) -> tuple[list[TimedOutput], list[TimedOutput]]:
    """The checkpoint tests' scenario with FT=1, for either workload (`group(index, url,
    tmp_path, *args, start_wait=)` starts one with checkpoints every 4 steps): group 1 killed
    in its pause inside step 8's write, group 0 alone until it stops after step 12; then both
    run again to step 16. Their newest steps differ (12 and 4): one quorum as soon as both are
    in it, not after the start wait (600 s, past what this waits for them). What both runs
    said; what every such run must show is checked here: group 0 stopped as asked and trained
    alone, and in the second run each group ended well, group 0 from step 12, group 1 healed
    from it at step 13."""
    started = time.monotonic()
    with lighthouse.running(LOOPBACK, free_port(), 1, tmp_path / "lighthouse.log") as url:
        first = [
            group(0, url, tmp_path, "--stop-after-step", "12", start_wait=120),
            group(1, url, tmp_path, "--checkpoint-pause-step", "8", start_wait=120),
        ]
        outputs = [TimedOutput(process, started) for process in first]
        try:
            outputs[1].first("checkpoint step 8: ", timeout=timeout)
            kill_group(first[1])
            outputs[1].mark("killed while writing step 8")
            outputs[0].end(timeout=timeout)
        finally:
            for process in first:
                if process.poll() is None:
                    kill_group(process)
        # torchrun says its rank's exit code and exits 1.
        assert f"exitcode  : {STOP_EXIT_CODE}" in outputs[0].text, outputs[0].stamped
        assert "stopping after step 12 (--stop-after-step)" in outputs[0].text
        assert "1 of 2 replica groups train" in outputs[0].text, outputs[0].stamped
        again = [group(index, url, tmp_path, start_wait=600) for index in range(2)]
        rerun = [TimedOutput(process, started) for process in again]
        try:
            for output in rerun:
                output.end(timeout=timeout)
        finally:
            for process in again:
                if process.poll() is None:
                    kill_group(process)
    assert [p.returncode for p in again] == [0, 0], [output.stamped for output in rerun]
    assert "resuming from step 12" in rerun[0].text, rerun[0].stamped
    healed = re.search(r"healed from a peer: at step (\d+)", rerun[1].text)
    assert healed and int(healed.group(1)) == 13, rerun[1].stamped
    assert "healed from a peer" not in rerun[0].text, rerun[0].stamped
    return outputs, rerun


def _steps16(text: str) -> list[int]:
    return [int(step) for step in re.findall(r"^step (\d+)/16 ", text, re.M)]


def test_a_users_own_script_as_the_readme_shows_it_trains_as_replica_groups(tmp_path):
    """tests/training/launcher_scripts/ft_own.py, training/README.md's FT=1 example: two groups on
    loopback, each its own torchrun with the environment the launcher gives, end on one
    checksum at step 20. Both are the minimum (MIN_NODES=2): the script's steps take
    milliseconds, and with a minimum of one the group up first would train all 20 alone before
    the other has imported torch."""
    script = SCRIPTS / "ft_own.py"
    with lighthouse.running(LOOPBACK, free_port(), 2, tmp_path / "lighthouse.log") as url:
        processes = []
        for index in range(2):
            environ = run_environment(
                {
                    LIGHTHOUSE_VARIABLE: url,
                    REPLICA_GROUP_VARIABLE: str(index),
                    REPLICA_GROUPS_VARIABLE: "2",
                    REPLICA_MIN_GROUPS_VARIABLE: "2",
                    REPLICA_ADDRESS_VARIABLE: LOOPBACK,
                }
            )
            command = torchrun_command("x", nproc=1, run_id=f"own{index}")
            command[-2:] = [str(script)]  # the script instead of `-m x`
            processes.append(
                subprocess.Popen(
                    command,
                    cwd=tmp_path,
                    env=environ,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    start_new_session=True,
                )
            )
        outputs = [TimedOutput(process, time.monotonic()) for process in processes]
        for output in outputs:
            output.end(timeout=180)
    said = [re.findall(r"group (\d): step (\d+) checksum (\S+)", o.text) for o in outputs]
    assert [p.returncode for p in processes] == [0, 0], [o.stamped for o in outputs]
    assert [s[0][:2] for s in said] == [("0", "20"), ("1", "20")], said
    assert said[0][0][2] == said[1][0][2], said


def test_the_readme_shows_the_users_own_script_as_it_is_tested():
    """training/README.md's FT=1 example is ft_own.py's code, line for line (its docstring
    aside)."""
    readme = (REPO_ROOT / "training" / "README.md").read_text()
    block = re.search(r"```python\n(# FT=1: .*?)```", readme, re.S)
    assert block is not None
    code = (SCRIPTS / "ft_own.py").read_text()
    body = code[code.index('"""', 3) + 4 :].strip()
    shown = "\n".join(block.group(1).splitlines()[1:]).strip()
    assert shown == body
