"""15. A node lost for good (issue 31): the time from a node's death to the first step of the job
on its new world, with RESTARTS=1 MIN_NODES=2 on 3 nodes, the jobs in the training image
(launch_mode: container, provisioned by `make provision`), against the budget of
the grace (--restart-wait) + 60 s. On the bench's 4-node cluster the fourth node is a spare,
which takes the dead node's place; on 3 nodes the job goes on on 2. Which happened is said.

Timed from the `docker kill` of node3 (the launcher's output read meanwhile, each line timed as
it arrives) to the first step line of the restarted run: the failure seen and the job stopped,
the grace waited, the nodes chosen, the job started again, the checkpoint loaded, one step.

And what the replicas of training.fsdp's checkpoints cost (measure_replication): the same job
on 3 nodes with node-local checkpoints, with replicas and with --no-replicate, side by side in
each rep (the order alternating); the extra seconds per checkpoint, and the step time that
makes at one checkpoint a minute, against 5 %."""

from __future__ import annotations

import re
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from torch_multinode.bench.measure import REPO_ROOT, Progress, Series
from torch_multinode.bench.timed import TimedOutput
from torch_multinode.sim import nodes as sim

NODELOSS_NODES = 3
NODELOSS_GRACE = 10  # --restart-wait, seconds
NODELOSS_BUDGET = NODELOSS_GRACE + 60
KILL_AFTER = re.compile(r"^\[node1\] step +12/")  # step 10's checkpoint is on every node
STEP_12_LIMIT = 1800.0  # seconds to step 12: the job's start (nodes checked, image there) too
STEP_LINE = re.compile(r"\bstep +\d+/\d+\b")
JOB = [
    "--model",
    "tiny",
    "--image-size",
    "16",
    "--train-samples",
    "256",
    "--val-samples",
    "128",
    "--global-batch-size",
    "48",
    "--workers",
    "0",
    "--no-tensorboard",
    "--log-every",
    "1",
    "--steps",
    "30",
    "--checkpoint-every",
    "5",
    "--step-delay",
    "0.3",
]


# training.fsdp's GPT at about 13 M parameters: 150 MB a checkpoint with AdamW's moments, a
# third of it per node, which is what each node copies to the next.
REPLICATION_JOB = (
    "--layers 4 --width 512 --heads 8 --seq-len 32 --global-batch-size 6 --lr 0.001 "
    "--log-every 1 --steps 40 --checkpoint-every 10"
).split()
REPLICATION_FROM = 10  # timed from this step's line (the first checkpoint's step) to the last
REPLICATION_PERIOD = 60.0  # seconds: the checkpoint frequency the target is stated at
REPLICATION_BUDGET = 1.05
WRITTEN = re.compile(r"\bcheckpoint step (\d+) written\b")
STEP_NUMBER = re.compile(r"\bstep +(\d+)/(\d+)\b")


def timed_window(lines: list[tuple[float, str]], first: int) -> tuple[float, int]:
    """From a job's lines timed as they came: the seconds from step `first`'s line to the last
    step's, and how many checkpoints were written between the two."""
    start = end = None
    written = 0
    for at, line in lines:
        found = STEP_NUMBER.search(line)
        if found and "loss" in line:
            step, steps = int(found[1]), int(found[2])
            if step == first:
                start = at
            if step == steps:
                end = at
        saved = WRITTEN.search(line)
        if saved and start is not None and end is None and int(saved[1]) >= first:
            written += 1
    if start is None or end is None:
        raise RuntimeError(f"replication: no step line for step {first} or the last one")
    return end - start, written


def per_checkpoint(on: float, off: float, written: int) -> tuple[float, float]:
    """Seconds a checkpoint's copy adds, and the step time with one checkpoint a minute over
    the same without copies (1 + that / REPLICATION_PERIOD)."""
    extra = (on - off) / max(written, 1)
    return extra, 1 + extra / REPLICATION_PERIOD


def _one_job(train: Path, inventory: Path, replicas: bool) -> list[tuple[float, str]]:
    # Under checkpoint_root, on each node's own disk (mounted into the job's container).
    directory = f"bench-replicas-{uuid.uuid4().hex[:8]}"
    return timed_job(
        [str(train), "-i", str(inventory), "--nnodes", str(NODELOSS_NODES)]
        + ["--module", "training.fsdp", "--", *REPLICATION_JOB, "--checkpoint-dir", directory]
        + ([] if replicas else ["--no-replicate"]),
        "replication",
    )


