"""DataParallel against DistributedDataParallel on one node: time per step and peak memory per GPU.

    python -m training.dp_vs_ddp                  # not under torchrun: it starts its own processes

DataParallel is one process driving every GPU: each step it scatters the batch from GPU 0,
copies the model to every GPU, and gathers outputs back on GPU 0, which therefore holds more
memory and the GIL serialises the work. DDP runs one process per GPU (started here on
127.0.0.1) and only all-reduces gradients. Both train the same model on the same global batch.

Exit codes: 0 done, 2 bad input, 69 (EX_UNAVAILABLE) fewer than two GPUs on this machine.
--cpu N runs the same code on N CPU processes with gloo instead, to check the code path on a
machine without GPUs: its timings mean little and it measures no memory.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from cluster.errors import UserError
from training import console, parallel
from training.config import MODELS
from training.models import build_model

EXIT_NEEDS_GPUS = 69


@dataclass(frozen=True)
class Measurement:
    seconds_per_step: float
    peak_bytes: dict[str, int]  # device name -> peak allocated bytes; empty on CPU


def _timed_steps(model: nn.Module, images, labels, steps: int, warmup: int, devices) -> float:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    started = 0.0
    for step in range(warmup + steps):
        if step == warmup:
            _synchronize(devices)
            started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(images), labels).backward()
        optimizer.step()
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
    seconds = _timed_steps(parallel_model, images, labels, args.steps, args.warmup, devices)
    peaks = _peaks(devices)
    del parallel_model, model, images, labels
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return Measurement(seconds, peaks)


def _ddp_worker(rank: int, world_size: int, port: int, args, results) -> None:
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
    try:
        torch.manual_seed(args.seed)
        model = build_model(args.model, args.num_classes).to(device)
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=[rank] if use_cuda else None)
        images, labels = _batch(args, args.batch_size * world_size, torch.device("cpu"))
        mine = slice(rank * args.batch_size, (rank + 1) * args.batch_size)
        seconds = _timed_steps(
            ddp, images[mine].to(device), labels[mine].to(device), args.steps, args.warmup, [device]
        )
        results.put((rank, seconds, _peaks([device])))
        dist.barrier()  # nobody tears down the group while a peer still uses it
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def measure_ddp(args, world_size: int) -> Measurement:
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    mp.start_processes(
        _ddp_worker,
        args=(world_size, _free_port(), args, results),
        nprocs=world_size,
        start_method="spawn",
    )
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
    parser.add_argument("--model", choices=MODELS, default="resnet50", help="default: resnet50")
    parser.add_argument(
        "--batch-size", type=int, metavar="N", default=32, help="per GPU (default: 32)"
    )
    parser.add_argument("--image-size", type=int, metavar="N", default=224, help="default: 224")
    parser.add_argument("--num-classes", type=int, metavar="N", default=1000, help="default: 1000")
    parser.add_argument(
        "--steps", type=int, metavar="N", default=20, help="timed steps (default: 20)"
    )
    parser.add_argument(
        "--warmup", type=int, metavar="N", default=5, help="untimed steps first (default: 5)"
    )
    parser.add_argument("--seed", type=int, metavar="N", default=0, help="default: 0")
    parser.add_argument(
        "--cpu",
        type=int,
        metavar="N",
        help="run on N CPU processes with gloo: checks the code, measures little",
    )
    return parser.parse_args(argv)


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
                hint="a multi-GPU node, or --cpu 2 to check the code path",
                exit_code=EXIT_NEEDS_GPUS,
            )
        devices = [torch.device(f"cuda:{index}") for index in range(world_size)]
    where = f"{world_size} CPU processes" if args.cpu else f"{world_size} GPUs"
    console.emit(
        f"{args.model}, batch {args.batch_size} per {'process' if args.cpu else 'GPU'} "
        f"x {world_size} = {args.batch_size * world_size}, {args.image_size}px, "
        f"{args.steps} timed steps after {args.warmup}, on {where}"
    )
    data_parallel = measure_data_parallel(args, devices)
    distributed = measure_ddp(args, world_size)
    console.emit("\n".join(table(args, world_size, data_parallel, distributed)))
    return 0


if __name__ == "__main__":
    console.run(main)
