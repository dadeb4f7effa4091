"""Two DDP processes end with the parameters of one process trained on the same global batches.

The tiny model has no BatchNorm, so nothing depends on how a global batch is split: DDP's
averaged gradient is the gradient of the mean loss over the global batch, up to float rounding.
"""

from __future__ import annotations

import torch

from tests.training.conftest import REFERENCE_STEPS, TINY, max_difference
from tests.training.references import ddp_in_one_process
from torch_multinode.training.distributed.parallel import parameter_digest
from torch_multinode.training.modeling.models import build_model
from torch_multinode.training.settings import config as config_module
from torch_multinode.training.settings.config import TrainConfig


def test_two_ddp_ranks_equal_one_process_on_the_same_global_batches(reference_ddp):
    run = reference_ddp.finished
    digests = run.digests()
    assert sorted(digests) == [0, 1], run.explain()
    assert digests[0] == digests[1], "the two replicas diverged"

    config = config_module.parse(TrainConfig, [*TINY, "--steps", str(REFERENCE_STEPS)])
    expected = ddp_in_one_process(config, REFERENCE_STEPS)
    assert max_difference(expected.state_dict(), reference_ddp.state) < 1e-6

    # The written model is the one the ranks reported, and training moved it.
    trained = build_model("tiny", 10)
    trained.load_state_dict(reference_ddp.state)
    assert parameter_digest(trained) == digests[0]
    torch.manual_seed(config.run.seed)
    assert max_difference(build_model("tiny", 10).state_dict(), reference_ddp.state) > 1e-2
