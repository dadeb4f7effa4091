"""training.fsdp's typed config: the GPT's shape, its data, AdamW, distributed checkpoints.

Torch-free, like training.settings.config, whose parser it uses (flags over a --config YAML file over
these defaults): `train` checks these settings on the controller.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from torch_multinode.cluster.errors import UserError, shown
from torch_multinode.training.settings.config import SCHEDULES, STOP_EXIT_CODE, doc

STRATEGIES = ("fsdp", "ddp")
PRECISIONS = ("auto", "fp32", "bf16")


@dataclass
class GPTConfig:
    """The decoder-only transformer (GPT-style, defined in training/modeling/gpt.py) and how it runs."""

    layers: int = doc("transformer blocks", default=4)
    width: int = doc("model width (embedding size); a multiple of --heads", default=128)
    heads: int = doc("attention heads per block", default=4)
    seq_len: int = doc("tokens per training sequence (the context length)", default=64)
    vocab_size: int = doc(
        "synthetic data: tokens in the vocabulary (a --data file brings its own: its characters)",
        default=64,
    )
    strategy: str = doc(
        "fsdp: fully_shard every block and the root, so each rank holds 1/world of the "
        "parameters, gradients and optimizer state; ddp: DistributedDataParallel, every rank "
        "holds all of it (to compare with)",
        choices=STRATEGIES,
        default="fsdp",
    )
    precision: str = doc(
        "auto is bf16 parameters and compute with fp32 gradient reduction on GPUs with native "
        "bf16, fp32 otherwise; bf16 needs a GPU",
        choices=PRECISIONS,
        default="auto",
    )
    activation_checkpointing: bool = doc(
        "recompute each block's activations in backward instead of keeping them: less memory, "
        "about one more forward pass of compute",
        default=False,
    )
    compile: bool = doc(
        "torch.compile every block; needs a C++ compiler and Python's headers on CPUs, triton "
        "and a C compiler on GPUs (checked at start)",
        default=False,
    )


@dataclass
class TokenDataConfig:
    """What the model learns: synthetic token chains, or a text file character by character."""

    data: str | None = doc(
        "a UTF-8 text file on every node, learnt character by character; unset: synthetic "
        "chains in which every token has a fixed successor"
    )
    noise: float = doc(
        "synthetic: probability that a token is followed by a random token instead of its "
        "successor (sets the loss the model can reach)",
        default=0.1,
    )


@dataclass
class AdamWConfig:
    """Batch and optimizer: AdamW, learning rate warmed up linearly, then decayed."""

    global_batch_size: int = doc("sequences per step over all ranks; split evenly", default=16)
    lr: float = doc("peak learning rate", default=0.003)
    weight_decay: float = doc("AdamW's decoupled weight decay", default=0.1)
    warmup_steps: int = doc("steps over which the learning rate ramps up linearly", default=5)
    schedule: str = doc(
        "after warmup: cosine decay to zero at the last step, or constant",
        choices=SCHEDULES,
        default="cosine",
    )
    grad_clip: float = doc(
        "clip the norm of the whole gradient (over every rank's shards) to this; 0: no clipping",
        default=1.0,
    )


@dataclass
class DCPConfig:
    """Distributed checkpoints (torch.distributed.checkpoint): every rank writes its own shards
    into one directory per step, which exists only once complete."""

    checkpoint_dir: str | None = doc(
        "directory of the checkpoints; on storage every node sees (such as /shared) a run "
        "resumes at any world size, on node-local disks at the one it was saved at; unset: none"
    )
    checkpoint_every: int = doc("steps between checkpoints (the last step is always saved)", 50)
    keep: int = doc("complete checkpoints kept, newest first", default=3)
    resume: bool | None = doc(
        "resume from the newest checkpoint every rank sees; default: resume when the directory "
        "holds one; --no-resume deletes them and starts over"
    )
    replicate: bool = doc(
        "on node-local disks, copy each node's files of every checkpoint to the next node (a "
        "ring over the nodes, in the background, over the job's own connection), so that the "
        "others resume without any one lost node; --no-replicate: each node keeps its own only",
        default=True,
    )
    replication_mbps: float = doc(
        "the copies' bandwidth cap, megabits per second sent per node; 0: none", default=500.0
    )
    export: str | None = doc(
        "at the end, write the whole model (gathered to rank 0) to this file: an ordinary "
        "torch.save state_dict, for inference without torch.distributed; relative paths go "
        "to the launcher's run directory"
    )
    stop_after_step: int | None = doc(
        f"test hook: exit with code {STOP_EXIT_CODE} once this step is done and checkpointed"
    )
    checkpoint_pause_step: int | None = doc(
        "test hook: the checkpoint of this step pauses 120 s once this rank's files are "
        "written, before the step directory takes its name (a write to kill a node in); once "
        "per checkpoint directory, so that a restart writes on"
    )
    checkpoint_pause_rank: int | None = doc(
        "test hook: only this rank pauses in --checkpoint-pause-step (default: every rank; "
        "with FT=1 the job's rank, counted across the groups)"
    )
    hold_after_step: int | None = doc(
        "test hook: once this step is done, --hold-rank sleeps 120 s (a node to kill between "
        "checkpoints); once per --checkpoint-dir, so that a restart goes on"
    )
    hold_rank: int | None = doc(
        "test hook: only this rank sleeps after --hold-after-step (default: every rank; with "
        "FT=1 the job's rank, counted across the groups)"
    )
    replication_pause_step: int | None = doc(
        "test hook: the copy of this step's checkpoint to the next node pauses 120 s once its "
        "first piece is sent (a copy in flight, to kill a node in)"
    )
    replication_pause_rank: int | None = doc(
        "test hook: only the directory of this rank pauses in --replication-pause-step "
        "(default: every directory)"
    )


@dataclass
class GPTRunConfig:
    """Length, seed, reporting."""

    steps: int = doc("optimizer steps to train for", default=60)
    seed: int = doc("seed for weights and data; same on every rank", default=0)
    log_every: int = doc("steps between progress lines", default=10)
    bench: bool = doc(
        "rank 0 also prints the summary as one `BENCH {json}` line (what make bench reads)",
        default=False,
    )
    peak_tflops: float | None = doc(
        "GPUs: the GPU's peak TFLOP/s at this run's precision, for model FLOPs utilisation; "
        "default: from a table of known GPUs (training/modeling/gpt.py)"
    )
    collective_timeout: float = doc(
        "seconds a collective waits for the other ranks before the job fails, from the first "
        "step on",
        default=300.0,
    )
    step_delay: float = doc(
        "test hook: seconds every rank sleeps after each step (a slow job to interrupt)", 0.0
    )


@dataclass
class FSDPConfig:
    """Everything `python -m training.fsdp` takes."""

    model: GPTConfig = field(default_factory=GPTConfig)
    data: TokenDataConfig = field(default_factory=TokenDataConfig)
    optim: AdamWConfig = field(default_factory=AdamWConfig)
    checkpoint: DCPConfig = field(default_factory=DCPConfig)
    run: GPTRunConfig = field(default_factory=GPTRunConfig)


def check(config: FSDPConfig) -> None:
    """The settings that are wrong whatever the cluster looks like."""
    for section in dataclasses.fields(config):
        values = getattr(config, section.name)
        for item in dataclasses.fields(values):
            value = getattr(values, item.name)
            if isinstance(value, float) and not math.isfinite(value):
                flag = "--" + item.name.replace("_", "-")
                raise UserError(f"{flag} must be a finite number, got {value}")
    model, optim, run = config.model, config.optim, config.run
    at_least = {
        "--layers": (model.layers, 1),
        "--width": (model.width, 1),
        "--heads": (model.heads, 1),
        "--seq-len": (model.seq_len, 1),
        "--vocab-size": (model.vocab_size, 2),
        "--global-batch-size": (optim.global_batch_size, 1),
        "--warmup-steps": (optim.warmup_steps, 0),
        "--steps": (run.steps, 1),
        "--log-every": (run.log_every, 1),
        "--checkpoint-every": (config.checkpoint.checkpoint_every, 1),
        "--keep": (config.checkpoint.keep, 1),
        "--lr": (optim.lr, 0),
        "--weight-decay": (optim.weight_decay, 0),
        "--grad-clip": (optim.grad_clip, 0),
        "--noise": (config.data.noise, 0),
        "--step-delay": (run.step_delay, 0),
        "--replication-mbps": (config.checkpoint.replication_mbps, 0),
    }
    for flag, (value, minimum) in at_least.items():
        if value < minimum:
            raise UserError(f"{flag} must be at least {minimum}, got {shown(value)}")
    if model.width % model.heads:
        raise UserError(
            f"--width {model.width} does not split into {model.heads} heads "
            f"({model.width} % {model.heads} = {model.width % model.heads})",
            hint=f"--width {max(1, model.width // model.heads) * model.heads}",
        )
    if config.data.noise > 1:
        raise UserError(f"--noise is a probability, at most 1, got {config.data.noise}")
    if run.peak_tflops is not None and run.peak_tflops <= 0:
        raise UserError(f"--peak-tflops must be positive, got {run.peak_tflops}")
    if not 0 < run.collective_timeout <= 86400:
        raise UserError(
            f"--collective-timeout must be above 0 and at most 86400 s, got "
            f"{run.collective_timeout}"
        )
    if not -(2**63) <= run.seed < 2**64:
        raise UserError(
            f"--seed {shown(run.seed)} is outside what torch.manual_seed takes (-2**63 to 2**64-1)"
        )
