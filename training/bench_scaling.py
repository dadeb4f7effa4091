"""Scaling benchmark: seconds per optimizer step of ResNet training under each lever that cuts
the cost of the gradient all-reduce, at the same global batch (world x batch x accumulate).

    python -m torch.distributed.run --nnodes 2 --nproc-per-node 1 ... -m training.bench_scaling

Levers: none, fp16, bf16 and powersgd are DDP communication hooks with naive accumulation (every
micro-batch's backward all-reduces); no_sync is hook none with DDP.no_sync() on all but the last
micro-batch (one all-reduce per optimizer step); auto picks a hook by timing each once at start
(training.levers, its selection time reported on its own) and then runs it with no_sync. With
one process there is no DDP at all: one `baseline` series of the plain model with the same
accumulation. Repetitions are interleaved (every lever once, then every lever again, ...) so a
slow drift of the machines or the network hits every lever alike.

Data is synthetic (random tensors, fixed seed, 10 classes); the optimizer is SGD with momentum.
Each measurement is a fresh DDP wrapper, --warmup untimed optimizer steps (PowerSGD: more, until
it has compressed once; it compresses from its 3rd all-reduce here), then --measure timed ones,
the SGD step included, timed on every rank and reduced with MAX. Rank 0 prints one line per
measurement as it ends:

    rep 1/1  fp16      1.310 s/optimizer step  195.4 samples/s

The defaults (resnet18, 32 px, batch 16, one repetition of every lever) took 90 s on two CPU
processes of a busy 2-core machine, a line at least every 10 s; `make bench` passes its own,
larger workload. With --bench each line is instead one JSON row, what `make bench` reads:

    BENCH {"lever": "fp16", "rep": 1, "seconds_per_step": 1.31, "samples_per_second": 195.4,
           "world_size": 2, "accumulate": 2, "batch": 64, "hook": "fp16", "no_sync": false}

and for auto, once, before the others:

    BENCH {"lever": "auto-selection", "seconds": 20.5, "timings": {"none": 1.52, ...},
           "chosen": "fp16"}
"""

from __future__ import annotations

import json
import os
import time

import torch
import torch.nn.functional as F

from torch_multinode.cluster.errors import UserError
from torch_multinode.training import console, levers, models, parallel
from torch_multinode.training.config import MODELS, DDPConfig

LEVERS = ("none", "fp16", "bf16", "powersgd", "no_sync", "auto")
BASELINE = "baseline"
NUM_CLASSES = 10
LEARNING_RATE = 0.01  # small: the weights only have to stay finite over the measured steps
PREFIX = "BENCH "


def _parser() -> console.ArgumentParser:
    parser = console.ArgumentParser(prog="python -m training.bench_scaling", description=__doc__)
    parser.add_argument(
        "--model", choices=MODELS, default="resnet18", help="network (default: %(default)s)"
    )
    parser.add_argument(
        "--image-size",
        type=int,
        default=32,
        metavar="N",
        help="side of the square synthetic images (default: %(default)s)",
    )
    parser.add_argument(
        "--batch",
        type=int,
        default=16,
        metavar="N",
        help="samples per micro-batch per rank (default: %(default)s)",
    )
    parser.add_argument(
        "--accumulate",
        type=int,
        default=2,
        metavar="A",
        help="micro-batches per optimizer step (default: %(default)s)",
    )
    parser.add_argument(
        "--levers",
        default=",".join(LEVERS),
        metavar="LIST",
        help=f"comma-separated, of {', '.join(LEVERS)}; with one process ignored: one "
        f"{BASELINE} series (default: %(default)s)",
    )
    parser.add_argument(
        "--reps",
        type=int,
        default=1,
        metavar="N",
        help="measurements per lever, interleaved (default: %(default)s)",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=1,
        metavar="N",
        help="untimed optimizer steps before each measurement; PowerSGD gets more, until it "
        "has compressed once (default: %(default)s)",
    )
    parser.add_argument(
        "--measure",
        type=int,
        default=2,
        metavar="N",
        help="timed optimizer steps per measurement (default: %(default)s)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of weights and data (default: %(default)s)"
    )
    parser.add_argument(
        "--bench",
        action="store_true",
        help="print each measurement as one `BENCH {json}` line (what make bench reads)",
    )
    return parser


