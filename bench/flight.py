"""13. The Flight Recorder's cost: the time per training step of our DDP workload with torch's
Flight Recorder on (TORCH_FR_BUFFER_SIZE=256, what the launcher sets for every job) over off
(=0), against the target FLIGHT_TARGET; and its worst case, 1-element all_reduces back to back,
in microseconds per collective. Both on this machine: `torchrun --standalone
--nproc-per-node=2`, gloo over loopback, no simulated cluster.

Each repetition runs the two settings one after the other, the order alternating from one
repetition to the next (measure.side_by_side), so that the machine's load hits both alike.
"""

from __future__ import annotations

import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from torch_multinode.bench.measure import (
    REPO_ROOT,
    Progress,
    Series,
    bench_rows,
    ratio_series,
    side_by_side,
)
from torch_multinode.cluster.jobenv import (
    FLIGHT_BUFFER_DEFAULT,
    FLIGHT_BUFFER_VARIABLE,
    RUN_DIR_VARIABLE,
)

FLIGHT_TARGET = 1.02  # issue 30: under 2 % of step time
SETTINGS = {"on": FLIGHT_BUFFER_DEFAULT, "off": "0"}
# training.ddp as a job runs it, on the small CNN: a step line every LOG_EVERY steps gives the
# samples/s/rank of the steps since the previous one; the first interval (warm-up) is left out.
LOG_EVERY = 10
WORKLOAD = ["--model", "tiny", "--steps", "200", "--log-every", str(LOG_EVERY)]
WORKLOAD_QUICK = ["--model", "tiny", "--steps", "30", "--log-every", str(LOG_EVERY)]
# Batches loaded in the rank's own process (no loader workers on 2 cores), a short validation.
WORKLOAD_COMMON = ["--workers", "0", "--val-samples", "64"]
COLLECTIVES, ROUNDS = 2000, 5
COLLECTIVES_QUICK, ROUNDS_QUICK = 200, 2
TIMEOUT = 600

BATCH_LINE = re.compile(r"^batch\s+(\d+) per rank\b", re.MULTILINE)
STEP_LINE = re.compile(r"\bstep\s+(\d+)/(\d+)\s.*?\s([\d,]+) samples/s/rank\b")

# Worst case: `count` all_reduces of one element, `rounds` times, after a warm-up; rank 0
# prints each round's seconds and how many entries the Flight Recorder holds (0 when off).
COLLECTIVE_SCRIPT = """\
import json
import sys
import time

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

from torch_multinode.training.distributed import flight

count, rounds = int(sys.argv[1]), int(sys.argv[2])
dist.init_process_group("gloo")
flight.start()  # the trace's watcher, as in every workload of ours (on only)
tensor = torch.zeros(1)
for _ in range(200):
    dist.all_reduce(tensor)
seconds = []
for _ in range(rounds):
    dist.barrier()
    started = time.perf_counter()
    for _ in range(count):
        dist.all_reduce(tensor)
    seconds.append(time.perf_counter() - started)
recorded = len(json.loads(c10d._dump_fr_trace_json(True, True)).get("entries", []))
if dist.get_rank() == 0:
    row = {"seconds": seconds, "count": count, "recorded": recorded}
    print("BENCH " + json.dumps(row), flush=True)
dist.destroy_process_group()
"""


def step_seconds(output: str) -> list[float]:
    """Seconds per step of each interval between two step lines of training.ddp (rank 0's
    samples/s/rank over the steps since the previous line), the first interval left out: it
    holds the first steps' warm-up."""
    found = BATCH_LINE.search(output)
    if found is None:
        raise ValueError("no 'batch N per rank' line in the workload's output")
    batch = int(found.group(1))
    rates = [int(rate.replace(",", "")) for _, _, rate in STEP_LINE.findall(output)]
    return [batch / rate for rate in rates[1:] if rate > 0]


def per_collective_us(row: dict) -> float:
    """Microseconds per collective of the worst case's fastest round: on a busy machine each
    collective waits for both ranks to be scheduled, and other load only ever adds to that."""
    return min(row["seconds"]) / row["count"] * 1e6


def check_recorded(setting: str, recorded: int) -> None:
    """The Flight Recorder held entries when on and none when off: else the two runs differ
    in nothing and the figure would measure noise."""
    if (setting == "on") != (recorded > 0):
        raise RuntimeError(
            f"Flight Recorder {setting} ({FLIGHT_BUFFER_VARIABLE}={SETTINGS[setting]}) but "
            f"{recorded} entries recorded: this torch does not read the variable"
        )


def verdict(ratio: float, target: float = FLIGHT_TARGET) -> str:
    """The step-time ratio against the target, in words."""
    cost = (ratio - 1) * 100
    said = f"{cost:+.1f} % of step time"
    if ratio <= target:
        return f"{said}: meets the target (under {(target - 1) * 100:.0f} %)"
    return f"{said}: MISSES the target (under {(target - 1) * 100:.0f} %)"


