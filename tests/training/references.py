"""What distributed runs are compared with: the same training in one process. Shared by the
local tests and the simulated cluster's."""

from __future__ import annotations

import json
import re

import torch
import torch.nn.functional as F
from torch.utils.data import DistributedSampler, default_collate

from torch_multinode.training import pipeline
from torch_multinode.training.fsdp import build_optimizer
from torch_multinode.training.loop.data import SyntheticImages, build_splits
from torch_multinode.training.loop.numerics import learning_rate
from torch_multinode.training.modeling import gpt
from torch_multinode.training.modeling.models import build_model
from torch_multinode.training.settings import arguments
from torch_multinode.training.settings.config import TrainConfig

WORLD_SIZE = 2
"""The DDP reference's ranks."""
STEPS, BATCH, CLASSES, WIDTH, SIZE, SEED = 3, 16, 10, 8, 16, 0
"""The pipeline reference's run."""


def ddp_in_one_process(config: TrainConfig, steps: int) -> torch.nn.Module:
    """Training in one process, on each step's global batch: rank 0's DistributedSampler slice
    followed by rank 1's, epoch after epoch, as the two DDP ranks see them."""
    seed = config.run.seed
    torch.manual_seed(seed)
    splits = build_splits(config.data, seed)
    model = build_model(config.model.model, splits.num_classes)
    optim = config.optim
    # A constant learning rate, so it can be written out.
    assert (optim.warmup_steps, optim.schedule) == (1, "constant")
    optimizer = torch.optim.SGD(
        model.parameters(), lr=optim.lr, momentum=optim.momentum, weight_decay=optim.weight_decay
    )
    per_rank = optim.global_batch_size // WORLD_SIZE
    samplers = [
        DistributedSampler(splits.train, num_replicas=WORLD_SIZE, rank=rank, seed=seed)
        for rank in range(WORLD_SIZE)
    ]
    step, epoch = 0, 0
    while step < steps:
        orders = []
        for sampler in samplers:
            sampler.set_epoch(epoch)
            orders.append(list(sampler))
        for start in range(0, len(orders[0]) - per_rank + 1, per_rank):
            indices = [i for order in orders for i in order[start : start + per_rank]]
            images, labels = default_collate([splits.train[i] for i in indices])
            optimizer.zero_grad()
            F.cross_entropy(model(images), labels).backward()
            optimizer.step()
            step += 1
            if step == steps:
                break
        epoch += 1
    return model


def pipeline_in_one_process():
    """The whole model in one process: losses per step, final parameters, last gradients."""
    model = pipeline.build_model(CLASSES, WIDTH, SEED)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    dataset = SyntheticImages(
        split="train", size=4 * BATCH, num_classes=CLASSES, image_size=SIZE, noise=1.0, seed=SEED
    )
    losses = []
    for images, labels in pipeline.batches(dataset, BATCH, STEPS):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    gradients = {name: p.grad.clone() for name, p in model.named_parameters()}
    return losses, model.state_dict(), gradients


# -- training.fsdp: the small GPT's run, and what its output says ------------------------------

STEPS = 20
SMALL = (
    "--layers",
    "2",
    "--width",
    "32",
    "--heads",
    "4",
    "--seq-len",
    "16",
    "--global-batch-size",
    "8",
    "--lr",
    "0.01",
    "--steps",
    str(STEPS),
    "--log-every",
    "1",
    "--checkpoint-every",
    "5",
)
PROGRESS = re.compile(r"^step +(\d+)/\d+  loss ([\d.]+)  grad norm ([\d.]+)", re.M)


def progress(stdout: str) -> dict[int, tuple[float, float]]:
    """step -> (loss, gradient norm before clipping), from the progress lines."""
    return {int(s): (float(loss), float(norm)) for s, loss, norm in PROGRESS.findall(stdout)}


def digest(stdout: str) -> str:
    (found,) = re.findall(r"^parameters +sha256 ([0-9a-f]{64})$", stdout, re.M)
    return found


def bench_row(stdout: str) -> dict:
    (line,) = [line for line in stdout.splitlines() if line.startswith("BENCH ")]
    return json.loads(line.removeprefix("BENCH "))


def reference(steps: int = STEPS):
    """The same training in this process on a plain GPT: each step's whole global batch, plain
    tensors, torch's clip_grad_norm_. (model, {step: (loss, norm before clipping)})."""
    config = arguments.fsdp(list(SMALL))
    source = gpt.build_data(config)
    m = config.model
    torch.manual_seed(config.run.seed)
    model = gpt.GPT(gpt.Shape(m.layers, m.width, m.heads, m.seq_len, source.vocab_size))
    optimizer = build_optimizer(model, config.optim)
    found = {}
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(config.optim, step, STEPS)
        loss = gpt.loss_of(model, source.batch(step, config.optim.global_batch_size))
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.optim.grad_clip)
        optimizer.step()
        optimizer.zero_grad()
        found[step + 1] = (loss.item(), norm.item())
    return model, found
