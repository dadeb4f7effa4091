"""Pipeline parallelism across processes with torch.distributed.pipelining: one stage per rank.

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m training.pipeline

Every rank builds the whole (small) CNN from the same seed and keeps only its run of blocks,
so the stages together hold exactly the weights one process would. Rank 0 feeds images, the
last rank computes the loss; activations and gradients travel between neighbouring ranks.
The batch is cut into micro-batches that flow through the stages per the schedule: GPipe
(all forwards, then all backwards) or 1F1B (one forward, one backward: less memory held).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from torch_multinode.cluster.errors import UserError
from torch_multinode.training.checkpointing.durable import write_atomically
from torch_multinode.training.distributed import parallel
from torch_multinode.training.loop.data import SyntheticImages
from torch_multinode.training.settings import arguments, console


def build_model(num_classes: int, width: int, seed: int) -> nn.Sequential:
    """The unsplit model: a Sequential of blocks, the units stages are cut from."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.ReLU()),
        nn.Sequential(nn.Conv2d(width, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
        nn.Sequential(nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU()),
        nn.Sequential(
            nn.Conv2d(2 * width, 2 * width, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        ),
        nn.Linear(2 * width, num_classes),
    )


def stage_bounds(num_blocks: int, num_stages: int) -> list[tuple[int, int]]:
    """[start, end) block ranges, as even as possible, earlier stages taking the remainder."""
    if num_stages > num_blocks:
        raise UserError(
            f"{num_stages} pipeline stages need at least {num_stages} blocks; the model has "
            f"{num_blocks}",
            hint=f"NPROC={num_blocks} (torchrun's --nproc-per-node) or fewer processes in total",
        )
    base, extra = divmod(num_blocks, num_stages)
    bounds, start = [], 0
    for stage in range(num_stages):
        end = start + base + (stage < extra)
        bounds.append((start, end))
        start = end
    return bounds


def batches(dataset: SyntheticImages, batch_size: int, steps: int):
    """The same fixed sequence of batches on every rank (and in a one-process reference)."""
    for step in range(steps):
        samples = [dataset[(step * batch_size + i) % len(dataset)] for i in range(batch_size)]
        yield torch.stack([s[0] for s in samples]), torch.tensor([s[1] for s in samples])


def main(argv: list[str] | None = None) -> int:
    args = arguments.pipeline(argv)
    env = parallel.read_env()
    if not env.launched:
        raise UserError(
            "the pipeline needs one process per stage",
            hint="python -m torch.distributed.run --nproc-per-node 2 -m training.pipeline",
        )
    if args.schedule == "1f1b" and args.microbatches < env.world_size:
        raise UserError(
            f"1f1b needs at least as many micro-batches as stages: "
            f"{args.microbatches} < {env.world_size}"
        )
    model = build_model(args.num_classes, args.width, args.seed)
    bounds = stage_bounds(len(model), env.world_size)
    parallel.start(env)

    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    start, end = bounds[env.rank]
    module = model[start:end].to(env.device)  # slicing keeps the block names of the whole model
    stage = PipelineStage(
        module, stage_index=env.rank, num_stages=env.world_size, device=env.device
    )
    schedule_type = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[args.schedule]
    schedule = schedule_type(stage, n_microbatches=args.microbatches, loss_fn=F.cross_entropy)
    optimizer = torch.optim.SGD(module.parameters(), lr=args.lr)
    first, last = env.rank == 0, env.rank == env.world_size - 1
    placement = ", ".join(f"blocks {a}-{b - 1} on rank {r}" for r, (a, b) in enumerate(bounds))
    console.say(
        env,
        f"pipeline  {env.world_size} stages: {placement}",
        f"schedule  {args.schedule}, {args.microbatches} micro-batches of "
        f"{args.batch_size // args.microbatches}",
    )

    dataset = SyntheticImages(
        split="train",
        size=4 * args.batch_size,
        num_classes=args.num_classes,
        image_size=args.image_size,
        noise=1.0,
        seed=args.seed,
    )
    losses_per_step = []
    for step, (images, labels) in enumerate(batches(dataset, args.batch_size, args.steps), 1):
        optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        inputs = (images.to(env.device),) if first else ()
        target = {"target": labels.to(env.device), "losses": losses} if last else {}
        schedule.step(*inputs, **target)
        optimizer.step()
        if last:
            loss = torch.stack(losses).mean().item()
            losses_per_step.append(loss)
            console.emit(f"step {step}/{args.steps}  loss {loss:.6f}  (mean over micro-batches)")

    if args.out_dir:
        write_atomically(
            Path(args.out_dir) / f"stage-{env.rank}.pt",
            {
                "blocks": (start, end),
                "parameters": {k: v.detach().cpu() for k, v in module.state_dict().items()},
                "gradients": {k: p.grad.detach().cpu() for k, p in module.named_parameters()},
                "losses": losses_per_step,
            },
        )
    parallel.barrier(env)
    console.say(env, f"done: {args.steps} steps through {env.world_size} stages")
    return 0


if __name__ == "__main__":
    parallel.run(main)
