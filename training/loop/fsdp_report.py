"""What training.fsdp measures and says: the bytes each rank holds against one unsharded
replica, the training clock, the header, a progress line every --log-every steps, and at the
end the summary (with peak memory and MFU on GPUs), the `BENCH {json}` row (--bench) and the
exported model. The training itself (wrapping, the loop, checkpoints) is training/fsdp.py's."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from torch_multinode.training.ddp import save_model
from torch_multinode.training.distributed import parallel
from torch_multinode.training.modeling import gpt, models
from torch_multinode.training.settings import console

BYTE_PARTS = ("parameters", "gradients", "optimizer state")


def held_bytes(model: nn.Module, optimizer) -> dict[str, tuple[int, int]]:
    """Per part: (bytes this rank holds, from its local shards; bytes one unsharded replica
    holds). Gradients exist between backward and the next zero_grad."""

    def sizes(tensor: torch.Tensor) -> tuple[int, int]:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        return local.numel() * local.element_size(), tensor.numel() * tensor.element_size()

    parameters = list(model.parameters())
    parts = {
        "parameters": [sizes(p) for p in parameters],
        "gradients": [sizes(p.grad) for p in parameters if p.grad is not None],
        "optimizer state": [
            sizes(value)
            for state in optimizer.state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor)
        ],
    }
    return {
        name: (sum(h for h, _ in found), sum(u for _, u in found)) for name, found in parts.items()
    }


class Clock:
    """Training time: the device's queued work included (synchronised at every reading),
    checkpoints and test delays not."""

    def __init__(self, device: torch.device):
        self.device, self.total, self._since = device, 0.0, 0.0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def start(self) -> None:
        self._sync()
        self._since = time.perf_counter()

    def stop(self) -> None:
        self._sync()
        self.total += time.perf_counter() - self._since


@dataclass
class Progress:
    """What the next progress line reports, and the run's measured part: every step but this
    run's first (lazy initialisation and first allocations)."""

    losses: list[torch.Tensor] = field(default_factory=list)
    window_steps: int = 0  # measured steps since the last line
    window_tokens: int = 0  # their tokens
    window_from: float = 0.0  # the clock's total at the last line
    measured_steps: int = 0
    measured_tokens: int = 0
    scope: str = "total"  # whose tokens: the job's, or (FT=1) this node's group's
    last_loss: float = float("nan")


def header(
    config, env, source, model: gpt.GPT, batch: int, numerics, planned: int | None = None
) -> list[str]:
    shape, parameters = model.shape, models.count_parameters(model)
    strategy = (
        "FSDP2 (fully_shard per block and root)"
        if config.model.strategy == "fsdp"
        else "DDP (a whole replica per rank)"
    )
    extras = [
        name
        for name, on in (
            ("activation checkpointing", config.model.activation_checkpointing),
            ("torch.compile", config.model.compile),
        )
        if on
    ]
    world = env.describe() if env.launched else f"1 process (a group of one), {env.device.type}"
    optim = config.optim
    clip = f"clip {optim.grad_clip:g}" if optim.grad_clip > 0 else "no clipping"
    ranks = planned or env.world_size  # the planned world's, where the job continues on fewer
    return [
        f"world    {world}",
        f"data     {source.describe()}",
        f"batch    {batch} sequences of {shape.seq_len} tokens per rank x {ranks} "
        f"ranks = {batch * ranks * shape.seq_len:,} tokens per step",
        f"steps    {config.run.steps}, AdamW lr {optim.lr:g} ({optim.warmup_steps} warmup, "
        f"{optim.schedule}), weight decay {optim.weight_decay:g}, {clip}",
        f"model    GPT {shape.layers} blocks, width {shape.width}, {shape.heads} heads, "
        f"{parameters / 1e6:.2f}M parameters, {numerics.name}, {strategy}"
        + "".join(f", {extra}" for extra in extras),
    ]


def continuing(global_batch: int, world_size: int, planned: int) -> str:
    """The line of a job continued on fewer ranks than planned. Every sequence's loss is its
    own, whichever rank computes it: the ranks split the planned global batch as evenly as it
    goes (gpt.rank_slice) and weigh their mean losses by their share (train), which is the
    planned world's step, with no micro-batches (ddp's virtual ranks are for its samplers and
    BatchNorm)."""
    fewest, most = global_batch // world_size, -(-global_batch // world_size)
    each = f"{fewest}" if fewest == most else f"{fewest} or {most}"
    return (
        f"continuing on {world_size} of {planned} planned ranks: global batch {global_batch} "
        f"kept, {each} sequences per rank"
    )


@dataclass
class Result:
    held: dict[str, tuple[int, int]]  # part -> (this rank's bytes, an unsharded replica's)
    progress: Progress
    seconds: float  # of the measured steps


