"""FSDP2 training of a GPT-style decoder, with distributed checkpoints: for a model too large to
keep whole (with its gradients and optimizer state) on one GPU.

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m training.fsdp

trains a 4-block GPT on synthetic token chains for 60 steps: on two CPU processes of a 2-core
machine in about 30 s (24 s of them training, a progress line every 10 steps), its loss falls
from 4.2 to 0.80 (the data's floor is 0.73). Every block
and the root are wrapped with fully_shard: each rank keeps 1/world of the parameters,
gradients and AdamW state, and gathers a block's parameters only while it computes with it.
The job prints what each rank holds against one unsharded replica, tokens/s, and on GPUs the
peak memory and the model FLOPs utilisation; with --bench rank 0 also prints one `BENCH {json}`
line of it.
Without torchrun it runs as one process (FSDP2 over a process group of one).
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from torch_multinode.cluster.errors import UserError
from torch_multinode.cluster.jobenv import RUN_DIR_VARIABLE
from torch_multinode.training.checkpointing import checkpoint, replicate
from torch_multinode.training.checkpointing.dcp import PAUSE_SECONDS, Checkpoints, agree
from torch_multinode.training.distributed import parallel, replicas
from torch_multinode.training.loop.fsdp_report import (
    Clock,
    Progress,
    Result,
    continuing,
    finish,
    header,
    held_bytes,
    report_progress,
)
from torch_multinode.training.loop.numerics import learning_rate, resolve_numerics
from torch_multinode.training.modeling import gpt
from torch_multinode.training.settings import arguments, compile_check, console
from torch_multinode.training.settings.config import STOP_EXIT_CODE, DDPConfig

BETAS = (0.9, 0.95)


# -- what runs where -------------------------------------------------------------------------


def start(env: parallel.DistEnv, timeout: float) -> None:
    """The process group: torchrun's, or for one plain process a group of one (FSDP2 and DCP
    are the same code at every world size)."""
    if env.launched:
        parallel.start(env)
        dist.set_timeout(timedelta(seconds=timeout))
        return
    parallel.use_device(env)
    backend = "nccl" if env.device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        **parallel.bound_device(env.device),
    )


def wrap(model: nn.Module, env: parallel.DistEnv, config, numerics) -> nn.Module:
    """The strategy applied: fully_shard every block, then the root (which keeps the
    embeddings, the final norm and the head), or DDP."""
    if config.model.compile:
        for block in model.blocks:
            block.compile()  # in place: the parameter names stay the plain model's
    if config.model.strategy == "ddp":
        return parallel.wrap_ddp(model.to(env.device), env, DDPConfig())
    mesh = init_device_mesh(env.device.type, (env.world_size,))
    if numerics.autocast_dtype == torch.bfloat16:
        # Parameters all-gathered and computed in bf16; gradients reduce-scattered in fp32 into
        # fp32 shards, which the optimizer updates.
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        policy = MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def build_optimizer(model: nn.Module, config) -> torch.optim.AdamW:
    """AdamW; matrices decay, biases, norms and nothing else."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": config.weight_decay},
            {"params": rest, "weight_decay": 0.0},
        ],
        lr=config.lr,
        betas=BETAS,
    )


def clip_gradients(model: nn.Module, max_norm: float) -> torch.Tensor:
    """The norm of the whole gradient before clipping, and the gradient clipped to max_norm
    (0: not clipped). On FSDP2's DTensor gradients torch computes each rank's part and
    all-reduces it: the norm is the unsharded gradient's."""
    parameters = [p for p in model.parameters() if p.grad is not None]
    if max_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in parameters])
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


# -- the run ---------------------------------------------------------------------------------


def resolve_export(path: str | None) -> str | None:
    """Under the launcher a relative --export lands in the run directory, which comes back to
    the controller."""
    if path and os.environ.get(RUN_DIR_VARIABLE) and not os.path.isabs(path):
        return os.path.join(os.environ[RUN_DIR_VARIABLE], path)
    return path


