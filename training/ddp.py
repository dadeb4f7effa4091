"""DDP image classification: the workload a cluster is verified with.

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m training.ddp

trains resnet18 for 60 steps on built-in synthetic data and prints the validation accuracy: on
two CPU processes of a busy 2-core machine it took 2 minutes in all (80 s of training, a
progress line every 5 steps) and reaches 100%.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from torch_multinode.cluster.jobenv import RUN_DIR_VARIABLE
from torch_multinode.training.checkpointing.durable import write_atomically
from torch_multinode.training.distributed import levers, parallel, replicas
from torch_multinode.training.loop import data
from torch_multinode.training.loop.numerics import resolve_numerics
from torch_multinode.training.loop.trainer import Trainer, TrainResult
from torch_multinode.training.modeling import models
from torch_multinode.training.settings import arguments, console
from torch_multinode.training.settings import config as config_module


def default_run_dir(workload: str) -> str:
    """The launcher's run directory for this job where it gave one (it copies the master's back
    to the controller), else .runs/<workload>-<run id> here."""
    if os.environ.get(RUN_DIR_VARIABLE):
        return os.environ[RUN_DIR_VARIABLE]
    # torchrun hands every process of one job the same run id, so all ranks agree on the path.
    return str(Path(".runs") / f"{workload}-{os.environ.get('TORCHELASTIC_RUN_ID', 'local')}")


def prepare(config, env: parallel.DistEnv, workload: str, planned_world_size: int | None = None):
    """The checks and choices that need no other process: bad input fails before rendezvous.
    The batch is per planned rank where the job runs on fewer (TMN_PLANNED_WORLD_SIZE)."""
    config_module.check_on_rank(config)
    batch = parallel.per_rank_batch(config.optim.global_batch_size, env, planned_world_size)
    parallel.use_device(env)  # --precision auto asks the current GPU: this rank's, not GPU 0
    numerics = resolve_numerics(config.model.precision, env.device)
    if config.run.run_dir is None:
        config.run.run_dir = default_run_dir(workload)
    if config.run.out and os.environ.get(RUN_DIR_VARIABLE) and not os.path.isabs(config.run.out):
        # Under the launcher a relative --out lands in the run directory, which comes back to
        # the controller, not in the synced project, which the next sync would overwrite.
        config.run.out = os.path.join(os.environ[RUN_DIR_VARIABLE], config.run.out)
    return batch, numerics


def build(config, env: parallel.DistEnv, numerics) -> tuple[nn.Module, data.Splits]:
    torch.manual_seed(config.run.seed)  # identical initial weights on every rank
    splits = data.build_splits(config.data, config.run.seed)
    model = models.build_model(config.model.model, splits.num_classes)
    if config.model.sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(env.device)
    if numerics.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model, splits


def first_batch(splits: data.Splits, env: parallel.DistEnv, batch: int, seed: int):
    """This rank's first training batch, as the trainer's loader draws it, on the device."""
    sampler = data.ResumableSampler(
        splits.train, num_replicas=env.world_size, rank=env.rank, shuffle=True, seed=seed
    )
    indices = list(sampler)[:batch]
    images, labels = torch.utils.data.default_collate([splits.train[i] for i in indices])
    return images.to(env.device), labels.to(env.device)


def choose_comm_hook(
    config, env: parallel.DistEnv, model: nn.Module, splits: data.Splits, batch: int, numerics
) -> str:
    """--comm-hook auto: time every hook on a real batch of this run and keep the fastest (or
    reuse a measurement of the same setup from the run directory, up to a day old)."""
    if env.world_size <= 1:
        return levers.choose(model, env, config.ddp, lambda _: None).hook
    images, labels = first_batch(splits, env, batch, config.run.seed)
    if numerics.channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    dtype = numerics.autocast_dtype

    def micro_step(ddp_model: nn.Module) -> None:
        with torch.autocast(env.device.type, dtype=dtype, enabled=dtype is not None):
            loss = F.cross_entropy(ddp_model(images), labels)
        loss.backward()

    settings = config.ddp
    key = {
        "workload": "ddp",
        "model": config.model.model,
        "image_size": config.data.image_size,
        "precision": numerics.name,
        "world_size": env.world_size,
        "batch": batch,
        "accumulate": 1,
        "hosts": levers.node_names(env),
        "device": env.device.type,
        "bucket_cap_mb": settings.bucket_cap_mb,
        "gradient_as_bucket_view": settings.gradient_as_bucket_view,
        "static_graph": settings.static_graph,
        "powersgd_rank": settings.powersgd_rank,
        "torch": torch.__version__,
    }
    cache = levers.Cache(Path(config.run.run_dir) / levers.CACHE_FILE, key)
    # Not PowerSGD under fp16's loss scaling: an overflow leaves NaN in its error feedback for
    # good (config.check refuses the pair when asked for by name).
    candidates = tuple(
        hook for hook in levers.CANDIDATES if not (hook == "powersgd" and numerics.grad_scaler)
    )
    return levers.choose(
        model, env, settings, micro_step, 1, candidates=candidates, cache=cache
    ).hook


def header(config, env, splits: data.Splits, model: nn.Module, trainer: Trainer) -> list[str]:
    batch, ranks = trainer.batch, trainer.virtual.planned  # the planned world's ranks
    replication = []
    if trainer.replication is not None:
        replication = [
            trainer.replication.describe(),
            # Said before torch's own line, which comes with the first step.
            "         DDP keeps one layout of buckets on every group (find_unused_parameters): "
            "torch's warning that it found none unused is expected",
        ]
    return [
        f"world    {env.describe()}",
        f"data     {splits.description}",
        f"batch    {batch} per rank x {ranks} ranks = {batch * ranks} global",
        f"steps    {trainer.total_steps}, {trainer.steps_per_epoch} per epoch",
        f"model    {config.model.model}, {models.count_parameters(model) / 1e6:.2f}M parameters, "
        f"{trainer.numerics.name}{', SyncBatchNorm' if config.model.sync_bn else ''}",
        *replication,
    ]


def summary(result: TrainResult, digest: str) -> list[str]:
    resumed = f" (resumed from step {result.resumed_from})" if result.resumed_from else ""
    return [
        "-" * 60,
        f"steps          {result.steps}{resumed}",
        f"time           {result.seconds:.1f} s training, "
        f"{result.samples_per_second:,.0f} samples/s total",
        f"train loss     {result.train_loss:.4f}, accuracy "
        f"{100 * result.train_accuracy:.1f}% (steps since the previous report)",
        f"val accuracy   {100 * result.val_accuracy:.2f}% of {result.val_samples} samples",
        f"parameters     sha256 {digest[:16]}",
        "-" * 60,
    ]


def save_model(path: str, model: nn.Module) -> None:
    state = {name: tensor.detach().cpu() for name, tensor in model.state_dict().items()}
    write_atomically(Path(path), state)


def main(argv: list[str] | None = None) -> int:
    planned = arguments.planned_world_size()
    replica_group = replicas.read()  # FT=1: this node's group; its torchrun is the node's alone
    # The global batch is shared by every rank of every group.
    batch_world = (
        replica_group.count * (arguments.launched_world_size() or 1) if replica_group else planned
    )
    config = arguments.ddp(argv, batch_world)
    env = parallel.read_env()
    batch, numerics = prepare(config, env, "ddp", batch_world)
    # The measure of waits in collectives is the detector's too (a slow link): off with it.
    parallel.start(env, measure_waits=config.run.slow_rank_factor > 0)
    model, splits = build(config, env, numerics)
    ddp_settings = config.ddp
    if ddp_settings.static_graph and planned is not None and planned > env.world_size:
        # A rank that plays missing ranks accumulates their micro-batches under no_sync, which
        # DDP's static graph does not take: its first step fails an assertion in the reducer
        # ("expect_autograd_hooks_", torch 2.14.1). Off for this run; the steps are the same.
        ddp_settings = dataclasses.replace(ddp_settings, static_graph=False)
        console.say(
            env,
            "--static-graph off: on fewer ranks than planned a rank plays several micro-batches "
            "under no_sync, which DDP's static graph does not allow",
        )
    if replica_group is not None:
        replicas.check_ddp(ddp_settings)
    if ddp_settings.comm_hook == "auto":
        hook = choose_comm_hook(config, env, model, splits, batch, numerics)
        ddp_settings = dataclasses.replace(ddp_settings, comm_hook=hook)
    ddp_model = parallel.wrap_ddp(model, env, ddp_settings, fixed_buckets=replica_group is not None)
    trainer = Trainer(
        config,
        env,
        ddp_model,
        splits,
        batch_per_rank=batch,
        numerics=numerics,
        planned_world_size=planned,
        replica_group=replica_group,
    )
    console.say(env, *header(config, env, splits, model, trainer))
    result = trainer.fit()
    finish(config, env, model, result)
    return 0


def finish(config, env, model: nn.Module, result: TrainResult) -> None:
    digest = parallel.parameter_digest(model)
    console.say_every_rank(env, f"parameters sha256 {digest}")
    parallel.barrier(env)  # keeps the per-rank lines above the summary
    console.say(env, *summary(result, digest))
    if config.run.out and env.is_main:
        save_model(config.run.out, model)
        console.say(env, f"model state_dict written to {config.run.out}")


if __name__ == "__main__":
    parallel.run(main)
