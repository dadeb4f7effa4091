"""The training loop: steps, numerics, checkpoint/resume and validation, for any data-parallel
wrapping. How gradients are synchronised is the caller's business: DDP does it inside backward,
other strategies pass `gradient_sync`, called between backward and the optimizer step.

Faults it guards against: a collective that waits longer than --collective-timeout fails the job
instead of hanging it; older checkpoints are deleted only once every rank holds the new one; a
rank much slower than the others is named every --log-every steps.

A job continued on fewer ranks than it was planned for (planned_world_size) plays the missing
ranks (training.loop.virtual_ranks): each rank runs one micro-batch per planned rank it plays
and steps once, so the steps are those of the planned world."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from torch_multinode.cluster.errors import UserError
from torch_multinode.cluster.jobenv import PLANNED_WORLD_VARIABLE
from torch_multinode.training.checkpointing import checkpoint, complete
from torch_multinode.training.distributed import parallel, replicas
from torch_multinode.training.loop import data, metrics
from torch_multinode.training.loop.numerics import Numerics, build_optimizer, learning_rate
from torch_multinode.training.loop.pace import OwnTime, Untimed, own_work, slow_ranks
from torch_multinode.training.loop.virtual_ranks import VirtualRanks
from torch_multinode.training.settings.config import STOP_EXIT_CODE
from torch_multinode.training.settings.console import say, say_every_rank

CHECKPOINT_PAUSE_SECONDS = 120.0  # --checkpoint-pause-step: long enough to kill or interrupt


@dataclass
class Position:
    """Where training is: checkpointed, and enough to continue exactly."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0


@dataclass(frozen=True)
class TrainResult:
    steps: int
    resumed_from: int | None
    train_loss: float
    train_accuracy: float
    val_accuracy: float
    val_samples: int
    seconds: float
    samples_per_second: float


