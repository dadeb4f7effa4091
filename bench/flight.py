"""13. The Flight Recorder's cost: the time per training step of our DDP workload with torch's
Flight Recorder on (TORCH_FR_BUFFER_SIZE=256, what the launcher sets for every job) over off
(=0), against the target FLIGHT_TARGET; and its worst case, 1-element all_reduces back to back,
in microseconds per collective. Both on this machine, no simulated cluster: `torchrun
--standalone`, one rank per GPU on NCCL where torch sees GPUs (one GPU: a world of one, whose
collectives NCCL still runs and the recorder still records), else two ranks on gloo over
loopback.

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
from collections.abc import Mapping, Sequence
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
# On GPUs the tiny CNN's step is a few milliseconds of kernel launches, and training.ddp's
# ResNet-50 step is set by its loader's CPU work: each spread 10 to 55 % from run to run on an
# H200, hiding any 2 % effect. There the step is DDP's ResNet-50 in bf16 on one batch kept on
# the GPU (STEP_SCRIPT), with no CPU work of its own, at 224 px: at 128 px its runs still spread
# up to 20 % (most likely the CPU's dispatch of its kernels setting part of so short a step); at
# 224 px the runs of one setting lay within 0.5 % on an H200 (docs/benchmarks.md).
# cudnn.benchmark is off, so that every process takes the same convolution algorithms.
GPU_STEPS, GPU_BLOCK = 150, 10
GPU_TIMING = (
    f"ResNet-50 under DDP, bf16, a batch of 256 at 224 px kept on the GPU, {GPU_STEPS} steps "
    f"after {GPU_BLOCK} of warm-up; seconds per step: the median of its {GPU_BLOCK}-step blocks"
)
DDP_TIMING = (
    "seconds per step: the median of the step lines' intervals (the first, warm-up, left out)"
)
COLLECTIVES, ROUNDS = 2000, 5
COLLECTIVES_QUICK, ROUNDS_QUICK = 200, 2
TIMEOUT = 600

BATCH_LINE = re.compile(r"^batch\s+(\d+) per rank\b", re.MULTILINE)
STEP_LINE = re.compile(r"\bstep\s+(\d+)/(\d+)\s.*?\s([\d,]+) samples/s/rank\b")

# A DDP step on the GPU, its batch already there: `steps` steps after `block` of warm-up, timed
# in blocks of `block` (the GPU synchronised at each end); rank 0 prints each block's seconds
# per step and how many entries the Flight Recorder holds.
STEP_SCRIPT = """\
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torchvision.models import resnet50

from torch_multinode.training.distributed import flight

steps, block = int(sys.argv[1]), int(sys.argv[2])
device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
torch.cuda.set_device(device)
dist.init_process_group("nccl", device_id=device)
flight.start()
torch.manual_seed(0)
torch.backends.cudnn.benchmark = False
net = resnet50(num_classes=10).to(device, memory_format=torch.channels_last)
model = DistributedDataParallel(net, device_ids=[device.index])
optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
images = torch.randn(256, 3, 224, 224, device=device).to(memory_format=torch.channels_last)
labels = torch.randint(10, (256,), device=device)


def step():
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(images), labels)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()


for _ in range(block):
    step()
