"""Progress lines, TensorBoard scalars and profiler traces. Rank 0 reports; sums span all ranks."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch

from torch_multinode.training.distributed import parallel
from torch_multinode.training.settings.console import say

PROFILE_WAIT, PROFILE_WARMUP, PROFILE_ACTIVE = 1, 1, 3


class Progress:
    """Accumulates loss and accuracy on the device (no sync per step) and reports every N steps.
    `add` takes each micro-batch a rank ran (one per step, or one per planned rank it plays where
    ranks are missing: training.loop.virtual_ranks); `maybe_report` ends each step. Loss and
    accuracy are means over every sample of every rank, whatever each rank's count of them."""

    def __init__(
        self,
        env: parallel.DistEnv,
        *,
        total_steps: int,
        batch_per_rank: int,
        log_every: int,
        writer=None,
        planned_world_size: int | None = None,
    ):
        self.env, self.total_steps, self.batch = env, total_steps, batch_per_rank
        self.planned = planned_world_size or env.world_size
        self.log_every, self.writer = log_every, writer
        self.sums = torch.zeros(2, dtype=torch.float64, device=env.device)  # loss, correct
        self.samples = 0
        self.steps_since = 0
        self.since = time.perf_counter()
        self.last: dict[str, float] = {}

    def add(self, loss: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor) -> None:
        correct = (logits.argmax(dim=1) == labels).sum()
        self.sums += torch.stack([loss.detach().double() * labels.numel(), correct.double()])
        self.samples += labels.numel()

    def maybe_report(self, step: int, lr: float) -> None:
        self.steps_since += 1
        if step % self.log_every and step != self.total_steps:
            return
        loss_sum, correct, count = parallel.all_reduce_sum(
            [*self.sums.tolist(), self.samples], self.env
        )
        elapsed = time.perf_counter() - self.since
        # A step's samples are the planned world's (batch_per_rank each): per rank that runs,
        # the mean over them.
        per_rank = self.steps_since * self.batch * self.planned / self.env.world_size / elapsed
        self.last = {
            "loss": loss_sum / count,
            "accuracy": correct / count,
            "samples_per_second_per_rank": per_rank,
            "samples_per_second": per_rank * self.env.world_size,
        }
        width = len(str(self.total_steps))
        say(
            self.env,
            (
                f"step {step:>{width}}/{self.total_steps}  loss {self.last['loss']:.4f}  "
                f"acc {100 * self.last['accuracy']:5.1f}%  lr {lr:.4g}  "
                f"{per_rank:,.0f} samples/s/rank  "
                f"{self.last['samples_per_second']:,.0f} samples/s total"
            ),
        )
        if self.writer is not None:
            for name, value in self.last.items():
                self.writer.add_scalar(f"train/{name}", value, step)
            self.writer.add_scalar("train/lr", lr, step)
        self.sums.zero_()
        self.samples = self.steps_since = 0
        self.since = time.perf_counter()


def tensorboard_writer(env: parallel.DistEnv, run_dir: Path, enabled: bool):
    """A SummaryWriter on rank 0, or None (with one message) when tensorboard is missing."""
    if not enabled or not env.is_main:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        say(env, "TensorBoard is not installed: skipping scalars (pip install tensorboard)")
        return None
    return SummaryWriter(log_dir=str(run_dir / "tensorboard"))


def profiler(env: parallel.DistEnv, run_dir: Path, enabled: bool):
    """A torch.profiler over a few early steps, one trace file per rank; call .step() per step."""
    if not enabled:
        return contextlib.nullcontext(_NoProfiler())
    from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

    activities = [ProfilerActivity.CPU]
    if env.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    return _SettledProfiler(
        profile(
            activities=activities,
            schedule=schedule(
                wait=PROFILE_WAIT, warmup=PROFILE_WARMUP, active=PROFILE_ACTIVE, repeat=1
            ),
            on_trace_ready=tensorboard_trace_handler(
                str(run_dir / "profile"), worker_name=f"rank{env.rank}"
            ),
        )
    )


# A gloo collective wakes its waiter first and ends its profiler record afterwards, on gloo's own
# thread (c10::ivalue::Future::markCompleted notifies, then runs callbacks). Stopping the profiler
# in that instant races with the record's end: glibc aborts the rank ("malloc(): unsorted double
# linked list corrupted", seen once in CI). A pause before the stop lets those threads finish.
PROFILER_SETTLE_SECONDS = 0.2


class _SettledProfiler:
    """torch.profiler.profile whose stop (the last recorded step's .step(), or the end of the
    with-block inside the recorded steps) waits for collectives' threads to settle first."""

    def __init__(self, profile):
        self._profile = profile

    def __enter__(self):
        self._profile.__enter__()
        return self

    def __exit__(self, *exc):
        if self._recording():
            time.sleep(PROFILER_SETTLE_SECONDS)
        return self._profile.__exit__(*exc)

    def step(self) -> None:
        from torch.profiler import ProfilerAction

        if self._profile.current_action == ProfilerAction.RECORD_AND_SAVE:
            time.sleep(PROFILER_SETTLE_SECONDS)
        self._profile.step()

    def _recording(self) -> bool:
        from torch.profiler import ProfilerAction

        return self._profile.current_action in (
            ProfilerAction.RECORD,
            ProfilerAction.RECORD_AND_SAVE,
        )


class _NoProfiler:
    def step(self) -> None:
        pass
