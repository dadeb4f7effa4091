"""Two DDP processes end with the parameters of one process trained on the same global batches.

The tiny model has no BatchNorm, so nothing depends on how a global batch is split: DDP's
averaged gradient is the gradient of the mean loss over the global batch, up to float rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import DistributedSampler, default_collate

from tests.training.conftest import REFERENCE_STEPS, TINY, max_difference
from training import config as config_module
from training.config import TrainConfig
from training.data import build_splits
from training.models import build_model
from training.parallel import parameter_digest

WORLD_SIZE = 2


def one_process(config: TrainConfig, steps: int) -> torch.nn.Module:
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


def test_two_ddp_ranks_equal_one_process_on_the_same_global_batches(reference_ddp):
    run = reference_ddp.finished
    digests = run.digests()
    assert sorted(digests) == [0, 1], run.explain()
    assert digests[0] == digests[1], "the two replicas diverged"

    config = config_module.parse(TrainConfig, [*TINY, "--steps", str(REFERENCE_STEPS)])
    expected = one_process(config, REFERENCE_STEPS)
    assert max_difference(expected.state_dict(), reference_ddp.state) < 1e-6

    # The written model is the one the ranks reported, and training moved it.
    trained = build_model("tiny", 10)
    trained.load_state_dict(reference_ddp.state)
    assert parameter_digest(trained) == digests[0]
    torch.manual_seed(config.run.seed)
    assert max_difference(build_model("tiny", 10).state_dict(), reference_ddp.state) > 1e-2