seconds = []
for _ in range(steps // block):
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(block):
        step()
    torch.cuda.synchronize()
    seconds.append((time.perf_counter() - started) / block)
recorded = len(json.loads(flight.trace_json()).get("entries", []))
if dist.get_rank() == 0:
    print("BENCH " + json.dumps({"seconds": seconds, "recorded": recorded}), flush=True)
dist.destroy_process_group()
"""

# A collective script's start (after `count, rounds = ...`): the process group on this rank's
# GPU under NCCL, else gloo; `timed(call)`: the seconds of `rounds` rounds of `count` calls,
# each round begun together and ended once the GPU has run its kernels.
PROCESS_GROUP = """\
if torch.cuda.is_available():
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    settle = torch.cuda.synchronize
else:
    device = torch.device("cpu")
    dist.init_process_group("gloo")
    settle = lambda: None  # noqa: E731


def timed(call):
    seconds = []
    for _ in range(rounds):
        dist.barrier()
        settle()
        started = time.perf_counter()
        for _ in range(count):
            call()
        settle()
        seconds.append(time.perf_counter() - started)
    return seconds


"""

# Worst case: `count` all_reduces of one element, `rounds` times, after a warm-up; rank 0
# prints each round's seconds and how many entries the Flight Recorder holds (0 when off).
COLLECTIVE_SCRIPT = (
    """\
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from torch_multinode.training.distributed import flight

count, rounds = int(sys.argv[1]), int(sys.argv[2])
"""
    + PROCESS_GROUP
    + """\
flight.start()  # the trace's watcher, as in every workload of ours (on only)
tensor = torch.zeros(1, device=device)
for _ in range(200):
    dist.all_reduce(tensor)
seconds = timed(lambda: dist.all_reduce(tensor))
recorded = len(json.loads(flight.trace_json()).get("entries", []))
if dist.get_rank() == 0:
    row = {"seconds": seconds, "count": count, "recorded": recorded}
    print("BENCH " + json.dumps(row), flush=True)
dist.destroy_process_group()
"""
)


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


def per_collective_us(row: dict, rounds: str = "seconds") -> float:
    """Microseconds per collective of the worst case's fastest round (the row's `rounds`: each
    round's seconds for its `count` collectives): on a busy machine each collective waits for
    both ranks to be scheduled, and other load only ever adds to that."""
    return min(row[rounds]) / row["count"] * 1e6


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


def noise(section: dict, thing: str = "the recorder") -> str | None:
    """Why the step-time ratio of a flight section cannot be judged, or None where it can:
    - the repetitions' ratios fall on both sides of 1, widely (too_noisy);
    - or two runs of the same setting differ by more than twice the target's margin and more
      than on differs from off: the effect is inside the runs' own spread. On a GPU a tiny
      model's step is a few ms of kernel launches, and its median moved by half from one run
      to the next (an H200, 2026-11-27) while every rep had on slower than off.
    """
    ratio, target = section["step_ratio"], section["target"]
    if too_noisy(ratio, target):
        return (
            f"the repetitions range from {ratio['min']:.3f} to {ratio['max']:.3f}, on both "
            "sides of 1 and wider than twice the target's margin"
        )
    effect = abs(ratio["median"] - 1)
    for setting in SETTINGS:
        runs = section.get(f"step_seconds_{setting}")
        if (
            runs
            and runs["min"] > 0
            and runs["max"] / runs["min"] - 1 > max(2 * (target - 1), effect)
        ):
            return (
                f"the runs with {thing} {setting} alone range from {runs['min']:.4f} to "
                f"{runs['max']:.4f} s per step ({(runs['max'] / runs['min'] - 1) * 100:.0f} %), "
                f"wider than the {effect * 100:.1f} % between on and off"
            )
    return None


def environment(
    setting: str,
    run_dir: Path,
    python_path: Sequence[str] = (),
    overrides: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """A job's environment as the launcher gives it, but for the Flight Recorder's setting:
    the run directory (the trace's watcher runs when on), this checkout's code first and
    `python_path` last, then `overrides`."""
    environ = dict(os.environ)
    environ[FLIGHT_BUFFER_VARIABLE] = SETTINGS[setting]
    environ[RUN_DIR_VARIABLE] = str(run_dir)
    environ["PYTHONPATH"] = os.pathsep.join(
        [str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")]), *python_path]
    )
    environ.update(overrides or {})
    return environ


def gpus() -> int:
    """The GPUs torch sees here (0 without CUDA): the bench runs one rank on each."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def ranks(gpu_count: int) -> int:
    """Processes per run: one per GPU, else two on the CPU (a collective between two)."""
    return gpu_count or 2


def torchrun(
    target: list[str],
    setting: str,
    scratch: Path,
    what: str,
    nproc: int,
    python_path: Sequence[str] = (),
    overrides: Mapping[str, str] | None = None,
) -> str:
    """`torchrun --standalone --nproc-per-node=<nproc> <target>` (loopback only), its output;
    its run directory in `scratch` (environment's other arguments: `python_path`, `overrides`)."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"run-{setting}-", dir=scratch))
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        *target,
    ]
    proc = subprocess.run(
        command,
        cwd=run_dir,
        env=environment(setting, run_dir, python_path, overrides),
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


def on_gpu_step(gpu_count: int, quick: bool) -> bool:
    """Whether the step measured is STEP_SCRIPT's (GPUs, unless quick) or training.ddp's."""
    return bool(gpu_count) and not quick


def describe_machine(gpu_count: int) -> str:
    if gpu_count:
        import torch

        return (
            f"{gpu_count} x {torch.cuda.get_device_name(0)}, NCCL "
            f"{'.'.join(map(str, torch.cuda.nccl.version()))}, torch {torch.__version__}, "
            f"{os.cpu_count()} cores, Python {platform.python_version()}"
        )
    return (
        f"{os.cpu_count()} cores ({platform.machine()}), CPU only, gloo over loopback, "
        f"Python {platform.python_version()}"
    )


def measure_flight(reps: int, progress: Progress, quick: bool = False) -> dict:
    """Per repetition, the DDP workload's median seconds per step on and off, then the worst
    case's microseconds per collective on and off; their ratios, paired rep by rep."""
    count, rounds = (COLLECTIVES_QUICK, ROUNDS_QUICK) if quick else (COLLECTIVES, ROUNDS)
    gpu_count = gpus()
    gpu_step = on_gpu_step(gpu_count, quick)
    nproc = ranks(gpu_count)
    workload = [*(WORKLOAD_QUICK if quick else WORKLOAD), *WORKLOAD_COMMON]
    found: dict = {
        "machine": describe_machine(gpu_count),
        "nproc": nproc,
        "buffer": FLIGHT_BUFFER_DEFAULT,
        "target": FLIGHT_TARGET,
        "workload": (
            ["step.py", str(GPU_STEPS), str(GPU_BLOCK)]
            if gpu_step
            else ["-m", "torch_multinode.training.ddp", *workload]
        ),
        "timing": GPU_TIMING if gpu_step else DDP_TIMING,
        "collectives": count,
        "rounds": rounds,
        "load_before": os.getloadavg()[0],
    }
    fastest: dict[str, list[float]] = {"on": [], "off": []}  # each run's fastest interval
    with tempfile.TemporaryDirectory(prefix="bench-flight-") as name:
        scratch = Path(name)
        step_script, collective_script = scratch / "step.py", scratch / "collectives.py"
        step_script.write_text(STEP_SCRIPT)
        collective_script.write_text(COLLECTIVE_SCRIPT)

        def row(target: list[str], setting: str, what: str) -> dict:
            """The BENCH row a script's rank 0 printed, its Flight Recorder as `setting` says."""
            output = torchrun(target, setting, scratch, what, nproc)
            rows = bench_rows(output)
            if not rows:
                raise RuntimeError(f"{what} ({setting}): no BENCH line in:\n{output[-2000:]}")
            check_recorded(setting, rows[0]["recorded"])
            return rows[0]

        def steps(setting: str) -> float:
            if gpu_step:
                target = [str(step_script), *found["workload"][1:]]
                intervals = row(target, setting, "the DDP step")["seconds"]
            else:
                output = torchrun(found["workload"], setting, scratch, "training.ddp", nproc)
                intervals = step_seconds(output)
            if not intervals:
                raise RuntimeError(f"the DDP step ({setting}): no step timed after the warm-up")
            fastest[setting].append(min(intervals))
            return statistics.median(intervals)

        def collectives(setting: str) -> float:
            target = [str(collective_script), str(count), str(rounds)]
            return per_collective_us(row(target, setting, "all_reduce"))

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
