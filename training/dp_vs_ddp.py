"""DataParallel against DistributedDataParallel on one node: time per step and peak memory per GPU.

    python -m training.dp_vs_ddp                  # not under torchrun: it starts its own processes

DataParallel is one process driving every GPU: each step it scatters the batch from GPU 0,
copies the model to every GPU, and gathers outputs back on GPU 0, which therefore holds more
memory and the GIL serialises the work. DDP runs one process per GPU (started here on
127.0.0.1) and only all-reduces gradients. Both train the same model on the same global batch.

Exit codes: 0 done, 2 bad input, 69 (EX_UNAVAILABLE) fewer than two GPUs on this machine.
--cpu N runs the same code on N CPU processes with gloo instead, to check the code path on a
machine without GPUs: its timings mean little and it measures no memory. Its defaults are CPU
sized (tiny, 32 px, batch 8, 10 classes, 10 timed steps after 2): `--cpu 2` takes about
30 s on a 2-core machine, where the GPU defaults (ResNet-50 at 224 px) would take many
minutes. Every phase says when it starts, and a progress line comes at least every 5 s.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from torch_multinode.cluster.errors import UserError
from torch_multinode.training.distributed import parallel
from torch_multinode.training.modeling.models import build_model
from torch_multinode.training.settings import console
from torch_multinode.training.settings.config import MODELS

EXIT_NEEDS_GPUS = 69
PROGRESS_SECONDS = 5.0  # at most this long between progress lines while training
# model, batch per process, image size, classes: on GPUs, and the check of the code on CPUs
GPU_DEFAULTS = {"model": "resnet50", "batch_size": 32, "image_size": 224, "num_classes": 1000}
CPU_DEFAULTS = {"model": "tiny", "batch_size": 8, "image_size": 32, "num_classes": 10}
GPU_STEPS, CPU_STEPS = (20, 5), (10, 2)  # timed steps, warm-up steps


class Progress:
    """Progress lines of one phase (None: this process stays quiet): `say` prints, `tick` prints
    only when PROGRESS_SECONDS have passed since the last line."""

    def __init__(self, what: str | None):
        self.what, self.said = what, time.monotonic()

    def say(self, text: str) -> None:
        if self.what is not None:
            console.emit(f"{self.what}: {text}")
            self.said = time.monotonic()

    def tick(self, text: str) -> None:
        if time.monotonic() - self.said >= PROGRESS_SECONDS:
            self.say(text)


@dataclass(frozen=True)
class Measurement:
    seconds_per_step: float
    peak_bytes: dict[str, int]  # device name -> peak allocated bytes; empty on CPU


def _timed_steps(
    model: nn.Module, images, labels, steps: int, warmup: int, devices, progress: Progress
) -> float:
    """Seconds per step after `warmup`, a progress line at least every PROGRESS_SECONDS (the
    printing falls between timed steps and costs microseconds)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    started = 0.0
    for step in range(warmup + steps):
        if step == warmup:
            _synchronize(devices)
            started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(images), labels).backward()
        optimizer.step()
        progress.tick(f"step {step + 1}/{warmup + steps}")
    _synchronize(devices)
    return (time.perf_counter() - started) / steps


def _synchronize(devices: list[torch.device]) -> None:
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)


def _batch(args, size: int, device: torch.device):
    generator = torch.Generator().manual_seed(args.seed)
    images = torch.randn(size, 3, args.image_size, args.image_size, generator=generator)
    labels = torch.randint(args.num_classes, (size,), generator=generator)
    return images.to(device), labels.to(device)


def _peaks(devices: list[torch.device]) -> dict[str, int]:
    return {str(d): torch.cuda.max_memory_allocated(d) for d in devices if d.type == "cuda"}


def measure_data_parallel(args, devices: list[torch.device]) -> Measurement:
    for device in devices:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(args.seed)
    model = build_model(args.model, args.num_classes).to(devices[0])
    cuda_ids = [d.index for d in devices if d.type == "cuda"]
    # Without GPUs DataParallel would only call the module, so the CPU check uses it bare.
    parallel_model = nn.DataParallel(model, device_ids=cuda_ids) if cuda_ids else model
    images, labels = _batch(args, args.batch_size * len(devices), devices[0])
    progress = Progress("DataParallel")
    seconds = _timed_steps(
        parallel_model, images, labels, args.steps, args.warmup, devices, progress
    )
    peaks = _peaks(devices)
    del parallel_model, model, images, labels
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return Measurement(seconds, peaks)


def _ddp_worker(rank: int, world_size: int, port: int, args, results, joined, measured) -> None:
    use_cuda = args.cpu is None
    device = torch.device(f"cuda:{rank}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
        torch.cuda.reset_peak_memory_stats(device)
    else:
        # Share the cores instead of every process spinning threads on all of them.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    dist.init_process_group(
        "nccl" if use_cuda else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        **parallel.bound_device(device),
    )
    progress = Progress("DDP" if rank == 0 else None)
    progress.say(f"{world_size} processes joined, {args.warmup + args.steps} steps each")
    joined.set()
    try:
        torch.manual_seed(args.seed)
        model = build_model(args.model, args.num_classes).to(device)
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=[rank] if use_cuda else None)
        progress.say("model built and wrapped, training")
        images, labels = _batch(args, args.batch_size * world_size, torch.device("cpu"))
        mine = slice(rank * args.batch_size, (rank + 1) * args.batch_size)
        seconds = _timed_steps(
            ddp,
            images[mine].to(device),
            labels[mine].to(device),
            args.steps,
            args.warmup,
            [device],
            progress,
        )
        results.put((rank, seconds, _peaks([device])))
        if rank == 0:
            measured.set()
        dist.barrier()  # nobody tears down the group while a peer still uses it
    finally:
        dist.destroy_process_group()


