"""Every workload's command line, parsed and checked as far as it can be without a process
group, a device or torch: by every rank before it starts, and by `train` on the controller
before any process starts anywhere (bad input is then one error line and exit 2, not the same
error from every rank followed by torchrun's report).

Nothing here imports torch or a workload module (they import torch, seconds of CPU on every
`make train`): a workload's --help describes it with its module's docstring, read from its
source. A workload that takes arguments parses them with its function here, and is listed in
CHECKS so that `train` checks them too.
"""

from __future__ import annotations

import argparse
import ast
import importlib.abc
import importlib.util
import math
import os
from collections.abc import Callable, Mapping
from typing import Any

from torch_multinode.cluster.errors import UserError
from torch_multinode.cluster.jobenv import PLANNED_WORLD_VARIABLE
from torch_multinode.training.settings import config as config_module
from torch_multinode.training.settings import fsdp_config
from torch_multinode.training.settings.config import STOP_EXIT_CODE, ManualDPConfig, TrainConfig
from torch_multinode.training.settings.console import ArgumentParser, require_positive

DDP_EPILOG = f"""\
precedence: flags > --config YAML file (sections as above, e.g. `optim: {{lr: 0.1}}`) > defaults

examples:
  python -m torch.distributed.run --standalone --nproc-per-node 2 -m training.ddp
  python -m torch.distributed.run --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d \\
      --rdzv-endpoint 192.168.1.10:29500 -m training.ddp --dataset cifar10 --data-dir /data/cifar
  python -m training.ddp --model tiny --steps 20     # one process, no process group

exit codes: 0 done, 1 failed, 2 bad input (one `Error:` line), {STOP_EXIT_CODE} --stop-after-step
"""
PIPELINE_SCHEDULES = ("gpipe", "1f1b")
COMM_OPERATIONS = (
    "send_recv",
    "isend_irecv",
    "broadcast",
    "scatter",
    "gather",
    "reduce",
    "all_gather",
    "all_reduce",
    "reduce_scatter",
    "new_group",
)


def docstring(module: str) -> str | None:
    """`module.__doc__`, read from its source without running it (imports its parent packages
    only)."""
    name = f"torch_multinode.{module}"  # our workloads' names in Python (see launch.spec)
    spec = importlib.util.find_spec(name)
    # one of our workloads, read from its source file
    assert spec is not None and isinstance(spec.loader, importlib.abc.InspectLoader)
    source = spec.loader.get_source(name)
    assert source is not None  # a module of ours, whose source is there
    return ast.get_docstring(ast.parse(source), clean=False)


def _named(module: str) -> dict[str, str | None]:
    """What a workload's parser is called in its --help: `python -m <module>`, and described
    with the module's docstring."""
    return {"prog": f"python -m {module}", "description": docstring(module)}


def launched_world_size(environ: Mapping[str, str] | None = None) -> int | None:
    """The world size torchrun gave this process (WORLD_SIZE), or None: not launched, or not a
    number (parallel.read_env says so)."""
    try:
        return int((os.environ if environ is None else environ)["WORLD_SIZE"])
    except (KeyError, ValueError):
        return None


def planned_world_size(environ: Mapping[str, str] | None = None) -> int | None:
    """The world size the job was planned for: TMN_PLANNED_WORLD_SIZE where the launcher
    continues it on fewer ranks (training.loop.virtual_ranks plays the missing ones), else
    launched_world_size. Below the world size that runs, or not a number, it is refused."""
    environ = os.environ if environ is None else environ
    launched = launched_world_size(environ)
    value = environ.get(PLANNED_WORLD_VARIABLE, "").strip()
    if not value:
        return launched
    try:
        planned = int(value)
    except ValueError:
        planned = 0
    if planned < (launched or 1):
        raise UserError(
            f"{PLANNED_WORLD_VARIABLE}={value!r} is not a world size of at least this job's "
            f"{launched or 1} ranks",
            hint="unsetting it: the launcher sets it only to continue a job on fewer ranks",
        )
    return planned


def ddp(argv: list[str] | None, world_size: int | None = None) -> TrainConfig:
    """training.ddp's settings; with `world_size`, its global batch made to fit it
    (config.fit_batch)."""
    config, given = config_module.parse_given(
        TrainConfig, argv, **_named("training.ddp"), epilog=DDP_EPILOG
    )
    config_module.check(config)
    config_module.fit_batch(config.optim, "global_batch_size" in given, world_size)
    return config


