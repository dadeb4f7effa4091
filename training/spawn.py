"""The default job started the way the seed documents teach, for people learning: one process
per rank made by torch.multiprocessing.spawn, each forming the process group itself with an
explicit rank and world size. It trains exactly what `make train` trains under torchrun.

    python -m training.spawn [--nprocs N] [-- training.ddp options]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from torch_multinode.training import ddp
from torch_multinode.training.distributed import parallel

LOOPBACK = "127.0.0.1"


def worker(rank: int, world_size: int, port: int, argv: list[str]) -> None:
    if "OMP_NUM_THREADS" not in os.environ and world_size > 1:
        # As torchrun does: one thread per process, and the same float reductions as there.
        torch.set_num_threads(1)
    # What torchrun would have said, so the workload describes this layout like any other, and
    # this rank's backend and device are decided as under torchrun (a rank past the GPUs is an
    # error naming them).
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR=LOOPBACK,
        MASTER_PORT=str(port),
    )
    code = parallel.call(functools.partial(_join_and_train, port), argv)
    if code:
        sys.exit(code)


def _join_and_train(port: int, argv: list[str] | None) -> int:
    env = parallel.read_env()
    parallel.use_device(env)
    dist.init_process_group(
        env.backend,
        init_method=f"tcp://{LOOPBACK}:{port}",
        rank=env.rank,
        world_size=env.world_size,
        timeout=timedelta(minutes=5),
        **parallel.bound_device(env.device),
    )
    return ddp.main(argv)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m training.spawn",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Everything after '--' goes to training.ddp (see python -m training.ddp --help).",
    )
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    parser.add_argument(
        "--nprocs",
        type=int,
        default=gpus or 2,
        help="processes to spawn (default: one per GPU, or 2 on the CPU)",
    )
    parser.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    rest = options.args[1:] if options.args[:1] == ["--"] else options.args
    if options.nprocs < 1:
        print(f"Error: --nprocs {options.nprocs} is below 1", file=sys.stderr)
        return 2
    if "WORLD_SIZE" in os.environ:
        print("Error: already under torchrun: run python -m training.ddp instead", file=sys.stderr)
        return 2
    port = parallel.free_loopback_port()  # for rank 0's store
    try:
        mp.spawn(worker, args=(options.nprocs, port, rest), nprocs=options.nprocs, join=True)
    except mp.ProcessExitedException as exc:
        print(f"Error: rank {exc.error_index} exited with code {exc.exit_code}", file=sys.stderr)
        return 1
    except mp.ProcessRaisedException as exc:
        last = str(exc).strip().splitlines()[-1]
        print(f"Error: a rank failed: {last}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