def too_noisy(ratio: dict, target: float = FLIGHT_TARGET) -> bool:
    """The repetitions' ratios fall on both sides of 1 and spread wider than twice the target's
    margin: the machine's load, not the Flight Recorder, decides the median."""
    return ratio["min"] < 1 < ratio["max"] and ratio["max"] - ratio["min"] > 2 * (target - 1)


def environment(setting: str, run_dir: Path) -> dict[str, str]:
    """A job's environment as the launcher gives it, but for the Flight Recorder's setting:
    the run directory (the trace's watcher runs when on), this checkout's code first."""
    environ = dict(os.environ)
    environ[FLIGHT_BUFFER_VARIABLE] = SETTINGS[setting]
    environ[RUN_DIR_VARIABLE] = str(run_dir)
    environ["PYTHONPATH"] = os.pathsep.join(
        [str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    return environ


def torchrun(target: list[str], setting: str, scratch: Path, what: str) -> str:
    """`torchrun --standalone --nproc-per-node=2 <target>` (loopback only), its output."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"run-{setting}-", dir=scratch))
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        *target,
    ]
    proc = subprocess.run(
        command,
        cwd=run_dir,
        env=environment(setting, run_dir),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    if proc.returncode != 0:
        lines = (proc.stdout + proc.stderr).strip().splitlines()
        # the ranks' own tracebacks, before torchrun's summary of who failed
        tail = ([line for line in lines if line.startswith("[rank")] or lines)[-15:]
        raise RuntimeError(
            f"{what} ({setting}) failed (exit {proc.returncode}):\n  " + "\n  ".join(tail)
        )
    return proc.stdout


def _machine() -> str:
    return (
        f"{os.cpu_count()} cores ({platform.machine()}), CPU only, gloo over loopback, "
        f"Python {platform.python_version()}"
    )


def measure_flight(reps: int, progress: Progress, quick: bool = False) -> dict:
    """Per repetition, the DDP workload's median seconds per step on and off, then the worst
    case's microseconds per collective on and off; their ratios, paired rep by rep."""
    workload = [*(WORKLOAD_QUICK if quick else WORKLOAD), *WORKLOAD_COMMON]
    count, rounds = (COLLECTIVES_QUICK, ROUNDS_QUICK) if quick else (COLLECTIVES, ROUNDS)
    found: dict = {
        "machine": _machine(),
        "buffer": FLIGHT_BUFFER_DEFAULT,
        "target": FLIGHT_TARGET,
        "workload": ["-m", "torch_multinode.training.ddp", *workload],
        "collectives": count,
        "rounds": rounds,
        "load_before": os.getloadavg()[0],
    }
    fastest: dict[str, list[float]] = {"on": [], "off": []}  # each run's fastest interval
    with tempfile.TemporaryDirectory(prefix="bench-flight-") as name:
        scratch = Path(name)

        def steps(setting: str) -> float:
            output = torchrun(found["workload"], setting, scratch, "training.ddp")
            intervals = step_seconds(output)
            if not intervals:
                raise RuntimeError(f"training.ddp ({setting}): no step lines after the first")
            fastest[setting].append(min(intervals))
            return statistics.median(intervals)

        def collectives(setting: str) -> float:
            script = scratch / "collectives.py"
            script.write_text(COLLECTIVE_SCRIPT)
            output = torchrun(
                [str(script), str(count), str(rounds)], setting, scratch, "all_reduce"
            )
            rows = bench_rows(output)
            if not rows:
                raise RuntimeError(f"all_reduce ({setting}): no BENCH line in:\n{output[-2000:]}")
            check_recorded(setting, rows[0]["recorded"])
            return per_collective_us(rows[0])

        def said(unit: str, fmt: str):
            def say(rep: int, on: float, off: float) -> None:
                progress(
                    f"flight: {unit}, rep {rep + 1}/{reps}: on {fmt.format(on)}, off "
                    f"{fmt.format(off)}, on/off {on / off:.3f}"
                )

            return say

        on_steps, off_steps = side_by_side(
            reps,
            lambda: steps("on"),
            lambda: steps("off"),
            said("s per DDP step", "{:.4f} s"),
        )
        on_us, off_us = side_by_side(
            reps,
            lambda: collectives("on"),
            lambda: collectives("off"),
            said(f"us per all_reduce of 1 element ({count} x {rounds})", "{:.1f} us"),
        )
    found["load_after"] = os.getloadavg()[0]
    found["step_seconds_on"] = Series(on_steps).as_dict()
    found["step_seconds_off"] = Series(off_steps).as_dict()
    found["step_ratio"] = ratio_series(on_steps, off_steps).as_dict()
    # Load only ever adds time: the fastest interval of each run is the least disturbed.
    found["fastest_step_ratio"] = ratio_series(fastest["on"], fastest["off"]).as_dict()
    found["collective_us_on"] = Series(on_us).as_dict()
    found["collective_us_off"] = Series(off_us).as_dict()
    found["collective_ratio"] = ratio_series(on_us, off_us).as_dict()
    cost = [on - off for on, off in zip(on_us, off_us, strict=True)]
    found["collective_cost_us"] = Series(cost).as_dict()
    return found