def parse_levers(text: str, world_size: int) -> list[str]:
    """The series to measure, in order, each once."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    known = (*LEVERS, BASELINE)
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        raise UserError(
            f"--levers {text!r}: {', '.join(unknown) or 'empty'} is not one of {', '.join(known)}"
        )
    if world_size == 1:
        return [BASELINE]
    if BASELINE in names:
        raise UserError(
            f"--levers {BASELINE} is the one-process series; this job has {world_size} processes"
        )
    return list(dict.fromkeys(names))


def threads() -> int:
    """Each node has one core: one thread per process unless OMP_NUM_THREADS says otherwise
    (torchrun sets it to 1 only when it starts several processes per node)."""
    value = os.environ.get("OMP_NUM_THREADS", "1")
    try:
        count = int(value)
    except ValueError:
        raise UserError(f"OMP_NUM_THREADS={value!r} is not an integer") from None
    if count < 1:
        raise UserError(f"OMP_NUM_THREADS={value!r} is below 1")
    return count


def report(row: dict, bench: bool, reps: int) -> None:
    """One measurement: a `BENCH {json}` line with --bench, a readable line otherwise."""
    if bench:
        console.emit(PREFIX + json.dumps(row))  # one write, flushed
    elif row["lever"] == "auto-selection":
        console.emit(f"auto-selection took {row['seconds']:.1f} s: {row['chosen']}")
    else:
        console.emit(
            f"rep {row['rep']}/{reps}  {row['lever']:<9} {row['seconds_per_step']:.3f} "
            f"s/optimizer step  {row['samples_per_second']:,.1f} samples/s"
        )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    console.require_positive(args, "image_size", "batch", "accumulate", "reps", "measure")
    if args.warmup < 0:
        raise UserError(f"--warmup must be 0 or more, got {args.warmup}")
    env = parallel.read_env()
    series = parse_levers(args.levers, env.world_size)
    torch.set_num_threads(threads())
    parallel.start(env)

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    module = models.build_model(args.model, NUM_CLASSES).to(env.device)
    generator = torch.Generator().manual_seed(args.seed * 1009 + env.rank)
    shape = (args.batch, 3, args.image_size, args.image_size)
    batches = [
        (
            torch.randn(shape, generator=generator).to(env.device),
            torch.randint(NUM_CLASSES, (args.batch,), generator=generator).to(env.device),
        )
        for _ in range(args.accumulate)
    ]
    position = [0]

    def micro_step(model: torch.nn.Module) -> None:
        images, labels = batches[position[0] % len(batches)]
        position[0] += 1
        (F.cross_entropy(model(images), labels) / args.accumulate).backward()

    optimizer = torch.optim.SGD(module.parameters(), lr=LEARNING_RATE, momentum=0.9)
    ddp_settings = DDPConfig()
    samples = env.world_size * args.batch * args.accumulate
    console.say(
        env,
        f"bench_scaling: {args.model} {args.image_size}px, {args.batch} per micro-batch x "
        f"{args.accumulate} x {env.world_size} rank(s) = {samples} samples per optimizer step, "
        f"{torch.get_num_threads()} thread(s) per rank, {env.device.type}; "
        f"{', '.join(series)} x {args.reps}"
        + ("; auto first times each hook" if "auto" in series else ""),
    )

    chosen = None
    if "auto" in series:
        parallel.barrier(env)
        started = time.perf_counter()
        choice = levers.choose(
            module, env, ddp_settings, micro_step, args.accumulate, no_sync=True, each=True
        )
        (seconds,) = levers.slowest([time.perf_counter() - started], env)
        chosen = choice.hook
        if env.is_main:
            report(
                {
                    "lever": "auto-selection",
                    "seconds": seconds,
                    "timings": choice.timings,
                    "chosen": chosen,
                },
                args.bench,
                args.reps,
            )

    for rep in range(1, args.reps + 1):
        for lever in series:
            hook, no_sync = {
                BASELINE: (None, False),
                "no_sync": ("none", True),
                "auto": (chosen, True),
            }.get(lever, (lever, False))
            own = levers.measure_once(
                module,
                env,
                micro_step,
                args.accumulate,
                config=ddp_settings,
                hook=hook,
                warmup=args.warmup,
                steps=args.measure,
                no_sync=no_sync,
                optimizer=optimizer,
            )
            (seconds,) = levers.slowest([own], env)
            if env.is_main:
                report(
                    {
                        "lever": lever,
                        "rep": rep,
                        "seconds_per_step": seconds,
                        "samples_per_second": samples / seconds,
                        "world_size": env.world_size,
                        "accumulate": args.accumulate,
                        "batch": args.batch,
                        "hook": hook,
                        "no_sync": no_sync,
                    },
                    args.bench,
                    args.reps,
                )
    return 0


if __name__ == "__main__":
    console.run(main)