def main(argv: list[str] | None = None) -> int:
    planned = arguments.planned_world_size()
    config = arguments.fsdp(argv, planned)
    env = parallel.read_env()
    parallel.use_device(env)
    numerics = resolve_numerics(config.model.precision, env.device)
    group = replicas.read()  # FT=1: this node's replica group
    data = (env.rank, env.world_size)  # this rank's share of each step's batch, of how many
    if group is not None:
        replicas.check_job(planned, env.world_size, numerics.grad_scaler)
        data = group.data_position(env.rank, env.world_size)
        planned = data[1]
    batch = parallel.per_rank_batch(config.optim.global_batch_size, env, planned)
    export = resolve_export(config.checkpoint.export)
    start(env, config.run.collective_timeout)

    # What only this node can tell, agreed on by every rank before anyone goes on.
    source, error = (
        None,
        compile_check.compile_problem(env.device) if config.model.compile else None,
    )
    if error is None:
        try:
            source = gpt.build_data(config)
        except UserError as raised:
            error = raised
    agree(env, error)
    assert source is not None  # built, or agree raised on every rank
    node = parallel.node_name()
    copies = parallel.all_gather((node, source.fingerprint()), env)
    if len({found for _, found in copies}) > 1:  # the ranks would build different models
        seen = "; ".join(f"{where}: {found}" for where, found in sorted(set(copies)))
        raise UserError(
            f"--data {config.data.data} differs between the nodes ({seen})",
            hint="the same file on every node",
        )
    shape = gpt.Shape(
        config.model.layers,
        config.model.width,
        config.model.heads,
        config.model.seq_len,
        source.vocab_size,
    )
    torch.manual_seed(config.run.seed)  # the same whole model on every rank, before sharding
    model = gpt.GPT(shape, activation_checkpointing=config.model.activation_checkpointing)
    console.say(env, *header(config, env, source, model, batch, numerics, planned))
    if planned and planned != env.world_size and group is None:
        console.say(env, continuing(config.optim.global_batch_size, env.world_size, planned))
    model = wrap(model, env, config, numerics)
    optimizer = build_optimizer(model, config.optim)
    shards = None
    if group is not None:
        shards = replicas.Shards(
            group,
            env.device,
            optimizer,
            lambda step: learning_rate(config.optim, step, config.run.steps),
        )
        console.say(env, shards.replication.describe())

    store = None
    start_step = 0
    info = {
        "shape": shape.as_dict(),
        "strategy": config.model.strategy,
        "global_batch_size": config.optim.global_batch_size,
        "seed": config.run.seed,
    }
    if config.checkpoint.checkpoint_dir:

        def hook_rank(rank: int | None) -> int | None:
            """A test hook's rank, the job's: with FT=1 counted across the groups."""
            return rank if group is None else group.own_rank(rank, env.world_size)

        paused = config.checkpoint.checkpoint_pause_step
        held = config.checkpoint.hold_after_step
        store = Checkpoints(
            checkpoint_directory(config.checkpoint.checkpoint_dir, group),
            env,
            config.checkpoint.keep,
            node,
            pause=None
            if paused is None
            else (paused, hook_rank(config.checkpoint.checkpoint_pause_rank)),
            hold=None if held is None else (held, hook_rank(config.checkpoint.hold_rank)),
        )
        if group is not None:
            console.say(env, f"checkpoints    this replica group's own, in {store.directory}")
        elif config.checkpoint.replicate and env.launched:
            pause = config.checkpoint.replication_pause_step
            store.replication = replicate.Replication(
                store,
                config.checkpoint.replication_mbps,
                config.run.collective_timeout,
                pause=None if pause is None else (pause, config.checkpoint.replication_pause_rank),
            )
        resumed, own = store.resume(model, optimizer, config.checkpoint.resume, info)
        start_step = resumed or 0
        if own is not None:
            checkpoint.restore_rng_states(own["rng"], env.device)
        if shards is not None and resumed:
            # torchft's step count is this group's: a group behind the newest heals at the
            # first quorum, from a group ahead.
            shards.step = resumed
            shards.replication.resumed(resumed)

    if env.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(env.device)
    try:
        result = train(
            config, env, model, optimizer, source, numerics, store, start_step, info, data, shards
        )
    finally:
        if shards is not None:
            # Its threads would otherwise keep a failed rank's process waiting at exit.
            shards.replication.shutdown()
    if store is not None and store.replication is not None:
        store.replication.wait()  # the last checkpoint's copy
    finish(config, env, model, shape, source, result, start_step, numerics, export)
    return 0


def checkpoint_directory(given: str, group: replicas.ReplicaGroup | None) -> Path:
    """Where this job's distributed checkpoints go. With replica groups (FT=1) each group
    holds the whole model, sharded over its own ranks, and writes its checkpoints as a job of
    its own: in a directory of its own (`group-<index>` in the one given), as two groups'
    steps in one directory on storage every node sees would be written over each other. A
    group resumes its own newest complete step; torchft makes the newest among the groups the
    resume point (the others heal from it)."""
    directory = Path(given)
    return directory if group is None else directory / f"group-{group.index}"