class Trainer:
    def __init__(
        self,
        config,
        env: parallel.DistEnv,
        model: nn.Module,
        splits: data.Splits,
        *,
        batch_per_rank: int,
        numerics: Numerics,
        gradient_sync: Callable[[nn.Module], None] | None = None,
        planned_world_size: int | None = None,
        replica_group: replicas.ReplicaGroup | None = None,
    ):
        """`batch_per_rank` is that of the planned world where `planned_world_size` (None: the
        world size) exceeds the ranks that run. With a `replica_group` (FT=1) the process group
        is the node's own and torchft replicates across nodes (training.distributed.replicas):
        the data is the group's share, a step counts once committed, and a group that joins
        late takes the model, the optimizer and the position from a peer."""
        self.config, self.env, self.model, self.splits = config, env, model, splits
        self.batch, self.numerics, self.gradient_sync = batch_per_rank, numerics, gradient_sync
        if replica_group is not None:
            replicas.check_job(planned_world_size, env.world_size, numerics.grad_scaler)
            data_rank, data_world = replica_group.data_position(env.rank, env.world_size)
            self.virtual = VirtualRanks(data_rank, data_world, data_world)
        else:
            self.virtual = VirtualRanks(
                env.rank, env.world_size, planned_world_size or env.world_size
            )
        if self.virtual.active and getattr(config.model, "sync_bn", False):
            # Its forward is a collective: ranks playing different counts of micro-batches
            # would wait for each other forever.
            raise UserError(
                f"--sync-bn cannot continue on {env.world_size} of {self.virtual.planned} "
                f"planned ranks ({PLANNED_WORLD_VARIABLE}): ranks run different numbers of "
                "forward passes per step",
                hint="--no-sync-bn, or the planned number of nodes",
            )
        self.optimizer = build_optimizer(config.optim, model.parameters())
        self.replication: replicas.Replication | None = None
        self._healed = False
        self._group_batches = 0  # FT=1: per step trained here, the groups that took part
        if replica_group is not None:
            self.replication = replicas.Replication(
                replica_group, env.device, self._replica_state, self._load_replica_state
            )
            self._inner_optimizer = self.optimizer
            self.optimizer = self.replication.optimizer(self.optimizer)
            if hasattr(model, "register_comm_hook"):  # DDP: bucket by bucket, in the backward
                self.replication.replicate(model)
            else:  # one process of its own, no DDP (not under torchrun): after the backward
                self.gradient_sync = self.replication.gradient_sync
        self.scaler = torch.amp.GradScaler("cuda") if numerics.grad_scaler else None
        pin = env.device.type == "cuda"
        # One loader per planned rank this rank plays (just its own, unless ranks are missing),
        # each drawing exactly what that rank of the planned world would.
        self.loaders, self.samplers = [], []
        for rank in self.virtual.ranks:
            loader, sampler = data.train_loader(
                splits.train,
                rank=rank,
                world_size=self.virtual.planned,
                batch_size=batch_per_rank,
                seed=config.run.seed,
                workers=config.data.workers,
                pin_memory=pin,
            )
            self.loaders.append(loader)
            self.samplers.append(sampler)
        self.sampler = self.samplers[0]
        self.val_loader = data.val_loader(
            splits.val,
            rank=env.rank,
            world_size=env.world_size,
            batch_size=batch_per_rank,
            workers=config.data.workers,
            pin_memory=pin,
        )
        self.steps_per_epoch = self.sampler.num_samples // batch_per_rank
        epochs = config.run.epochs
        self.total_steps = epochs * self.steps_per_epoch if epochs else config.run.steps
        self.position = Position()
        self.store = None
        self.stores: list[checkpoint.CheckpointStore] = []
        if config.checkpoint.checkpoint_dir:
            # A rank writes its checkpoint under the name of every planned rank it plays, so
            # that the directory holds what the planned world's would; it reads its own.
            self.stores = [
                checkpoint.CheckpointStore(
                    Path(config.checkpoint.checkpoint_dir), rank, config.checkpoint.keep
                )
                for rank in self.virtual.ranks
            ]
            self.store = self.stores[0]
        # A rank of the planned world: a job continued on fewer ranks runs with the same
        # arguments, and a planned rank that no longer runs is no one's.
        for flag, rank in (
            ("--step-delay-rank", config.run.step_delay_rank),
            ("--checkpoint-pause-rank", config.checkpoint.checkpoint_pause_rank),
        ):
            if rank is not None and not 0 <= rank < self.virtual.planned:
                raise UserError(
                    f"{flag} {rank} is not a rank of this job (0 to {self.virtual.planned - 1})"
                )
        if env.launched and dist.is_initialized():
            # A peer that never answers (its node or the network to it gone) fails the job
            # after this long, instead of the backend's default (10 min for NCCL, 30 for gloo).
            dist.set_timeout(timedelta(seconds=config.run.collective_timeout))
        self.node = os.environ.get("TMN_NODE_NAME") or socket.gethostname()
        self.own_time = self._own_time()
        self._pace_from = 0
        self._nodes: list[str] | None = None  # every rank's node, gathered at the first check
        # DDP's forward may first wait for a buffer broadcast: own time restarts when the
        # wrapped module itself starts.
        parallel.unwrap(model).register_forward_pre_hook(lambda *_: self.own_time.resume())

    # -- a healing replica group (FT=1) ---------------------------------------------------------

    def _replica_state(self) -> dict:
        """What a group that joins late receives from this one at a step boundary."""
        return {
            "model": parallel.unwrap(self.model).state_dict(),
            "optimizer": self._inner_optimizer.state_dict(),
            "position": vars(self.position).copy(),
        }

    def _load_replica_state(self, state: dict) -> None:
        parallel.unwrap(self.model).load_state_dict(state["model"])
        self._inner_optimizer.load_state_dict(state["optimizer"])
        self.position = Position(**state["position"])
        # The peer's optimizer holds the learning rate of its step before: this step's, as the
        # peer steps it.
        lr = learning_rate(self.config.optim, self.position.step, self.total_steps)
        for group in self._inner_optimizer.param_groups:
            group["lr"] = lr
        self._healed = True

    # -- checkpoints ---------------------------------------------------------------------------

    def resume(self) -> int | None:
        """Load the newest checkpoint step that every rank holds; the step, or None."""
        if self.store is None:
            return None
        settings = self.config.checkpoint
        self.store.check_writable()
        for store in self.stores:
            store.remove_temporaries()
        # Each rank's complete steps, and those it has a file of that is not (cut short).
        found = parallel.all_gather((self.store.steps(), self.store.seen()), self.env)
        plan = checkpoint.plan_resume(
            [steps for steps, _ in found],
            settings.resume,
            settings.checkpoint_dir,
            replicated=True,  # every data-parallel rank's file holds the same state
        )
        cut = {
            step: f"rank {rank}'s file is cut short"
            for rank, (steps, seen) in enumerate(found)
            for step in sorted(set(seen) - set(steps))
        }
        skipped = (
            None if settings.resume is False else complete.skipped([list(cut)], plan.step, cut)
        )
        say(self.env, *filter(None, [skipped, plan.message]))
        if plan.step is None:
            if settings.resume is False:
                for store in self.stores:
                    store.clear()
            parallel.barrier(self.env)  # nobody writes step files while another rank clears
            return None
        if plan.receivers:  # a node new to the job: the state comes from one that holds it
            assert plan.source is not None  # receivers have a source (plan_resume)
            held = self.store.load(plan.step) if self.env.rank == plan.source else None
            state = parallel.broadcast_state(held, plan.source, self.env)
        else:
            state = self.store.load(plan.step)
        # The planned world's: a checkpoint of a world of 3 resumes on 2 ranks planned for 3.
        expected = {"world_size": self.virtual.planned, "batch_per_rank": self.batch}
        for key, value in expected.items():
            if state[key] == value:
                continue
            if not self.virtual.active:
                raise UserError(
                    f"checkpoint step {plan.step} in {settings.checkpoint_dir} has {key} "
                    f"{state[key]}, this run has {value}: sampler positions would not match",
                    hint="--no-resume, or the original world size and --global-batch-size",
                )
            raise UserError(
                f"checkpoint step {plan.step} in {settings.checkpoint_dir} has {key} "
                f"{state[key]}, this run has {value} (on {self.env.world_size} ranks planned "
                f"for {self.virtual.planned}, {PLANNED_WORLD_VARIABLE}): sampler positions "
                "would not match",
                hint=f"--no-resume, or {PLANNED_WORLD_VARIABLE}={state['world_size']} and "
                "the original --global-batch-size",
            )
        parallel.unwrap(self.model).load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler is not None and state["scaler"] is not None:
            self.scaler.load_state_dict(state["scaler"])
        self.position = Position(**state["position"])
        # This rank's own generators. Playing other planned ranks, it neither restores theirs
        # (one set of generators per process) nor saves them (their files get this rank's):
        # the steps do not depend on it, as nothing here draws from them (data and
        # augmentation are seeded per sample, the models have no dropout).
        checkpoint.restore_rng_states(state["rng"], self.env.device)
        return plan.step

    def save(self) -> None:
        step, settings = self.position.step, self.config.checkpoint
        pause, pause_rank = None, settings.checkpoint_pause_rank
        if self.replication is not None:  # the job's rank, counted across the groups
            pause_rank = self.replication.group.own_rank(pause_rank, self.env.world_size)
        if settings.checkpoint_pause_step == step and pause_rank in (None, self.env.rank):

            def pause(temporary: Path) -> None:
                say_every_rank(
                    self.env,
                    f"checkpoint step {step}: {temporary.name} written, pausing "
                    f"{CHECKPOINT_PAUSE_SECONDS:.0f} s before the rename (--checkpoint-pause-step)",
                )
                time.sleep(CHECKPOINT_PAUSE_SECONDS)

        state = {
            "position": vars(self.position).copy(),
            "world_size": self.virtual.planned,
            "batch_per_rank": self.batch,
            "model": parallel.unwrap(self.model).state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "rng": checkpoint.rng_states(self.env.device),
        }
        for store in self.stores:  # its own file first, which pauses alone
            store.save(
                step, state, prune=False, before_rename=pause if store is self.store else None
            )
        # Older checkpoints go only once every rank holds this one: whichever rank dies while
        # writing, the others keep a step it holds too.
        self._collective(parallel.barrier, self.env)
        for store in self.stores:
            store.prune()

    def _collective(self, function, *args):
        """A collective of the trainer's own: waiting in it is not this rank's own time."""
        self.own_time.pause()
        try:
            return function(*args)
        finally:
            self.own_time.resume()

    # -- the loop ------------------------------------------------------------------------------

    def fit(self) -> TrainResult:
        run = self.config.run
        resumed_from = self.resume()
        if self.replication is not None and resumed_from:
            self.replication.resumed(resumed_from)
        if self.virtual.active:
            say(self.env, self.virtual.describe(self.batch))
        run_dir = Path(run.run_dir)
        writer = metrics.tensorboard_writer(self.env, run_dir, run.tensorboard)
        progress = metrics.Progress(
            self.env,
            total_steps=self.total_steps,
            batch_per_rank=self.batch,
            log_every=run.log_every,
            writer=writer,
            planned_world_size=self.virtual.planned,
        )
        steps_before = self.position.step
        try:
            seconds = self._train(progress, run_dir)
        finally:
            if self.replication is not None:
                # Its threads would otherwise keep a failed rank's process waiting at exit.
                self.replication.shutdown()
        val_accuracy, val_samples = self.evaluate()
        if writer is not None:
            writer.add_scalar("val/accuracy", val_accuracy, self.position.step)
            writer.close()
        trained = (self.position.step - steps_before) * self.batch * self.virtual.planned
        if self.replication is not None:  # the groups that took part in each step
            trained = self._group_batches * self.batch * self.env.world_size
        return TrainResult(
            steps=self.position.step,
            resumed_from=resumed_from,
            train_loss=progress.last.get("loss", float("nan")),
            train_accuracy=progress.last.get("accuracy", float("nan")),
            val_accuracy=val_accuracy,
            val_samples=val_samples,
            seconds=seconds,
            samples_per_second=trained / seconds if seconds else 0.0,
        )

    def _train(self, progress: metrics.Progress, run_dir: Path) -> float:
        """Every step to the last: the seconds they took."""
        replication = self.replication
        if replication is not None and replication.group.start_wait > 0:
            # Groups started together, at step 0 or each from its own newest checkpoint.
            replication.gather()
        started = time.perf_counter()
        self._pace_from = self.position.step + 1
        self.own_time = self._own_time()
        self.own_time.resume()
        self.model.train()
        with metrics.profiler(self.env, run_dir, self.config.run.profile) as profiler:
            while self.position.step < self.total_steps:
                self._epoch(progress, profiler)
        return time.perf_counter() - started

    def _epoch(self, progress: metrics.Progress, profiler) -> None:
        position = self.position
        for sampler in self.samplers:
            sampler.set_position(position.epoch, position.batch_in_epoch * self.batch)
        if hasattr(self.splits.train, "set_epoch"):
            self.splits.train.set_epoch(position.epoch)
        # A step's batch from each planned rank this rank plays: every loader yields the same
        # number of batches per epoch (DistributedSampler pads every rank's share to one size).
        healed = False
        for batches in zip(*self.loaders, strict=True):
            lr = learning_rate(self.config.optim, position.step, self.total_steps)
            micro_batches = self._step(batches, lr)
            committed = True
            if self.replication is not None:
                # A group that healed in this step holds its peer's position now: the step is
                # counted from there and the loaders start again from it. A step not committed
                # (a group lost mid-step) spends its batch and is done again with the next one.
                healed, self._healed = self._healed, False
                position = self.position
                committed = self.replication.committed() != position.step
            if committed:
                position.step += 1
            position.batch_in_epoch += 1
            if position.batch_in_epoch == self.steps_per_epoch:
                position.epoch, position.batch_in_epoch = position.epoch + 1, 0
            if not committed:
                say(self.env, f"step {position.step + 1} not committed: done again")
                if healed or position.batch_in_epoch == 0:
                    return
                continue
            for loss, logits, labels in micro_batches:
                progress.add(loss, logits, labels)
            self._collective(progress.maybe_report, position.step, lr)
            profiler.step()
            self._after_step()
            if position.step % self.config.run.log_every == 0 or position.step == self.total_steps:
                self._check_pace(position.step)
            if self.replication is not None:
                self._group_batches += self.replication.participants()
                line = self.replication.membership(position.step)
                if line is not None:
                    say(self.env, line)
                if healed:
                    say(self.env, f"healed from a peer: at step {position.step} with the others")
                    return
            if position.step == self.total_steps or position.batch_in_epoch == 0:
                return

    def _step(self, batches: tuple[tuple[torch.Tensor, torch.Tensor], ...], lr: float):
        """One optimizer step over one micro-batch per planned rank this rank plays (one,
        unless ranks are missing); each micro-batch's (loss, logits, labels)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        done = []
        for index, (images, labels) in enumerate(batches):
            last = index == len(batches) - 1
            images = images.to(self.env.device, non_blocking=True)
            labels = labels.to(self.env.device, non_blocking=True)
            if self.numerics.channels_last:
                images = images.contiguous(memory_format=torch.channels_last)
            # DDP all-reduces in the last micro-batch's backward only, once per step on every
            # rank whatever its count of micro-batches; the gradients of the others add up.
            with contextlib.nullcontext() if last else self._no_sync():
                self.own_time.pause()  # resumed by the forward pre-hook
                with self._autocast():
                    logits = self.model(images)
                    loss = F.cross_entropy(logits, labels)
                if last:
                    self.own_time.end_step()  # backward waits for the other ranks' gradients
                if index == 0:
                    self.optimizer.zero_grad(set_to_none=True)
                scaled = loss * self.virtual.loss_scale if self.virtual.active else loss
                if self.scaler is not None:
                    # Scaled alike for every micro-batch; step() unscales the sum once.
                    self.scaler.scale(scaled).backward()
                else:
                    scaled.backward()
            done.append((loss, logits, labels))
        if self.gradient_sync is not None:
            self.gradient_sync(self.model)
        self.own_time.resume()
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        return done

    def _no_sync(self):
        """DDP's no_sync(); nothing for a model synchronised by `gradient_sync` (after the
        last backward, once) or not at all (one process)."""
        no_sync = getattr(self.model, "no_sync", None)
        return no_sync() if no_sync is not None else contextlib.nullcontext()

    def _autocast(self):
        dtype = self.numerics.autocast_dtype
        return torch.autocast(self.env.device.type, dtype=dtype, enabled=dtype is not None)

    def _after_step(self) -> None:
        settings, step = self.config.checkpoint, self.position.step
        if self.store is not None and (
            step % settings.checkpoint_every == 0 or step == self.total_steps
        ):
            self.save()
        run = self.config.run
        if run.step_delay > 0 and run.step_delay_rank in (None, self.env.rank):
            time.sleep(run.step_delay)
        if settings.stop_after_step == step:
            # Every rank's checkpoint is on disk before anyone leaves, so the test is repeatable.
            parallel.barrier(self.env)
            say(self.env, f"stopping after step {step} (--stop-after-step): exit {STOP_EXIT_CODE}")
            sys.stdout.flush()
            os._exit(STOP_EXIT_CODE)

    def _own_time(self) -> OwnTime:
        return OwnTime() if self.config.run.slow_rank_factor > 0 else Untimed()

    def _check_pace(self, step: int) -> None:
        """Every rank's own time per step since the last check; rank 0 names a slow one."""
        factor, first = self.config.run.slow_rank_factor, self._pace_from
        self._pace_from = step + 1
        if factor <= 0 or not self.env.launched:
            return
        if self._nodes is None:
            self._nodes = self._collective(parallel.all_gather, self.node, self.env)
        # The numbers in one all_reduce (gathering Python objects took 2.4 ms on gloo; bench
        # section 17), the names once.
        shared = self._collective(parallel.share, list(self.own_time.take()), self.env)
        per_rank = [
            (seconds, waited, node)
            for (seconds, waited), node in zip(shared, self._nodes, strict=True)
        ]
        for slow in slow_ranks(own_work(per_rank), factor):
            say(
                self.env,
                f"warning: rank {slow.rank} on {slow.node} is slow: {slow.seconds:.3f} s of its "
                f"own work per step (median of steps {first}-{step}), the other ranks' median "
                f"{slow.others:.3f} s; every rank waits for it",
            )

    @torch.no_grad()
    def evaluate(self) -> tuple[float, int]:
        """Accuracy on the whole val split, each sample counted once across ranks."""
        # The bare module: DDP's forward would broadcast buffers, a collective that deadlocks
        # when val shards differ in batch count between ranks.
        model = parallel.unwrap(self.model)
        model.eval()
        correct = total = 0
        for images, labels in self.val_loader:
            images = images.to(self.env.device, non_blocking=True)
            labels = labels.to(self.env.device, non_blocking=True)
            if self.numerics.channels_last:
                images = images.contiguous(memory_format=torch.channels_last)
            with self._autocast():
                logits = model(images)
            correct += int((logits.argmax(dim=1) == labels).sum())
            total += labels.numel()
        model.train()
        correct_all, total_all = parallel.all_reduce_sum([correct, total], self.env)
        return correct_all / max(1, total_all), int(total_all)
