"""What a step computes in, and at what rate: --precision resolved for the device (Numerics), the
optimizer and the learning-rate schedule. One owner for both loops: training.loop.trainer's
(ddp, manual_dp) and training.fsdp's."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from torch_multinode.cluster.errors import UserError


@dataclass(frozen=True)
class Numerics:
    autocast_dtype: torch.dtype | None
    grad_scaler: bool
    channels_last: bool
    name: str


def resolve_numerics(precision: str, device: torch.device) -> Numerics:
    """What --precision means on this device; auto never picks fp16: only ddp can scale its loss.

    auto on a GPU without native bf16 (Turing's T4, Volta's V100) is fp32, although their fp16
    tensor cores are their fast path (a T4: 65 TFLOP/s against 8.1). fp16 needs a GradScaler,
    and auto is also training.fsdp's default, which has none (FSDP2 in fp16 unscaled loses its
    small gradients); in training.ddp a --comm-hook powersgd beside auto cannot be refused on
    the controller as beside fp16 is (the GPU is not known there), and an overflowing step
    would leave NaN in PowerSGD's error feedback for good. --precision fp16 asks for it by name.
    bf16/fp16 autocast and channels_last are GPU-only."""
    if device.type != "cuda":
        if precision in ("bf16", "fp16"):
            raise UserError(
                f"--precision {precision} needs a GPU; this run is on CPU", hint="--precision fp32"
            )
        return Numerics(None, False, False, "fp32")
    if precision == "auto":
        # Native bf16 only (Ampere and later): by default torch also counts the emulated bf16 of
        # a T4 (Turing), slower than fp32. torch asks the current device, which the caller has
        # made this rank's (parallel.use_device) so that GPU 0 is not asked in every rank.
        native = torch.cuda.is_bf16_supported(including_emulation=False)
        precision = "bf16" if native else "fp32"
    dtypes = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
    return Numerics(dtypes[precision], precision == "fp16", True, precision)


def build_optimizer(config, parameters) -> torch.optim.Optimizer:
    return torch.optim.SGD(
        parameters, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay
    )


def learning_rate(config, step: int, total_steps: int) -> float:
    """The rate for step `step` (0-based): a pure function of the step, so nothing to checkpoint."""
    warmup = max(1, config.warmup_steps)
    if step < warmup or config.schedule == "constant":
        return config.lr * min(1.0, (step + 1) / warmup)
    progress = (step - warmup) / max(1, total_steps - warmup)
    return config.lr * 0.5 * (1 + math.cos(math.pi * progress))
