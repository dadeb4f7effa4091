"""17. The straggler detector's cost: the time per training step of our DDP workload with the
slow-rank detector on (`--slow-rank-factor 1.5`, the default: each rank times its own work
every step, and every `--log-every` steps the ranks share it) over off (`0`: nothing timed,
nothing shared), against DETECTOR_TARGET. On this machine, no simulated cluster, as the flight
section: `torchrun --standalone`, two ranks on gloo over loopback (one per GPU on NCCL where
torch sees GPUs), the Flight Recorder on in both, as in every job.

On 2 cores a 30 ms step spreads by 10 to 20 % from run to run, far more than 1 %. So the section
also times the detector's own work alone (WORK_SCRIPT, in the same two ranks): a step's four
OwnTime calls (a clock and /proc/thread-self/schedstat read each), and the share of its two
numbers (parallel.share: one all_reduce), paid once every --log-every steps. That work per step
over the step with the detector off is the second figure, steady where the paired ratio is
noise.

The second part (bench/waits_cost.py) is the cost of the measure of a rank's waits in
collectives, which the launcher starts in a user's own script and our workloads start in theirs
(for a job the network holds; training.ddp only with its detector on). Our workload's figure is
the sum: its own work per step, and that measure's cost per asynchronous collective times the
step's collectives.

What it leaves out: the launcher's side (reading the ranks' lines, and probing a node only when
one is named: nothing while the ranks are even) costs the ranks nothing; the latency from a
slowdown to the launcher's line is section 19's (bench/latency.py), on the bench's cluster.
"""

from __future__ import annotations

import os
import statistics
import tempfile
from pathlib import Path

from torch_multinode.bench import waits_cost
from torch_multinode.bench.flight import (
    LOG_EVERY,
    WORKLOAD,
    WORKLOAD_COMMON,
    WORKLOAD_QUICK,
    describe_machine,
    gpus,
    ranks,
    step_seconds,
    torchrun,
)
from torch_multinode.bench.measure import (
    Progress,
    Series,
    bench_rows,
    ratio_series,
    side_by_side,
)

DETECTOR_TARGET = 1.01  # issue 55: at most 1 % of step time
SETTINGS = {"on": "1.5", "off": "0"}
CYCLES, ROUNDS = 20000, 5
CYCLES_QUICK, ROUNDS_QUICK = 2000, 2

# The detector's work alone, in two ranks as a job has them: rank 0 prints the fastest round's
# microseconds per step of OwnTime's calls (pause before forward, resume from the forward
# pre-hook, end_step before backward, resume after it) and per share of every rank's two
# numbers (the trainer's _check_pace; the nodes' names it gathers once).
WORK_SCRIPT = """\
import json
import sys
import time

from torch_multinode.training.distributed import parallel
from torch_multinode.training.loop.pace import OwnTime

cycles, rounds = int(sys.argv[1]), int(sys.argv[2])
env = parallel.read_env()
parallel.start(env)  # the workloads' own start: NCCL on the rank's GPU, else gloo
own = OwnTime()
own.resume()
timing, gathers = [], []
for _ in range(rounds):
    started = time.perf_counter()
    for _ in range(cycles):
        own.pause()
        own.resume()
        own.end_step()
        own.resume()
    timing.append((time.perf_counter() - started) / cycles)
    own.take()
    parallel.barrier(env)
    started = time.perf_counter()
    for _ in range(200):  # as the trainer's _check_pace
        parallel.share(list(own.take()), env)
    gathers.append((time.perf_counter() - started) / 200)
if env.is_main:
    row = {"own_time_us": min(timing) * 1e6, "gather_us": min(gathers) * 1e6}
    print("BENCH " + json.dumps(row), flush=True)
parallel.stop(synchronize=True)
"""


