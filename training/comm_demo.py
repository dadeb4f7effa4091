"""Every point-to-point and collective operation once, each result checked on every rank.

    python -m torch.distributed.run --standalone --nproc-per-node 4 -m training.comm_demo

Rank 0 prints what every rank holds after each operation. A wrong value anywhere stops the
demo on every rank with one `Error:` line naming the operation, the rank, the expected and the
received value, and exit code 1. An operation the backend does not support is reported as SKIP
with the backend's reason.
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist

from torch_multinode.cluster.errors import UserError
from torch_multinode.training.distributed import parallel
from torch_multinode.training.settings import arguments, console


def _show(value: list[float] | None) -> str:
    return "-" if value is None else "[" + ", ".join(f"{number:g}" for number in value) + "]"


class Checker:
    def __init__(self, env: parallel.DistEnv, corrupt: str | None):
        self.env, self.corrupt = env, corrupt
        self.checked = self.skipped = 0

    def __call__(
        self, operation: str, what: str, held: torch.Tensor | None, expected: torch.Tensor | None
    ) -> None:
        """Compare on every rank, then agree: one rank's wrong value fails them all."""
        if (
            held is not None
            and self.corrupt == operation
            and self.env.rank == self.env.world_size - 1
        ):
            held = held + 1
        value = None if held is None else held.tolist()
        wanted = None if expected is None else expected.tolist()
        reports = parallel.all_gather((value, wanted), self.env)
        console.say(
            self.env,
            f"{operation:<15} {what:<34} "
            + "  ".join(
                f"r{rank}={_show(held_value)}" for rank, (held_value, _) in enumerate(reports)
            ),
        )
        for rank, (held_value, wanted_value) in enumerate(reports):
            if held_value != wanted_value:
                raise UserError(
                    f"{operation} is wrong on rank {rank}: expected {_show(wanted_value)}, "
                    f"got {_show(held_value)}",
                    exit_code=1,
                )
        self.checked += 1

    def skip(self, operation: str, reason: str) -> None:
        console.say(self.env, f"{operation:<15} SKIP: {reason}")
        self.skipped += 1


def maker(env: parallel.DistEnv):
    """tensor(1, 2) on this rank's device: NCCL only moves GPU tensors."""
    return lambda *values: torch.tensor(values, dtype=torch.float32, device=env.device)


def point_to_point(env: parallel.DistEnv, check: Checker) -> None:
    rank, world, tensor = env.rank, env.world_size, maker(env)
    # Blocking ping-pong in pairs (0,1), (2,3), ...; an odd last rank sits out.
    partner = rank ^ 1
    held = expected = None
    if partner < world:
        if rank % 2 == 0:
            dist.send(tensor(10 * rank + 1), dst=partner)
            held = tensor(0)
            dist.recv(held, src=partner)
            expected = tensor(10 * rank + 2)
        else:
            held = tensor(0)
            dist.recv(held, src=partner)
            expected = tensor(10 * partner + 1)
            dist.send(held + 1, dst=partner)
    check("send_recv", "pairs: ping 10*r+1, pong +1", held, expected)
    # A ring: everyone sends right and receives from the left at once, which blocking send and
    # recv would deadlock on. Batched, because NCCL needs a ring's pairs posted together.
    held = tensor(-1)
    requests = dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, tensor(rank), (rank + 1) % world),
            dist.P2POp(dist.irecv, held, (rank - 1) % world),
        ]
    )
    for request in requests:
        request.wait()
    check("isend_irecv", "ring: receive the left rank", held, tensor((rank - 1) % world))


