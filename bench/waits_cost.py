"""17, second part. The cost of what the launcher starts in a user's own script for the straggler
watch: the measure of its waits in collectives (training.distributed.waits, started by our
sitecustomize once the script's init_process_group returns). Under gloo that is a pre- and a
post-hook on the default group and a callback on each collective's future; under NCCL the Flight
Recorder's timing of each collective on the GPU (TORCH_NCCL_ENABLE_TIMING=1, which the launcher
sets on nodes with GPUs, and so the bench sets in its runs with the measure on).

Two figures, each on and off side by side, the order alternating (measure.side_by_side):
- a DDP step: training.ddp's tiny CNN run as a user's script is (the sitecustomize's directory
  last on PYTHONPATH, as the launcher puts it) against the same without it; training.ddp's own
  per-step detector off in both (`--slow-rank-factor 0`: section 17's first part measures it);
- the worst case: 1-element all_reduces back to back in a plain script of torch.distributed
  calls only, microseconds per collective, in a world of one rank (with two on 2 cores each
  collective waits for both to be scheduled, and that spread 400 to 500 us from run to run,
  2026-12-01, hiding a cost of microseconds; alone, the rank's collectives complete at once and
  the hooks' cost is what differs). Both kinds: blocking ones (`dist.all_reduce(t)`, waited for
  in the hook) and asynchronous ones (`async_op=True`, as DDP's buckets: a callback on the
  work's future). The asynchronous cost times the collectives a DDP step issues (counted by
  the measure itself in the step's runs, every collective of the run over its steps:
  validation's and set-up's too, so an upper bound) over the step off is the second figure,
  steady where the paired step ratio is noise on 2 cores.

Each run with the measure on must leave its totals (jobenv.PACE_FILE) in the run directory and
each run off none: else the two settings differ in nothing, and the figures would measure noise.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

from torch_multinode.bench.flight import (
    PROCESS_GROUP,
    REPO_ROOT,
    WORKLOAD,
    WORKLOAD_COMMON,
    WORKLOAD_QUICK,
    per_collective_us,
    step_seconds,
    torchrun,
)
from torch_multinode.bench.measure import Progress, Series, bench_rows, ratio_series, side_by_side
from torch_multinode.cluster.jobenv import PACE_FILE
from torch_multinode.launch.staging import SITE_PATH

SITE = str(REPO_ROOT / SITE_PATH)
# What the launcher sets on nodes with GPUs for the measure (launch's job environment).
NCCL_TIMING = {"TORCH_NCCL_ENABLE_TIMING": "1"}
COLLECTIVES, ROUNDS = 2000, 5
COLLECTIVES_QUICK, ROUNDS_QUICK = 200, 2
KINDS = ("blocking", "async")  # waited for in the hook; a callback on the work's future

# A user's script in miniature: torch.distributed's own calls, nothing of ours.
COLLECTIVE_SCRIPT = (
    """\
import json
import os
import sys
import time

import torch
import torch.distributed as dist

count, rounds = int(sys.argv[1]), int(sys.argv[2])
"""
    + PROCESS_GROUP
    + """\
tensor = torch.zeros(1, device=device)
row = {"count": count}



def blocking():
    dist.all_reduce(tensor)


def asynchronous():
    dist.all_reduce(tensor, async_op=True).wait()


for kind, call in (("blocking", blocking), ("async", asynchronous)):
    for _ in range(200):
        call()
    row[kind] = timed(call)
if dist.get_rank() == 0:
    print("BENCH " + json.dumps(row), flush=True)
