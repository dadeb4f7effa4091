"""ResNet-50 split over two devices computes what the unsplit model does, and replicates
under DDP."""

from __future__ import annotations

import copy

import pytest
import torch
from torchvision.models import resnet50

from tests.training.conftest import run_main
from torch_multinode.training import model_parallel
from torch_multinode.training.model_parallel import (
    ModelParallelResNet50,
    PipelinedModelParallelResNet50,
)

CPU2 = ("cpu", "cpu")


@pytest.fixture(scope="module")
def reference():
    torch.manual_seed(0)
    return resnet50(weights=None, num_classes=10), torch.randn(3, 3, 64, 64)


@pytest.mark.parametrize("training", [True, False])
def test_the_two_stage_model_equals_the_unsplit_one(reference, training):
    model, images = reference
    unsplit = copy.deepcopy(model).train(training)
    split = ModelParallelResNet50(devices=CPU2, base=copy.deepcopy(model)).train(training)
    with torch.no_grad():
        assert torch.equal(split(images), unsplit(images))


def test_the_pipelined_model_equals_the_unsplit_one_in_eval(reference):
    model, images = reference
    # Micro-batches of 2 and then 1: the last one is short.
    pipelined = PipelinedModelParallelResNet50(
        split_size=2, devices=CPU2, base=copy.deepcopy(model)
    ).eval()
    with torch.no_grad():
        assert torch.allclose(pipelined(images), copy.deepcopy(model).eval()(images), atol=1e-5)
    # Weights are moved, not copied: both stages hold exactly the base model's tensors.
    assert sum(p.numel() for p in pipelined.parameters()) == sum(
        p.numel() for p in model.parameters()
    )


def test_ddp_over_two_two_stage_replicas_keeps_them_equal(torchrun):
    run = torchrun(
        "training.model_parallel",
        "--batch-size",
        "4",
        "--image-size",
        "32",
        "--steps",
        "2",
        "--split-size",
        "2",
    )
    assert run.returncode == 0, run.explain()
    assert run.lines("stages   ") == [
        "stages   conv1..layer2 on cpu, layer3..fc on cpu (pipelined, micro-batches of 2)"
    ]
    digests = run.digests()
    assert sorted(digests) == [0, 1] and digests[0] == digests[1]


def test_a_micro_batch_too_small_for_batchnorm_is_bad_input(capsys):
    argv = ["--batch-size", "5", "--split-size", "2", "--image-size", "32"]
    code, _, err = run_main(model_parallel.main, argv, capsys)
    assert (code, err) == (
        2,
        (
            "Error: a micro-batch of 1 image(s) at 32px leaves layer4's BatchNorm 1 value per "
            "channel; training needs at least 2 (try --image-size 64, or micro-batches of 2 or "
            "more images)\n"
        ),
    )
