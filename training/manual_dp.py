"""Data parallel by hand: what DDP does, written out, beside it.

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m training.manual_dp

Same data, model, loop and flags as training.ddp (minus the DDP section), but the model is not
wrapped. Instead:
  1. rank 0's initial weights are broadcast, so every replica starts equal;
  2. each rank trains on its own partition of the data: the sampler hands rank r the samples
     r, r + world, r + 2 * world, ... of each epoch's shuffled order;
  3. after backward every gradient is all-reduced and averaged, so every replica takes the same
     step. DDP does the same with bucketing and overlap with backward; the result is equal.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from torch_multinode.training import ddp
from torch_multinode.training.distributed import parallel
from torch_multinode.training.loop.trainer import Trainer
from torch_multinode.training.settings import arguments, console


def broadcast_state(model: nn.Module, env: parallel.DistEnv) -> None:
    if env.launched:
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.data, src=0)


def average_gradients(model: nn.Module, env: parallel.DistEnv) -> None:
    """All-reduce every gradient and average; all reductions in flight at once."""
    if not env.launched:
        return
    gradients = [p.grad for p in model.parameters() if p.grad is not None]
    # Divide before summing, as DDP's default hook does: halves are exact, so with two ranks
    # the result matches DDP bit for bit, and fp16 sums cannot overflow.
    for gradient in gradients:
        gradient.div_(env.world_size)
    for handle in [dist.all_reduce(gradient, async_op=True) for gradient in gradients]:
        handle.wait()
    # Running BatchNorm statistics are per rank; like DDP, take rank 0's.
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)


def main(argv: list[str] | None = None) -> int:
    planned = arguments.planned_world_size()
    config = arguments.manual_dp(argv, planned)
    env = parallel.read_env()
    batch, numerics = ddp.prepare(config, env, "manual_dp", planned)
    parallel.start(env)
    model, splits = ddp.build(config, env, numerics)
    broadcast_state(model, env)
    trainer = Trainer(
        config,
        env,
        model,
        splits,
        batch_per_rank=batch,
        numerics=numerics,
        gradient_sync=lambda module: average_gradients(module, env),
        planned_world_size=planned,
    )
    console.say(env, *ddp.header(config, env, splits, model, trainer))
    ddp.finish(config, env, model, trainer.fit())
    return 0


if __name__ == "__main__":
    parallel.run(main)