def timed_job(command: list[str], section: str) -> list[tuple[float, str]]:
    """`command` (a launcher's) run to its end: its lines, each timed from the start. A job
    that fails is a RuntimeError naming `section`."""
    proc = subprocess.Popen(
        command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    started = time.monotonic()
    assert proc.stdout is not None  # stdout=PIPE
    lines = [(time.monotonic() - started, line) for line in proc.stdout]
    proc.wait()
    if proc.returncode != 0:
        tail = "".join(line for _, line in lines[-20:])
        raise RuntimeError(f"{section}: the job failed (exit {proc.returncode}):\n{tail}")
    return lines


def measure_replication(inventory: Path, reps: int, progress: Progress, train: Path) -> dict:
    """`reps` pairs of the same FSDP job on 3 nodes, with replicas and without (the order
    alternating): the timed window's seconds each way, the extra seconds per checkpoint and
    the step time at one checkpoint a minute, with copies / without."""
    on, off, extra, ratio = [], [], [], []
    for rep in range(reps):
        took: dict[bool, tuple[float, int]] = {}
        for replicas in (True, False) if rep % 2 == 0 else (False, True):
            took[replicas] = timed_window(_one_job(train, inventory, replicas), REPLICATION_FROM)
        written = took[True][1]
        added, per_minute = per_checkpoint(took[True][0], took[False][0], written)
        on.append(took[True][0])
        off.append(took[False][0])
        extra.append(added)
        ratio.append(per_minute)
        progress(
            f"replication: rep {rep + 1}/{reps}: steps {REPLICATION_FROM} to the last "
            f"{took[True][0]:.1f} s with replicas, {took[False][0]:.1f} s without; "
            f"{added:+.2f} s per checkpoint ({written} in the window)"
        )
    return {
        "nodes": NODELOSS_NODES,
        "job": " ".join(REPLICATION_JOB),
        "period": REPLICATION_PERIOD,
        "budget": REPLICATION_BUDGET,
        "with_seconds": Series(on).as_dict(),
        "without_seconds": Series(off).as_dict(),
        "extra_per_checkpoint": Series(extra).as_dict(),
        "ratio": Series(ratio).as_dict(),
    }


def death_to_first_step(lines: list[tuple[float, str]]) -> tuple[float | None, str | None]:
    """From lines timed since the kill: the seconds to the first step line after the restarted
    run's first line (`job ID-r1: ...`), and what became of the lost node (the launcher's line)."""
    restarted, became = False, None
    for at, line in lines:
        if "[launcher] node3 lost at restart 1" in line:
            became = line.split("] ", 1)[1].strip()
        if re.search(r"\[launcher\] job \S+-r1: ", line):
            restarted = True
        elif restarted and STEP_LINE.search(line):
            return at, became
    return None, became


def death_to_stop(lines: list[tuple[float, str]]) -> float | None:
    """From lines timed since the kill: the seconds to the failed run's summary (`Job ID
    FAILED ...`), which the launcher says once the job is stopped on every node and its ports
    freed (what the tests assert happened; how long it took is measured here)."""
    return next((at for at, line in lines if re.match(r"Job \S+ FAILED ", line)), None)


def _one_loss(train: Path, inventory: Path, config: sim.SimConfig) -> list[tuple[float, str]]:
    """One job on NODELOSS_NODES nodes, node3 killed after step 12: its lines timed from the kill."""
    directory = f"bench-checkpoints-{uuid.uuid4().hex[:8]}"  # under checkpoint_root
    return killed_after_step_12(
        [str(train), "-i", str(inventory), "--nnodes", str(NODELOSS_NODES), "--restarts", "1"]
        + ["--restart-wait", str(NODELOSS_GRACE), "--min-nodes", str(NODELOSS_NODES - 1), "--"]
        + [*JOB, "--checkpoint-dir", directory],
        config,
    )[0]


def killed_after_step_12(
    command: list[str], config: sim.SimConfig, then: Callable[[], None] | None = None
) -> tuple[list[tuple[float, str]], float]:
    """`command` (a launcher's) run, node3 killed after node1's step-12 line and `then` called
    (node3 started again, say): the job's lines from then on timed from the kill, and the
    seconds from the kill to `then`'s return. A job that fails is a RuntimeError."""
    proc = subprocess.Popen(
        command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    output = TimedOutput(proc, time.monotonic())
    try:
        if output.matching(KILL_AFTER, timeout=STEP_12_LIMIT) is None:
            raise RuntimeError("the job ended before step 12:\n" + output.text[-3000:])
        killed = output.now()
        sim.docker("kill", config.container(3))
        if then is not None:
            then()
        returned = output.now() - killed
        proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
    output.reader.join(timeout=30)
    # The lines after step 12's, timed from the kill (any between the two at its moment).
    cut = next(i for i, (_, line) in enumerate(output.lines) if KILL_AFTER.search(line))
    lines = [(max(0.0, at - killed), line) for at, line in output.lines[cut + 1 :]]
    if proc.returncode != 0:
        tail = "".join(line for _, line in lines[-20:])
        raise RuntimeError(f"the job failed (exit {proc.returncode}):\n{tail}")
    return lines, returned


def _node3_back(nnodes: int, link: str | None, config: sim.SimConfig) -> None:
    """node3 started again, its Docker engine answering: the next job runs in containers."""
    sim.up(nnodes, link, config)
    sim.wait_for_engine(config, 3)


def measure_node_loss(
    inventory: Path,
    config: sim.SimConfig,
    nnodes: int,
    link: str | None,
    reps: int,
    progress: Progress,
    train: Path,
) -> dict:
    """`reps` times: a job on the cluster's first 3 nodes, node3 killed after step 12 and left
    dead until the job ends; the seconds from the kill to the first step on the new world, and
    their ratio to NODELOSS_BUDGET. Every node is up again afterwards."""
    seconds, stopped, outcomes = [], [], []
    try:
        for rep in range(reps):
            lines = _one_loss(train, inventory, config)
            took, became = death_to_first_step(lines)
            stop = death_to_stop(lines)
            _node3_back(nnodes, link, config)
            if took is None or stop is None:
                raise RuntimeError("nodeloss: no failed run's summary, or no step after it")
            seconds.append(took)
            stopped.append(stop)
            outcomes.append(became or "")
            progress(
                f"nodeloss: rep {rep + 1}/{reps}: the job stopped everywhere {stop:.1f} s and "
                f"the first step on the new world {took:.1f} s after node3's death "
                f"(--restart-wait {NODELOSS_GRACE}); {became}"
            )
    finally:
        _node3_back(nnodes, link, config)
    return {
        "nodes": NODELOSS_NODES,
        "cluster_nodes": nnodes,
        "grace": NODELOSS_GRACE,
        "budget": NODELOSS_BUDGET,
        "became": outcomes,
        "seconds": Series(seconds).as_dict(),
        "stopped": Series(stopped).as_dict(),
        "ratio": Series([s / NODELOSS_BUDGET for s in seconds]).as_dict(),
    }