dist.destroy_process_group()
"""
)


def paces(run_root: Path) -> list[dict]:
    """The totals every rank of the runs under `run_root` left (jobenv.PACE_FILE's)."""
    files = sorted(run_root.rglob(PACE_FILE.format(rank="*")))
    return [json.loads(path.read_text()) for path in files]


def check_measured(setting: str, found: list[dict], what: str) -> None:
    """On: every run left its ranks' totals; off: none. Else the settings differ in nothing."""
    if (setting == "on") != bool(found):
        raise RuntimeError(
            f"{what} with the measure of waits {setting} left {len(found)} ranks' totals: "
            f"the sitecustomize in {SITE} did not {'start' if setting == 'on' else 'stay out'}"
        )


def measure_waits(
    reps: int, progress: Progress, gpu_count: int, nproc: int, quick: bool = False
) -> dict:
    """Per repetition, training.ddp's median seconds per step with the measure on and off, then
    the worst case's microseconds per collective on and off; their ratios, paired rep by rep,
    and the worst case's cost per collective times the collectives of a step, over the step."""
    count, rounds = (COLLECTIVES_QUICK, ROUNDS_QUICK) if quick else (COLLECTIVES, ROUNDS)
    workload = [
        "-m",
        "torch_multinode.training.ddp",
        *(WORKLOAD_QUICK if quick else WORKLOAD),
        *WORKLOAD_COMMON,
        "--slow-rank-factor",
        "0",
    ]
    steps_run = int(workload[workload.index("--steps") + 1])
    found: dict = {
        "workload": workload,
        "collectives": count,
        "rounds": rounds,
        "nccl_timing": bool(gpu_count),
    }
    per_step: list[float] = []  # collectives a step, as the measure counted them
    with tempfile.TemporaryDirectory(prefix="bench-waits-") as name:
        scratch = Path(name)
        script = scratch / "collectives.py"
        script.write_text(COLLECTIVE_SCRIPT)

        def run(
            target: list[str], setting: str, what: str, ranks: int = nproc
        ) -> tuple[str, list[dict]]:
            runs = Path(tempfile.mkdtemp(prefix=f"{setting}-", dir=scratch))
            on = setting == "on"
            output = torchrun(
                target,
                "on",  # the Flight Recorder, on in every job
                runs,
                f"{what} (measure of waits {setting})",
                ranks,
                python_path=(SITE,) if on else (),
                overrides=NCCL_TIMING if on and gpu_count else {},
            )
            totals = paces(runs)
            check_measured(setting, totals, what)
            return output, totals

        def steps(setting: str) -> float:
            output, totals = run(workload, setting, "training.ddp")
            intervals = step_seconds(output)
            if not intervals:
                raise RuntimeError(f"training.ddp (measure of waits {setting}): no step timed")
            if totals:
                per_step.append(max(total["collectives"] for total in totals) / steps_run)
            return statistics.median(intervals)

        def collectives(setting: str) -> dict[str, float]:
            target = [str(script), str(count), str(rounds)]
            output, _ = run(target, setting, "all_reduce", ranks=1)
            rows = bench_rows(output)
            if not rows:
                raise RuntimeError(f"all_reduce ({setting}): no BENCH line in:\n{output[-2000:]}")
            return {kind: per_collective_us(rows[0], kind) for kind in KINDS}

        on_steps, off_steps = side_by_side(
            reps,
            lambda: steps("on"),
            lambda: steps("off"),
            lambda rep, on, off: progress(
                f"waits: s per DDP step, rep {rep + 1}/{reps}: on {on:.4f} s, off {off:.4f} s, "
                f"on/off {on / off:.3f}"
            ),
        )
        on_us, off_us = side_by_side(
            reps,
            lambda: collectives("on"),
            lambda: collectives("off"),
            lambda rep, on, off: progress(
                f"waits: us per all_reduce of 1 element ({count} x {rounds}), rep {rep + 1}/"
                f"{reps}: "
                + ", ".join(f"{kind} on {on[kind]:.1f}, off {off[kind]:.1f}" for kind in KINDS)
            ),
        )
    found["step_seconds_on"] = Series(on_steps).as_dict()
    found["step_seconds_off"] = Series(off_steps).as_dict()
    found["step_ratio"] = ratio_series(on_steps, off_steps).as_dict()
    costs = {}
    for kind in KINDS:
        found[f"{kind}_us_on"] = Series([us[kind] for us in on_us]).as_dict()
        found[f"{kind}_us_off"] = Series([us[kind] for us in off_us]).as_dict()
        costs[kind] = [on[kind] - off[kind] for on, off in zip(on_us, off_us, strict=True)]
        found[f"{kind}_cost_us"] = Series(costs[kind]).as_dict()
    found["collectives_per_step"] = Series(per_step).as_dict()
    each = statistics.median(per_step)
    # (the step off + a step's asynchronous collectives' cost) / the step off, rep by rep
    found["work_ratio"] = Series(
        [1 + us * each / 1e6 / step for us, step in zip(costs["async"], off_steps, strict=True)]
    ).as_dict()
    return found