def measure_detector(reps: int, progress: Progress, quick: bool = False) -> dict:
    """Per repetition, training.ddp's median seconds per step with the detector on and off,
    one after the other (the order alternating), and their ratios, paired rep by rep; then, per
    repetition, the detector's own work per step alone, over the step with it off."""
    gpu_count = gpus()
    nproc = ranks(gpu_count)
    workload = [*(WORKLOAD_QUICK if quick else WORKLOAD), *WORKLOAD_COMMON]
    found: dict = {
        "machine": describe_machine(gpu_count),
        "nproc": nproc,
        "target": DETECTOR_TARGET,
        "workload": ["-m", "torch_multinode.training.ddp", *workload],
        "settings": dict(SETTINGS),
        "load_before": os.getloadavg()[0],
    }
    fastest: dict[str, list[float]] = {"on": [], "off": []}
    with tempfile.TemporaryDirectory(prefix="bench-detector-") as name:
        scratch = Path(name)

        def steps(setting: str) -> float:
            target = [*found["workload"], "--slow-rank-factor", SETTINGS[setting]]
            # The Flight Recorder on in both, as in every job: only the detector differs.
            output = torchrun(target, "on", scratch, f"training.ddp (detector {setting})", nproc)
            intervals = step_seconds(output)
            if not intervals:
                raise RuntimeError(f"training.ddp (detector {setting}): no step timed")
            fastest[setting].append(min(intervals))
            return statistics.median(intervals)

        def said(rep: int, on: float, off: float) -> None:
            progress(
                f"detector: s per DDP step, rep {rep + 1}/{reps}: on {on:.4f} s, off {off:.4f} s, "
                f"on/off {on / off:.3f}"
            )

        on_steps, off_steps = side_by_side(reps, lambda: steps("on"), lambda: steps("off"), said)
        script = scratch / "work.py"
        script.write_text(WORK_SCRIPT)
        cycles, rounds = (CYCLES_QUICK, ROUNDS_QUICK) if quick else (CYCLES, ROUNDS)
        work: list[dict] = []
        for rep in range(reps):
            target = [str(script), str(cycles), str(rounds)]
            rows = bench_rows(torchrun(target, "on", scratch, "the detector's work", nproc))
            if not rows:
                raise RuntimeError("the detector's work: no BENCH line from its rank 0")
            work.append(rows[0])
            progress(
                f"detector: its own work, rep {rep + 1}/{reps}: {rows[0]['own_time_us']:.1f} us "
                f"of timing a step, {rows[0]['gather_us']:.0f} us a gather"
            )
    found["step_seconds_on"] = Series(on_steps).as_dict()
    found["step_seconds_off"] = Series(off_steps).as_dict()
    found["step_ratio"] = ratio_series(on_steps, off_steps).as_dict()
    found["fastest_step_ratio"] = ratio_series(fastest["on"], fastest["off"]).as_dict()
    found["log_every"] = LOG_EVERY
    found["own_time_us"] = Series([row["own_time_us"] for row in work]).as_dict()
    found["gather_us"] = Series([row["gather_us"] for row in work]).as_dict()
    per_step = [row["own_time_us"] + row["gather_us"] / LOG_EVERY for row in work]
    found["work_us_per_step"] = Series(per_step).as_dict()
    # (the off step + the work) / the off step, paired with the same rep's off run
    found["work_ratio"] = Series(
        [1 + us / 1e6 / off for us, off in zip(per_step, off_steps, strict=True)]
    ).as_dict()
    progress("detector: the measure of waits a user's script gets, on and off...")
    waits = waits_cost.measure_waits(reps, progress, gpu_count, nproc, quick=quick)
    found["waits"] = {**waits, "target": DETECTOR_TARGET}
    # Our workload's whole detector, on by default: its own work as above, and the measure of
    # its waits in collectives (for a slow link) that it starts with it, whose cost is the
    # second part's per asynchronous collective times the same DDP step's collectives.
    waits_us = max(waits["async_cost_us"]["median"], 0.0) * waits["collectives_per_step"]["median"]
    found["waits_us_per_step"] = waits_us
    found["total_work_ratio"] = Series(
        [1 + (us + waits_us) / 1e6 / off for us, off in zip(per_step, off_steps, strict=True)]
    ).as_dict()
    found["load_after"] = os.getloadavg()[0]
    return found
