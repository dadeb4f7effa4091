"""Hangs on the simulated cluster, jobs in the training image (launch_mode: container): a job
that stops making progress without failing is noticed (STALL=), every rank's stacks are read
with py-spy inside the job's containers, and the report names the rank, its node and its line:

- a rank asleep in its data loading at step 5: named with the line of the sleep, the other
  rank said to wait in all_reduce; the job stopped, nothing of it left on any node, the
  report in `.runs/<id>/`;
- a rank that skipped one all_reduce: both ranks' collectives named with their sequence numbers
  from the Flight Recorder (all_reduce #10 / barrier #10);
- a rank busy in a Python loop: named with its line; with ON_HANG=wait, the report, then the
  job left running until Ctrl-C;
- a rank that skipped one all_reduce, with a short collective timeout: the job fails on the
  timeout before any stall, and its summary names the mismatch from the traces the ranks wrote
  as they died;
- `make hang-report RUN=<id>` prints a saved report again.
"""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, make
from tests.helpers import leftovers, no_containers_left, on_node, read_until, run_id_in, start_train
from torch_multinode.cluster.inventory_read import load
from torch_multinode.launch.signatures import SIGNATURES
from torch_multinode.launch.spec import RUN_LABEL

pytestmark = [pytest.mark.sim, pytest.mark.timeout(1200)]

STALL = "10"  # seconds; a healthy job here prints a line every 0.3 s

# Prints its rank's node, then a step line per step (rank 0); rank 1 misbehaves as FAULT says.
SCRIPT = """\
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

FAULT = sys.argv[1]
TIMEOUT = datetime.timedelta(seconds=10 if FAULT == "timeout" else 1800)  # each collective's
dist.init_process_group("gloo", timeout=TIMEOUT)
# Nothing of ours: the job's sitecustomize serves the Flight Recorder's trace (README).
rank = dist.get_rank()
print(f"rank {rank} runs on {os.environ['TMN_NODE_NAME']}", flush=True)


def load_batch(step):
    if FAULT == "sleep" and rank == 1 and step == 5:
        time.sleep(3600)  # HANG-LINE sleep
    return torch.ones(1)


def spin():
    while True: pass  # HANG-LINE spin (one line: py-spy may catch either line of a two-line loop)


for step in range(1, 11):
    batch = load_batch(step)
    if FAULT == "spin" and rank == 1 and step == 5:
        spin()
    if not (FAULT in ("skip", "timeout") and rank == 1 and step == 3):
        dist.all_reduce(batch)
    if rank == 0:
        print(f"step {step}/10", flush=True)
    time.sleep(0.3)
dist.barrier()
dist.destroy_process_group()
"""


def line_of(marker: str) -> int:
    return next(i for i, line in enumerate(SCRIPT.splitlines(), 1) if f"HANG-LINE {marker}" in line)


def _project(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "hang.py").write_text(SCRIPT)
    return root / "hang.py"


def _hung(provisioned, tmp_path, fault: str, stall: str = STALL) -> tuple[str, str, dict[int, str]]:
    """The job with `fault`, run to its end: its output, run ID and where each rank ran."""
    script = _project(tmp_path / "proj")
    return _failed(provisioned, script, f"STALL={stall}", f"ARGS={fault}")


def _failed(provisioned, script: Path, *variables: str) -> tuple[str, str, dict[int, str]]:
    """`make train` of `script` on 2 nodes, which must fail: its output, run ID and where each
    rank ran."""
    run = make(
        "train",
        f"INVENTORY={provisioned.inventory}",
        "NNODES=2",
        f"SCRIPT={script}",
        f"WORKDIR={script.parent}",
        *variables,
        timeout=900,
    )
    output = run.stdout + run.stderr
    assert run.returncode != 0, output[-3000:]
    nodes = {int(r): n for r, n in re.findall(r"rank (\d) runs on (node\d)", output)}
    assert sorted(nodes) == [0, 1], output[-3000:]
    return output, run_id_in(output), nodes


def _left(provisioned, run_id: str) -> dict[str, str]:
    """Per node: the job's processes, rendezvous listener and containers still there."""
    found = leftovers(load(provisioned.inventory).first("2"), run_id)
    for index in (1, 2):
        containers = on_node(
            provisioned.cluster, index, f"docker ps -q --filter label={RUN_LABEL}={run_id}"
        )
        found[f"node{index}"] = (found.get(f"node{index}", "") + containers).strip()
    return found


def _nothing_left(provisioned, run_id: str) -> None:
    """No container, process or rendezvous listener of the run on either node. The stop kills a
    container at once and Docker removes it once its cleanup is done: given up to a minute
    (no_containers_left), as CI run 38 found a stopped job's containers still listed at once."""
    no_containers_left(provisioned.cluster, (1, 2), run_id)
    found = _left(provisioned, run_id)
    assert not any(found.values()), found


def test_a_rank_asleep_in_its_data_loading_is_named_with_its_line(provisioned, tmp_path):
    output, run_id, nodes = _hung(provisioned, tmp_path, "sleep")
    assert "the job hangs; reading every rank's stacks" in output, output[-3000:]
    sleeper = (
        f"rank 1 on {nodes[1]}: not in a collective, at hang.py:{line_of('sleep')} in load_batch"
    )
    assert sleeper in output, output[-3000:]
    assert f"rank 0 on {nodes[0]}: waits in all_reduce, called at hang.py:" in output
    # the Flight Recorder's view: rank 0 waits in collective #5, rank 1 did #4 last
    assert "; last collective all_reduce #5 (sizes [[1]])" in output, output[-3000:]
    assert f"{sleeper}; last collective all_reduce #4 (sizes [[1]])" in output
    assert f"FAILED on {nodes[1]}" in output, output[-3000:]
    report = REPO_ROOT / ".runs" / run_id / "hang-report.txt"
    assert sleeper in report.read_text()
    assert (report.parent / f"hang-stacks-{nodes[1]}.txt").is_file()
    again = make("hang-report", f"RUN={run_id}")
    assert again.returncode == 0 and sleeper in again.stdout, again.stdout + again.stderr
    _nothing_left(provisioned, run_id)


