"""The three ways to form a process group, one after the other, each checked with all_reduce.

    torchrun ... -m training.init_methods --shared-dir /shared

- env://  MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE from the environment. Use it under
  torchrun (it sets them) or any launcher that does: the default, and the one to choose.
- tcp://HOST:PORT  rank 0 opens a store on HOST:PORT and every rank is told its rank and the
  world size explicitly. Use it when you start processes yourself (mp.spawn, a job scheduler)
  and can pick a free port on a reachable host.
- file:///PATH  a file on a filesystem every rank sees (NFS, a shared volume) is the store.
  Use it when there is no port to open between the nodes; never reuse the same file for a
  second group: a stale file makes the new group hang or fail.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch
import torch.distributed as dist

from torch_multinode.cluster.errors import UserError
from torch_multinode.training import parallel

METHODS = ("env", "tcp", "file")


def form_and_check(
    method: str, init_method: str, rank: int, world: int, backend: str, device: torch.device
) -> int:
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
        **parallel.bound_device(device),
    )
    # NCCL reduces GPU tensors only, each rank's on its own GPU.
    value = torch.tensor([float(rank + 1)], device=device)
    dist.all_reduce(value)
    expected = world * (world + 1) / 2
    dist.barrier()
    dist.destroy_process_group()
    status = "OK" if value.item() == expected else "WRONG"
    print(
        f"[rank {rank}] {method}:// group of {world} ranks ({init_method}): all_reduce "
        f"{value.item():.0f} == {expected:.0f} {status}",
        flush=True,
    )
    return 0 if status == "OK" else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m training.init_methods",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--methods", default=",".join(METHODS), help="default: all three")
    parser.add_argument(
        "--shared-dir",
        default=None,
        help="a directory every rank sees, for file:// (skipped without it)",
    )
    parser.add_argument(
        "--tcp-port", type=int, default=None, help="port for tcp:// (default: MASTER_PORT + 1)"
    )
    options = parser.parse_args(argv)
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    except KeyError as missing:
        print(f"Error: {missing.args[0]} is not set (try running under torchrun)", file=sys.stderr)
        return 2
    try:
        env = parallel.read_env()  # the job's backend (TMN_BACKEND) and this rank's device
    except UserError as error:
        print(error.line(), file=sys.stderr)
        return error.exit_code
    # Before any group forms: otherwise every rank's NCCL work lands on GPU 0.
    parallel.use_device(env)
    failures = 0
    for method in options.methods.split(","):
        if method == "env":
            init = "env://"
        elif method == "tcp":
            init = f"tcp://{address}:{options.tcp_port or port + 1}"
        elif method == "file":
            if not options.shared_dir:
                print(f"[rank {rank}] file:// skipped: no --shared-dir", flush=True)
                continue
            run = os.environ.get("TORCHELASTIC_RUN_ID", "local")
            init = f"file://{os.path.join(options.shared_dir, f'init-{run}')}"
        else:
            print(f"Error: unknown method {method!r} (try env, tcp, file)", file=sys.stderr)
            return 2
        failures += form_and_check(method, init, rank, world, env.backend, env.device)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