def train(
    config, env, model, optimizer, source, numerics, store, start_step, info, data, shards=None
) -> Result:
    """Steps start_step + 1 to --steps. The data position is the step: every batch is a
    function of it, of which this rank takes share `data` (its rank and how many share it).
    With `shards` (FT=1) a step counts once torchft commits it: one not committed is done
    again, and a group that healed goes on from its peer's step."""
    run, optim = config.run, config.optim
    total, global_batch = run.steps, optim.global_batch_size
    tokens_per_step = global_batch * config.model.seq_len
    # DDP computes under autocast; FSDP2's mixed-precision policy casts instead.
    autocast = numerics.autocast_dtype if config.model.strategy == "ddp" else None
    progress, clock, held = Progress(), Clock(env.device), {}
    norm = torch.zeros(())
    replication = shards.replication if shards is not None else None
    inner = optimizer
    if shards is not None:
        optimizer, progress.scope = shards.optimizer, "this group"
        if shards.replication.group.start_wait > 0:
            # Groups started together, at step 0 or each from its own newest checkpoint.
            shards.replication.gather()
    model.train()
    clock.start()
    step, first = start_step, True
    while step < total:
        if shards is not None:
            shards.step = step  # what a peer healing in this step takes
        optimizer.zero_grad(set_to_none=True)  # FT=1: starts the step's quorum
        tokens = gpt.rank_slice(source.batch(step, global_batch), *data)
        # This rank's share of the mean over the global batch: 1, unless the batch does not
        # split evenly (a job continued on fewer ranks than planned).
        weight = len(tokens) * data[1] / global_batch
        tokens = tokens.to(env.device, non_blocking=True)
        lr = learning_rate(optim, step, total)
        for group in optimizer.param_groups:
            group["lr"] = lr
        with torch.autocast(env.device.type, dtype=autocast, enabled=autocast is not None):
            loss = gpt.loss_of(model, tokens)
        if weight != 1:
            loss = loss * weight  # the gradients' average over the ranks is the batch's mean
        loss.backward()
        if replication is not None:
            replication.gradient_sync(model)  # each rank's shards, with the same rank's
        norm = clip_gradients(model, optim.grad_clip)
        optimizer.step()
        healed, step_tokens = False, tokens_per_step
        if shards is not None:
            step, committed, healed = shards.after_step(step)
            if healed:
                lr = learning_rate(optim, step, total)
            if not committed:
                console.say(env, f"step {step + 1} not committed: done again")
                continue
            step_tokens = tokens_per_step // shards.replication.group.count  # this group's
        progress.losses.append(loss.detach())
        done = step + 1
        if first:
            held = held_bytes(model, inner)  # gradients and optimizer state exist now
            clock.stop()
            clock.total = 0.0  # the first step is not timed
            clock.start()
        else:
            progress.measured_steps += 1
            progress.window_steps += 1
            progress.measured_tokens += step_tokens
            progress.window_tokens += step_tokens
        # The first step's line comes at once: on CPUs that step alone can take seconds.
        if done % run.log_every == 0 or done == total or first:
            clock.stop()
            report_progress(env, progress, clock.total, (done, total), lr, norm)
            clock.start()
        first = False
        if replication is not None:
            line = replication.membership(done)
            if line is not None:
                console.say(env, line)
            if healed:
                console.say(env, f"healed from a peer: at step {done} with the others")
        if store is not None and (done % config.checkpoint.checkpoint_every == 0 or done == total):
            clock.stop()
            own = {"position": {"step": done}, "rng": checkpoint.rng_states(env.device)}
            # The optimizer itself, not torchft's wrapper (whose step() is a commit).
            console.say(env, store.save(done, model, inner, own, info))
            clock.start()
        if run.step_delay > 0:
            clock.stop()
            time.sleep(run.step_delay)
            clock.start()
        if store is not None and store.holding(done):
            clock.stop()
            console.say_every_rank(
                env, f"held after step {done} for {PAUSE_SECONDS:.0f} s (--hold-after-step)"
            )
            time.sleep(PAUSE_SECONDS)
            clock.start()
        if config.checkpoint.stop_after_step == done:
            if store is not None and store.replication is not None:
                store.replication.wait()
            parallel.barrier(env)
            console.say(
                env, f"stopping after step {done} (--stop-after-step): exit {STOP_EXIT_CODE}"
            )
            os._exit(STOP_EXIT_CODE)
        step = done
    clock.stop()
    if not held:  # resumed from the last step: nothing left to train, no gradients
        held = held_bytes(model, inner)
    inner.zero_grad(set_to_none=True)  # the last step's gradients (no quorum to start)
    return Result(held, progress, clock.total)


if __name__ == "__main__":
    parallel.run(main)