def manual_dp(argv: list[str] | None, world_size: int | None = None) -> ManualDPConfig:
    """training.manual_dp's settings: training.ddp's without the DDP section."""
    config, given = config_module.parse_given(
        ManualDPConfig,
        argv,
        **_named("training.manual_dp"),
        epilog="precedence: flags > --config YAML file > defaults",
    )
    config_module.check(config)
    config_module.fit_batch(config.optim, "global_batch_size" in given, world_size)
    return config


FSDP_EPILOG = f"""\
precedence: flags > --config YAML file (sections as above, e.g. `model: {{layers: 8}}`) > defaults

examples:
  python -m torch.distributed.run --standalone --nproc-per-node 2 -m training.fsdp
  python -m training.fsdp --steps 20        # one process: FSDP2 over a group of one
  make train INVENTORY=... NNODES=2 MODULE=training.fsdp ARGS="--checkpoint-dir /shared/gpt"

exit codes: 0 done, 1 failed, 2 bad input (one `Error:` line), {STOP_EXIT_CODE} --stop-after-step
"""


def fsdp(argv: list[str] | None, world_size: int | None = None) -> fsdp_config.FSDPConfig:
    """training.fsdp's settings; with `world_size`, its global batch made to fit it."""
    config, given = config_module.parse_given(
        fsdp_config.FSDPConfig, argv, **_named("training.fsdp"), epilog=FSDP_EPILOG
    )
    fsdp_config.check(config)
    config_module.fit_batch(config.optim, "global_batch_size" in given, world_size)
    return config


def model_parallel(argv: list[str] | None) -> argparse.Namespace:
    parser = ArgumentParser(**_named("training.model_parallel"))
    parser.add_argument(
        "--split-size",
        type=int,
        metavar="N",
        default=0,
        help="micro-batch size for pipelining; 0: no pipelining (default: 0). "
        "On two GPUs try --batch-size 120 --split-size 20",
    )
    parser.add_argument(
        "--batch-size", type=int, metavar="N", default=8, help="per process (default: 8)"
    )
    parser.add_argument(
        "--image-size", type=int, metavar="N", default=64, help="default: 64 (224 on GPUs)"
    )
    parser.add_argument("--num-classes", type=int, metavar="N", default=10, help="default: 10")
    parser.add_argument("--steps", type=int, metavar="N", default=3, help="default: 3")
    parser.add_argument(
        "--lr", type=float, default=0.001, help="SGD learning rate (default: 0.001)"
    )
    parser.add_argument("--seed", type=int, metavar="N", default=0, help="default: 0")
    args = parser.parse_args(argv)
    require_positive(args, "batch_size", "image_size", "num_classes", "steps")
    if args.split_size < 0:
        raise UserError("--split-size must be 0 (off) or positive")
    smallest = (
        (args.batch_size % args.split_size or args.split_size)
        if args.split_size
        else args.batch_size
    )
    side = math.ceil(args.image_size / 32)  # layer4's output side: resnet50 downsamples 32x
    if smallest * side * side < 2:
        raise UserError(
            f"a micro-batch of {smallest} image(s) at {args.image_size}px leaves layer4's "
            f"BatchNorm {smallest * side * side} value per channel; training needs at least 2",
            hint="--image-size 64, or micro-batches of 2 or more images",
        )
    return args


def pipeline(argv: list[str] | None) -> argparse.Namespace:
    parser = ArgumentParser(**_named("training.pipeline"))
    parser.add_argument(
        "--schedule",
        choices=PIPELINE_SCHEDULES,
        default="gpipe",
        help="gpipe or 1f1b (default: gpipe)",
    )
    parser.add_argument(
        "--steps", type=int, metavar="N", default=3, help="optimizer steps (default: 3)"
    )
    parser.add_argument(
        "--batch-size", type=int, metavar="N", default=32, help="samples per step (default: 32)"
    )
    parser.add_argument(
        "--microbatches",
        type=int,
        metavar="N",
        default=4,
        help="micro-batches per step; must divide the batch (default: 4)",
    )
    parser.add_argument("--image-size", type=int, metavar="N", default=16, help="default: 16")
    parser.add_argument("--num-classes", type=int, metavar="N", default=10, help="default: 10")
    parser.add_argument(
        "--width", type=int, metavar="N", default=8, help="channels of the first conv (default: 8)"
    )
    parser.add_argument("--lr", type=float, default=0.1, help="SGD learning rate (default: 0.1)")
    parser.add_argument(
        "--seed", type=int, metavar="N", default=0, help="weights and data (default: 0)"
    )
    parser.add_argument(
        "--out-dir",
        metavar="DIR",
        help="every rank writes stage-<rank>.pt here: its parameters, "
        "last gradients and (last stage) losses",
    )
    args = parser.parse_args(argv)
    require_positive(
        args, "steps", "batch_size", "microbatches", "image_size", "num_classes", "width"
    )
    if args.batch_size % args.microbatches:
        raise UserError(
            f"batch {args.batch_size} does not split into {args.microbatches} "
            f"micro-batches ({args.batch_size} % {args.microbatches} = "
            f"{args.batch_size % args.microbatches})"
        )
    return args