def test_a_rank_that_skipped_an_all_reduce_is_named_with_both_collectives(provisioned, tmp_path):
    output, run_id, nodes = _hung(provisioned, tmp_path, "skip")
    assert f"rank 0 on {nodes[0]}: waits in all_reduce" in output, output[-3000:]
    assert f"rank 1 on {nodes[1]}: waits in barrier" in output, output[-3000:]
    # rank 1's 9 all_reduces and its barrier against rank 0's 10 all_reduces: #10 differs
    assert (
        f"mismatched collectives: rank 0 ({nodes[0]}) in all_reduce #10 (sizes [[1]]) while "
        f"rank 1 ({nodes[1]}) in barrier #10"
    ) in output, output[-3000:]
    _nothing_left(provisioned, run_id)


def test_a_collective_that_timed_out_is_explained_by_the_ranks_last_collectives(
    provisioned, tmp_path
):
    # a 10 s collective timeout, far inside the stall time: the job fails, it does not hang
    output, run_id, nodes = _hung(provisioned, tmp_path, "timeout", stall="120")
    assert "the job hangs" not in output, output[-3000:]
    assert "Timed out waiting" in output, output[-3000:]
    # The table of known failures recognises gloo's real words for it.
    timed_out = next(s for s in SIGNATURES if s.name == "collective-timeout").line()
    assert timed_out in output.splitlines(), output[-3000:]
    assert "Last collectives (the Flight Recorder's traces, written as the ranks ended):" in output
    assert f"  rank 1 ({nodes[1]}): barrier #10" in output, output[-3000:]
    remembered = json.loads((REPO_ROOT / ".runs" / run_id / "run.json").read_text())
    assert (remembered["result"], remembered["exit_code"]) == ("failed", 1), remembered
    assert remembered["failed_node"] in nodes.values() and remembered["workload"].endswith(
        "hang.py"
    )
    assert (
        f"mismatched collectives: rank 0 ({nodes[0]}) in all_reduce #10 (sizes [[1]]) while "
        f"rank 1 ({nodes[1]}) in barrier #10"
    ) in output, output[-3000:]
    _nothing_left(provisioned, run_id)


def test_a_rank_busy_in_a_python_loop_is_named_and_on_hang_wait_left_running_until_ctrl_c(
    provisioned, tmp_path
):
    script = _project(tmp_path / "proj")
    process = start_train(
        provisioned.inventory,
        f"SCRIPT={script}",
        f"WORKDIR={script.parent}",
        f"STALL={STALL}",
        "ON_HANG=wait",
        "ARGS=spin",
    )
    try:
        seen = read_until(process, "--on-hang wait: the job is left running", limit=2000)
        nodes = {int(r): n for r, n in re.findall(r"rank (\d) runs on (node\d)", seen)}
        assert sorted(nodes) == [0, 1], seen[-3000:]
        assert (
            f"rank 1 on {nodes[1]}: not in a collective, at hang.py:{line_of('spin')} in spin"
        ) in seen, seen[-3000:]
        run_id = run_id_in(seen)
        assert any(_left(provisioned, run_id).values()), "the job was stopped, not left running"
        os.killpg(process.pid, signal.SIGINT)  # Ctrl-C, as a terminal sends it: make and train
        rest, _ = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode != 0 and "Ctrl-C" in rest, rest[-2000:]
    _nothing_left(provisioned, run_id)


# A user's own script as it comes: no step lines of our form, no heartbeat, no STALL=. Rank 1
# stops calling collectives at its 5th iteration; rank 0 waits in all_reduce (gloo's default
# timeout is 30 minutes).
PLAIN = """\
import os
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
print(f"rank {rank} runs on {os.environ['TMN_NODE_NAME']}", flush=True)
for i in range(1, 1000):
    if rank == 1 and i == 5:
        time.sleep(3600)  # HANG-LINE plain
    dist.all_reduce(torch.ones(1))
    if rank == 0:
        print(f"iteration {i}", flush=True)
    time.sleep(0.3)
dist.destroy_process_group()
"""


def test_a_plain_scripts_rank_that_stops_calling_collectives_is_a_hang_by_default(
    provisioned, tmp_path
):
    """Issue 55: no STALL given. Once the job has printed nothing for launch.idle's IDLE_AFTER
    seconds, its ranks' counters are read twice; every rank idle is a hang, and the report
    names rank 1 and its line."""
    root = tmp_path / "plain"
    root.mkdir()
    (root / "plain.py").write_text(PLAIN)
    line = next(i for i, text in enumerate(PLAIN.splitlines(), 1) if "HANG-LINE plain" in text)
    output, run_id, nodes = _failed(provisioned, root / "plain.py")  # no STALL
    assert re.search(
        r"\[launcher\] no output for \d+ s and every rank idle for 30 s \(2 rank\(s\), \d+ "
        r"process\(es\), each at most [\d.]+ s of CPU and \d+ bytes read or written\): the job "
        r"hangs",
        output,
    ), output[-3000:]
    assert f"rank 1 on {nodes[1]}: not in a collective, at plain.py:{line} in <module>" in output
    assert f"rank 0 on {nodes[0]}: waits in all_reduce" in output, output[-3000:]
    assert f"FAILED on {nodes[1]}" in output, output[-3000:]
    _nothing_left(provisioned, run_id)