def collectives(env: parallel.DistEnv, check: Checker) -> None:
    rank, world, tensor = env.rank, env.world_size, maker(env)
    total = world * (world + 1) / 2  # sum of rank + 1 over all ranks

    held = tensor(42, 43) if rank == 0 else tensor(0, 0)
    dist.broadcast(held, src=0)
    check("broadcast", "from rank 0", held, tensor(42, 43))

    held = tensor(-1)
    chunks = [tensor(100 * r) for r in range(world)] if rank == 0 else None
    dist.scatter(held, scatter_list=chunks, src=0)
    check("scatter", "rank r gets 100*r from rank 0", held, tensor(100 * rank))

    gathered = [tensor(-1) for _ in range(world)] if rank == 0 else None
    dist.gather(tensor(rank + 1), gather_list=gathered, dst=0)
    check(
        "gather",
        "rank+1 to rank 0",
        torch.cat(gathered) if rank == 0 else None,
        tensor(*range(1, world + 1)) if rank == 0 else None,
    )

    held = tensor(rank + 1)
    dist.reduce(held, dst=0, op=dist.ReduceOp.SUM)
    # Only the destination's result is defined.
    check(
        "reduce",
        "SUM of rank+1 to rank 0",
        held if rank == 0 else None,
        tensor(total) if rank == 0 else None,
    )

    gathered = [tensor(-1) for _ in range(world)]
    dist.all_gather(gathered, tensor(rank))
    check("all_gather", "every rank's rank", torch.cat(gathered), tensor(*range(world)))

    held = tensor(rank + 1, rank + 1)
    dist.all_reduce(held, op=dist.ReduceOp.SUM)
    check("all_reduce", "SUM of rank+1", held, tensor(total, total))
    held = tensor(rank)
    dist.all_reduce(held, op=dist.ReduceOp.MAX)
    check("all_reduce", "MAX of rank", held, tensor(world - 1))

    held = tensor(-1)
    try:
        dist.reduce_scatter(held, [tensor(rank + j) for j in range(world)])
        supported = None
    except (RuntimeError, NotImplementedError, ValueError) as error:
        supported = str(error).splitlines()[0] if str(error) else type(error).__name__
    reasons = [reason for reason in parallel.all_gather(supported, env) if reason]
    if reasons:
        check.skip("reduce_scatter", f"not supported by {env.backend}: {reasons[0]}")
    else:
        # Rank j receives the SUM over ranks r of chunk j, which rank r filled with r + j.
        check(
            "reduce_scatter",
            "chunk j = r+j, SUM to rank j",
            held,
            tensor(world * (world - 1) / 2 + world * rank),
        )


def subgroups(env: parallel.DistEnv, check: Checker) -> None:
    rank, world, tensor = env.rank, env.world_size, maker(env)
    even, odd = list(range(0, world, 2)), list(range(1, world, 2))
    # Every rank takes part in creating every group, members or not.
    groups = {"even": dist.new_group(even), "odd": dist.new_group(odd)}
    members = even if rank % 2 == 0 else odd
    held = tensor(rank)
    dist.all_reduce(held, group=groups["even" if rank % 2 == 0 else "odd"])
    check("new_group", "SUM of rank within even/odd ranks", held, tensor(sum(members)))


def main(argv: list[str] | None = None) -> int:
    args = arguments.comm_demo(argv)
    env = parallel.read_env()
    if not env.launched or env.world_size < 2:
        raise UserError(
            "comm_demo needs at least 2 processes",
            hint="python -m torch.distributed.run --nproc-per-node 2 -m training.comm_demo",
        )
    parallel.start(env)
    where = parallel.all_gather(
        (socket.gethostname(), os.environ.get("GROUP_RANK", "?"), env.local_rank), env
    )
    console.say(
        env,
        f"world    {env.world_size} processes, backend {env.backend}",
        *(
            f"rank {rank}  host {host}  node {node}  local rank {local}"
            for rank, (host, node, local) in enumerate(where)
        ),
    )
    check = Checker(env, args.corrupt)
    point_to_point(env, check)
    collectives(env, check)
    subgroups(env, check)
    console.say(
        env,
        f"all {check.checked} checks passed on {env.world_size} ranks"
        + (f", {check.skipped} skipped" if check.skipped else ""),
    )
    return 0


if __name__ == "__main__":
    parallel.run(main)