def measure_ddp(args, world_size: int) -> Measurement:
    context = mp.get_context("spawn")
    results, joined, measured = context.SimpleQueue(), context.Event(), context.Event()
    processes = mp.start_processes(
        _ddp_worker,
        args=(world_size, parallel.free_loopback_port(), args, results, joined, measured),
        nprocs=world_size,
        start_method="spawn",
        join=False,
    )
    started = time.monotonic()
    # Starting processes that import torch, and ending them, takes seconds; rank 0 reports
    # from the moment they have joined until it has measured.
    while not processes.join(timeout=PROGRESS_SECONDS):
        if not joined.is_set():
            console.emit(f"DDP: processes starting ({time.monotonic() - started:.0f} s)")
        elif measured.is_set():
            console.emit("DDP: measured, the processes are leaving the group")
    reports = [results.get() for _ in range(world_size)]
    # A step takes as long as its slowest rank.
    peaks = {device: peak for _, _, per_rank in reports for device, peak in per_rank.items()}
    return Measurement(max(seconds for _, seconds, _ in reports), dict(sorted(peaks.items())))


def table(args, world_size: int, dp: Measurement, ddp: Measurement) -> list[str]:
    global_batch = args.batch_size * world_size
    rows = [
        ("", "DataParallel", "DDP"),
        (
            "time per step",
            f"{dp.seconds_per_step * 1e3:.1f} ms",
            f"{ddp.seconds_per_step * 1e3:.1f} ms",
        ),
        (
            "samples/s",
            f"{global_batch / dp.seconds_per_step:,.0f}",
            f"{global_batch / ddp.seconds_per_step:,.0f}",
        ),
    ]
    for device in sorted(set(dp.peak_bytes) | set(ddp.peak_bytes)):
        rows.append(
            (
                f"peak memory {device}",
                f"{dp.peak_bytes.get(device, 0) / 2**30:.2f} GiB",
                f"{ddp.peak_bytes.get(device, 0) / 2**30:.2f} GiB",
            )
        )
    if not dp.peak_bytes:
        rows.append(("peak memory", "n/a (CPU)", "n/a (CPU)"))
    return [f"{a:<22}{b:>16}{c:>16}" for a, b, c in rows]


def parse_args(argv: list[str] | None):
    parser = console.ArgumentParser(prog="python -m training.dp_vs_ddp", description=__doc__)
    parser.add_argument("--model", choices=MODELS, help="default: resnet50 (with --cpu: tiny)")
    parser.add_argument(
        "--batch-size", type=int, metavar="N", help="per GPU or process (default: 32; --cpu: 8)"
    )
    parser.add_argument("--image-size", type=int, metavar="N", help="default: 224 (--cpu: 32)")
    parser.add_argument("--num-classes", type=int, metavar="N", help="default: 1000 (--cpu: 10)")
    parser.add_argument(
        "--steps", type=int, metavar="N", help="timed steps (default: 20; --cpu: 10)"
    )
    parser.add_argument(
        "--warmup", type=int, metavar="N", help="untimed steps first (default: 5; --cpu: 2)"
    )
    parser.add_argument("--seed", type=int, metavar="N", default=0, help="default: 0")
    parser.add_argument(
        "--cpu",
        type=int,
        metavar="N",
        help="run on N CPU processes with gloo: checks the code, measures little; a smaller "
        "model by default (--cpu 2: about 30 s on 2 cores)",
    )
    args = parser.parse_args(argv)
    for name, value in (CPU_DEFAULTS if args.cpu is not None else GPU_DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    steps, warmup = CPU_STEPS if args.cpu is not None else GPU_STEPS
    args.steps = steps if args.steps is None else args.steps
    args.warmup = warmup if args.warmup is None else args.warmup
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console.require_positive(args, "batch_size", "image_size", "steps", "num_classes")
    if args.warmup < 0:
        raise UserError(f"--warmup must be 0 or more, got {args.warmup}")
    if args.cpu is not None:
        if args.cpu < 2:
            raise UserError(f"--cpu needs at least 2 processes to compare, got {args.cpu}")
        world_size, devices = args.cpu, [torch.device("cpu")]
    else:
        world_size = torch.cuda.device_count()
        if world_size < 2:
            raise UserError(
                f"dp_vs_ddp needs two or more GPUs on this machine, found {world_size}",
                hint="a multi-GPU node, or --cpu 2 to check the code path in about 30 s",
                exit_code=EXIT_NEEDS_GPUS,
            )
        devices = [torch.device(f"cuda:{index}") for index in range(world_size)]
    where = f"{world_size} CPU processes" if args.cpu else f"{world_size} GPUs"
    console.emit(
        f"{args.model}, batch {args.batch_size} per {'process' if args.cpu else 'GPU'} "
        f"x {world_size} = {args.batch_size * world_size}, {args.image_size}px, "
        f"{args.steps} timed steps after {args.warmup}, on {where}"
    )
    console.emit(f"DataParallel: {args.warmup + args.steps} steps in this process")
    data_parallel = measure_data_parallel(args, devices)
    console.emit(f"DDP: starting {world_size} processes on 127.0.0.1")
    distributed = measure_ddp(args, world_size)
    console.emit("\n".join(table(args, world_size, data_parallel, distributed)))
    return 0


if __name__ == "__main__":
    parallel.run(main)
