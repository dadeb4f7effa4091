"""What distributed runs are compared with: the same training in one process. Shared by the
local tests and the simulated cluster's."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import DistributedSampler, default_collate

from training import pipeline
from training.config import TrainConfig
from training.data import SyntheticImages, build_splits
from training.models import build_model

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
