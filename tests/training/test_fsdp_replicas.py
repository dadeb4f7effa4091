"""training.fsdp with FT=1 (training.distributed.replicas.Shards) on this machine: two replica
groups of two FSDP2 ranks each, every group its own torchrun, torchft's lighthouse on loopback.
Without a fault the groups train the plain process's steps; a group killed mid-run costs the
other one step, not its processes, and started again it heals from its peer's shards.

Tolerance: as tests/training/test_fsdp.py's (1e-5 over 20 steps of AdamW; torchft sums the
groups' gradients in another order than the plain process's one batch)."""

from __future__ import annotations

import re
import subprocess
import time

import pytest

from tests.training.conftest import (
    TimedOutput,
    free_port,
    load_state,
    max_difference,
    torchrun_command,
    with_values,
)
from tests.training.references import SMALL, STEPS, reference
from tests.training.test_replicas import (
    LOOPBACK,
    group_environment,
    kill_group,
    killed_mid_write_then_run_again,
    start_group,
)
from torch_multinode.launch import lighthouse

pytestmark = pytest.mark.xdist_group("fsdp")  # four ranks at once: not beside the other fsdp runs
LONG = 300  # steps: the survivor still trains when the group started again has joined
KILLED_AT = 12


def _group(index: int, url: str, tmp_path, *args: str, start_wait: float = 0) -> subprocess.Popen:
    command = torchrun_command("training.fsdp", *args, nproc=2, run_id=f"group{index}")
    return start_group(command, tmp_path, group_environment(index, url, 2, start_wait))


def _digest(text: str) -> str:
    (found,) = re.findall(r"^(?:\[rank 0\] )?parameters +sha256 ([0-9a-f]{64})$", text, re.M)
    return found


def _steps(text: str, total: int) -> list[int]:
    return [int(step) for step in re.findall(rf"^step +(\d+)/{total} ", text, re.M)]


def test_two_groups_of_fsdp_ranks_without_a_fault_train_the_plain_processs_steps(tmp_path):
    """Each rank's gradient shards averaged with the same rank's of the other group: the four
    ranks' mean, which is the plain process's gradient over the whole batch."""
    with lighthouse.running(LOOPBACK, free_port(), 1, tmp_path / "lighthouse.log") as url:
        processes = [
            _group(index, url, tmp_path, *SMALL, "--export", f"group{index}.pt", start_wait=120)
            for index in range(2)
        ]
        outputs = [TimedOutput(process, time.monotonic()) for process in processes]
        for output in outputs:
            output.end(timeout=240)
    model, _ = reference()
    for index, (process, output) in enumerate(zip(processes, outputs, strict=True)):
        assert process.returncode == 0, output.stamped
        assert "step 1: all 2 replica groups train" in output.text, output.stamped
        assert _steps(output.text, STEPS) == list(range(1, STEPS + 1)), output.stamped
        state = load_state(tmp_path / f"group{index}.pt")
        assert max_difference(state, model.state_dict()) < 1e-5, output.stamped
    assert _digest(outputs[0].text) == _digest(outputs[1].text)


def test_a_group_of_fsdp_ranks_killed_mid_run_heals_from_its_peers_shards(tmp_path):
    """Group 1 killed after step 12: group 0 goes on in the same processes, its steps never
    going back; started again, group 1's ranks each take their shards of the parameters and
    of AdamW's state from group 0's same rank and train with it to the end: one digest."""
    args = (*with_values(SMALL, steps=str(LONG), log_every="1"), "--step-delay", "0.1")
    started = time.monotonic()
    with lighthouse.running(LOOPBACK, free_port(), 1, tmp_path / "lighthouse.log") as url:
        processes = [_group(index, url, tmp_path, *args, start_wait=120) for index in range(2)]
        outputs = [TimedOutput(process, started) for process in processes]
        everyone = list(processes)
        try:
            outputs[1].first(f"step {KILLED_AT:>3}/{LONG}", timeout=240)
            kill_group(processes[1])
            outputs[1].mark("killed")
            outputs[1].end(timeout=30)
            outputs[0].first("1 of 2 replica groups train", timeout=60)
            again = _group(1, url, tmp_path, *args)
            everyone.append(again)
            rejoined = TimedOutput(again, started)
            rejoined.first("healed from a peer: at step ", timeout=180)
            for output in (outputs[0], rejoined):
                output.end(timeout=240)
        finally:
            for process in everyone:
                if process.poll() is None:
                    kill_group(process)
    survivor = outputs[0]
    assert processes[0].returncode == 0, survivor.stamped
    assert again.returncode == 0, rejoined.stamped
    steps = _steps(survivor.text, LONG)
    assert steps == sorted(steps) and steps[-1] == LONG, survivor.stamped
    assert "step 1: all 2 replica groups train" in survivor.text, survivor.stamped
    after = survivor.text.split("1 of 2 replica groups train")[1]
    assert "all 2 replica groups train" in after, survivor.stamped
    healed = re.search(r"healed from a peer: at step (\d+)", rejoined.text)
    assert healed and KILLED_AT < int(healed.group(1)) < LONG, rejoined.stamped
    assert _digest(survivor.text) == _digest(rejoined.text), (survivor.stamped, rejoined.stamped)


def _checkpointing_group(index: int, url: str, tmp_path, *args: str, start_wait: float):
    """training.fsdp as group `index` of 2, two ranks, checkpoints every 4 steps in `ck`: one
    directory for both groups, as storage every node sees would be."""
    arguments = (*with_values(SMALL, steps="16", log_every="1"), "--step-delay", "0.2")
    return _group(
        index,
        url,
        tmp_path,
        *arguments,
        "--checkpoint-dir",
        "ck",
        "--checkpoint-every",
        "4",
        *args,
        start_wait=start_wait,
    )


def test_fsdp_groups_checkpoints_survive_a_group_killed_mid_write_and_a_rerun_goes_on_from_the_newest(
    tmp_path,
):
    """Durable checkpoints of training.fsdp with FT=1: each group writes its own (DCP, its two
    ranks' shards) in a directory of its own, ck/group-<index>. Group 1 is killed while it
    writes step 8 (its files written, before the step takes its name); group 0 goes on alone
    and stops after step 12. Run again, each group resumes from the newest step complete in its
    own directory (group 0: 12; group 1: 4, its step 8 never loaded) and torchft makes the
    newest the resume point: group 1 heals from group 0 at its first step, and both end on one
    set of parameters."""
    first, rerun = killed_mid_write_then_run_again(_checkpointing_group, tmp_path, 300)
    assert "checkpoints    this replica group's own, in ck/group-0" in first[0].text
    assert "resuming from step 4" in rerun[1].text, rerun[1].stamped
    assert _steps(rerun[0].text, 16) == [13, 14, 15, 16], rerun[0].stamped
    assert _digest(rerun[0].text) == _digest(rerun[1].text)
    # Group 1's step 8 never took its name (its files were swept at the rerun's start); each
    # group's directory holds its newest three complete steps, the last one's among them.
    held = {
        index: sorted(
            path.name
            for path in (tmp_path / "ck" / f"group-{index}").iterdir()
            if re.fullmatch(r"\.?step-\d{8}(\.tmp)?", path.name)
        )
        for index in range(2)
    }
    assert held == {
        0: ["step-00000008", "step-00000012", "step-00000016"],
        1: ["step-00000004", "step-00000016"],
    }
    for index in range(2):
        assert (tmp_path / "ck" / f"group-{index}" / "step-00000016" / "manifest.pt").is_file()