def comm_demo(argv: list[str] | None) -> argparse.Namespace:
    parser = ArgumentParser(**_named("training.comm_demo"))
    parser.add_argument(
        "--corrupt",
        choices=COMM_OPERATIONS,
        metavar="OPERATION",
        # test hook, hidden from --help: the last rank adds 1 to what OPERATION gave it, to
        # show that a wrong value is caught
        help=argparse.SUPPRESS,
    )
    return parser.parse_args(argv)


SELFTEST_CHECKS = (
    "device",
    "comm-in-node",
    "comm-across-nodes",
    "nccl-transport",
    "amp-bf16",
    "amp-fp16",
    "ddp-checkpoint",
    "fsdp2-dcp",
    "fsdp2-replicas",
    "ft-replicas",
    "compile",
    "flight-recorder",
    "nccl-waits",
    "data-parallel",
    "model-parallel",
)


def selftest(argv: list[str] | None) -> argparse.Namespace:
    parser = ArgumentParser(
        **_named("training.selftest"),
        epilog="exit codes: 0 every check passed or was skipped, 1 a check failed (one `Error:` "
        "line each, naming the check, the node and the remedy), 2 bad input",
    )
    parser.add_argument(
        "--checkpoint-dir",
        metavar="DIR",
        help="where the checkpoint checks write (a directory of their own inside, removed at the "
        "end); on storage every node sees (/shared on the simulated cluster) the distributed "
        "checkpoint is also resharded (default: the temporary directory of each node)",
    )
    parser.add_argument(
        "--fail",
        choices=SELFTEST_CHECKS,
        metavar="CHECK",
        # test hook, hidden from --help: the last rank reports CHECK as failed after running it
        help=argparse.SUPPRESS,
    )
    parser.add_argument(
        "--only",
        choices=SELFTEST_CHECKS,
        metavar="CHECK",
        action="append",
        # test hook, hidden from --help: run these checks alone (repeatable)
        help=argparse.SUPPRESS,
    )
    return parser.parse_args(argv)


# Each takes the workload's argv; those of BATCHED also the job's world size.
CHECKS: dict[str, Callable[..., Any]] = {
    "training.ddp": ddp,
    "training.manual_dp": manual_dp,
    "training.fsdp": fsdp,
    "training.model_parallel": model_parallel,
    "training.pipeline": pipeline,
    "training.comm_demo": comm_demo,
    "training.selftest": selftest,
}
"""Every workload that takes arguments: `train` checks them on the controller."""
BATCHED = ("training.ddp", "training.manual_dp", "training.fsdp")
"""The workloads of CHECKS whose global batch is split over the ranks (they take world_size)."""


def check(module: str, argv: list[str], world_size: int | None = None) -> str | None:
    """`module`'s arguments checked, if it is one of CHECKS (a bad one raises UserError,
    --help prints and exits); any other module checks its own on the nodes. With the job's
    `world_size`, a batched workload's global batch is checked against it (one the user chose
    must split evenly): what to say where a default batch was rounded to fit, else None."""
    parse = CHECKS.get(module)
    if parse is None:
        return None
    if module not in BATCHED or world_size is None:
        parse(argv)
        return None
    default = parse(argv).optim.global_batch_size
    fitted = parse(argv, world_size).optim.global_batch_size
    if fitted == default:
        return None
    return (
        f"global batch {fitted} (the default {default} rounded to a multiple of the world size "
        f"{world_size})"
    )