def report_progress(env, progress, clock_total, steps, lr, norm) -> None:
    """One progress line: the loss averaged over the ranks and the steps since the last line,
    the last step's gradient norm (before clipping), tokens/s of the measured steps."""
    step, total = steps
    count = len(progress.losses)
    local = torch.stack(progress.losses).sum().item()
    loss_sum, seconds = parallel.all_reduce_sum([local, clock_total - progress.window_from], env)
    seconds /= env.world_size  # the ranks' mean
    if progress.window_steps and seconds > 0:
        rate = progress.window_tokens / seconds
        speed = f"{rate / env.world_size:,.0f} tokens/s/rank  {rate:,.0f} tokens/s {progress.scope}"
    else:
        speed = "(the first step is not timed)"
    progress.last_loss = loss_sum / (count * env.world_size)
    progress.losses, progress.window_from = [], clock_total
    progress.window_steps = progress.window_tokens = 0
    console.say(
        env,
        f"step {step:>{len(str(total))}}/{total}  loss {progress.last_loss:.4f}  grad norm "
        f"{norm.item():.4f}  lr {lr:.4g}  {speed}",
    )


def finish(config, env, model, shape, source, result: Result, start_step, numerics, export):
    """Per rank what it holds; rank 0: the summary, the BENCH line (--bench), the export."""
    held = result.held
    mine = sum(h for h, _ in held.values())
    unsharded = sum(u for _, u in held.values())
    parts = " + ".join(f"{name} {held[name][0]:,} B" for name in BYTE_PARTS)
    console.say_every_rank(
        env,
        f"holds {parts} = {mine:,} B; one unsharded replica {unsharded:,} B "
        f"({mine / unsharded:.3f})",
    )
    peak = torch.cuda.max_memory_allocated(env.device) if env.device.type == "cuda" else None
    per_rank = parallel.all_gather((mine, peak), env)
    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if not env.is_main:
        return
    with torch.device("meta"):
        plain = gpt.GPT(shape)
    plain.load_state_dict(full, assign=True)  # the gathered tensors, no copy
    digest = parallel.parameter_digest(plain)
    progress = result.progress
    measured = progress.measured_steps
    rate = progress.measured_tokens / result.seconds if result.seconds > 0 else 0.0
    resumed = f" (resumed from step {start_step})" if start_step else ""
    ratio = max(m for m, _ in per_rank) / unsharded
    lines = [
        "-" * 60,
        f"steps          {config.run.steps}{resumed}",
        f"time           {result.seconds:.2f} s for {measured} steps (this run's first not "
        f"timed): {rate:,.0f} tokens/s {progress.scope}, {rate / env.world_size:,.0f} "
        "tokens/s/rank",
        f"train loss     {progress.last_loss:.4f} (steps since the previous report)",
        f"memory         per rank at most {ratio:.3f} of one unsharded replica's parameters, "
        f"gradients and optimizer state ({max(m for m, _ in per_rank):,} of {unsharded:,} B)",
    ]
    row = {
        "workload": "fsdp",
        "strategy": config.model.strategy,
        "world_size": env.world_size,
        "device": env.device.type,
        "precision": numerics.name,
        "shape": shape.as_dict(),
        "steps": measured,
        "seconds": result.seconds,
        "tokens_per_second": rate,
        "tokens_per_second_per_rank": rate / env.world_size,
        "bytes_held": [m for m, _ in per_rank],
        "bytes_unsharded": unsharded,
        "bytes_ratio": ratio,
        "loss": progress.last_loss,
    }
    if env.device.type == "cuda":
        lines += gpu_lines(config, env, shape, numerics, rate, [p for _, p in per_rank], row)
    lines += [f"parameters     sha256 {digest}", "-" * 60]
    console.say(env, *lines)
    if config.run.bench:
        console.emit(console.BENCH_PREFIX + json.dumps(row))
    if export:
        save_model(export, plain)
        sidecar = {
            "shape": shape.as_dict(),
            "characters": getattr(source, "characters", None),
            "loads_into": "training.modeling.gpt.GPT(training.modeling.gpt.Shape(**shape))",
        }
        Path(f"{export}.json").write_text(json.dumps(sidecar, indent=1) + "\n", encoding="utf-8")
        console.say(env, f"model state_dict written to {export} (its shape in {export}.json)")


def gpu_lines(config, env, shape, numerics, rate, peaks, row) -> list[str]:
    """Peak memory and model FLOPs utilisation (CUDA only)."""
    name = torch.cuda.get_device_name(env.device)
    busiest = max(peaks)
    lines = [
        f"peak memory    {busiest / 2**30:.2f} GiB allocated on the busiest GPU "
        f"(torch.cuda.max_memory_allocated; {name})"
    ]
    peak = config.run.peak_tflops or gpt.peak_tflops(name, numerics.name)
    row["peak_memory_bytes"] = peaks
    if peak is None:
        lines.append(
            f"MFU            unknown: no {numerics.name} peak TFLOP/s known for {name} "
            "(give --peak-tflops)"
        )
        return lines
    per_gpu = rate / env.world_size
    utilisation = gpt.mfu(per_gpu, shape, peak)
    row["mfu"] = utilisation
    lines.append(
        f"MFU            {100 * utilisation:.1f}% ({per_gpu * gpt.flops_per_token(shape) / 1e12:.1f} "
        f"of {peak:g} TFLOP/s per GPU at {numerics.name})"
    )
    return lines
