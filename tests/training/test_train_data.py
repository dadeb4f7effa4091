"""Datasets and samplers: deterministic, learnable, loaded from the real on-disk formats."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from PIL import Image

from torch_multinode.cluster.errors import UserError
from torch_multinode.training.loop.data import (
    CIFAR10_MEAN,
    CIFAR10_STD,
    CIFAR10_TRAIN_FILES,
    Augmented,
    ResumableSampler,
    SyntheticImages,
    build_splits,
)
from torch_multinode.training.settings.config import DataConfig


def write_cifar10(directory, per_batch: int = 20):
    """The CIFAR-10 python format: pickled dicts of uint8 rows (R, G, B planes) and labels.
    Image i of each batch is filled with the value i; its label is i % 10."""
    directory.mkdir(parents=True)
    for name in (*CIFAR10_TRAIN_FILES, "test_batch"):
        data = np.repeat(np.arange(per_batch, dtype=np.uint8)[:, None], 3072, axis=1)
        batch = {
            b"batch_label": name.encode(),
            b"data": data,
            b"labels": [i % 10 for i in range(per_batch)],
            b"filenames": [f"{i}.png".encode() for i in range(per_batch)],
        }
        (directory / name).write_bytes(pickle.dumps(batch))
    return directory


def synthetic(**overrides) -> SyntheticImages:
    settings = dict(split="train", size=500, num_classes=4, image_size=8, noise=2.0, seed=0)
    return SyntheticImages(**{**settings, **overrides})


def test_synthetic_samples_are_a_function_of_seed_split_and_index():
    image, label = synthetic()[7]
    again, same_label = synthetic()[7]
    assert torch.equal(image, again) and label == same_label
    assert image.shape == (3, 8, 8) and 0 <= label < 4
    assert not torch.equal(synthetic(seed=1)[7][0], image)
    assert not torch.equal(synthetic(split="val")[7][0], image)


def test_synthetic_classes_are_learnable_from_their_patterns():
    train, val = synthetic(), synthetic(split="val", size=200)
    assert torch.equal(train.patterns, val.patterns)  # both splits share the class patterns
    # The nearest class mean of the training samples already classifies validation well.
    images = torch.stack([train[i][0] for i in range(len(train))]).flatten(1)
    labels = torch.tensor([train[i][1] for i in range(len(train))])
    means = torch.stack([images[labels == c].mean(0) for c in range(4)])
    val_images = torch.stack([val[i][0] for i in range(len(val))]).flatten(1)
    val_labels = torch.tensor([val[i][1] for i in range(len(val))])
    accuracy = (torch.cdist(val_images, means).argmin(1) == val_labels).float().mean()
    assert accuracy > 0.9
    assert sorted(set(labels.tolist())) == [0, 1, 2, 3]


def test_cifar10_is_read_from_the_pickle_batches(tmp_path):
    root = write_cifar10(tmp_path / "cifar-10-batches-py")
    config = DataConfig(dataset="cifar10", data_dir=str(tmp_path), image_size=32, augment=False)
    splits = build_splits(config, seed=0)
    assert (len(splits.train), len(splits.val), splits.num_classes) == (100, 20, 10)
    image, label = splits.train[23]  # second batch, image 3
    assert label == 3 and image.shape == (3, 32, 32)
    expected = (torch.tensor(3 / 255) - torch.tensor(CIFAR10_MEAN)) / torch.tensor(CIFAR10_STD)
    assert torch.allclose(image[:, 0, 0], expected)
    (root / "data_batch_4").unlink()
    with pytest.raises(UserError, match=f"CIFAR-10 batch {root / 'data_batch_4'} is missing"):
        build_splits(config, seed=0)
    (root / "data_batch_4").write_bytes(b"not a pickle")
    with pytest.raises(UserError, match="is not a CIFAR-10 python batch"):
        build_splits(config, seed=0)


def test_imagefolder_counts_classes_and_resizes(tmp_path):
    for split, count in (("train", 3), ("val", 1)):
        for name, colour in (("cat", (255, 0, 0)), ("dog", (0, 0, 255))):
            (tmp_path / split / name).mkdir(parents=True)
            for i in range(count):
                Image.new("RGB", (40, 30), colour).save(tmp_path / split / name / f"{i}.png")
    config = DataConfig(dataset="imagefolder", data_dir=str(tmp_path), image_size=16)
    splits = build_splits(config, seed=0)
    assert (len(splits.train), len(splits.val), splits.num_classes) == (6, 2, 2)
    image, label = splits.val[1]
    assert label == 1 and image.shape == (3, 16, 16)
    assert image[2].mean() > image[0].mean()  # dog is blue
    (tmp_path / "val" / "bird").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "val" / "bird" / "0.png")
    with pytest.raises(UserError, match=r"only in train: \[\], only in val: \['bird'\]"):
        build_splits(config, seed=0)


def test_augmentation_depends_on_seed_epoch_and_index_only():
    dataset = synthetic(noise=0.0, size=64)
    augmented = Augmented(dataset, seed=0)
    first = [augmented[i][0] for i in range(16)]
    assert all(torch.equal(a, augmented[i][0]) for i, a in enumerate(first))
    assert any(not torch.equal(a, dataset[i][0]) for i, a in enumerate(first))
    augmented.set_epoch(1)
    assert any(not torch.equal(a, augmented[i][0]) for i, a in enumerate(first))


def test_the_sampler_resumes_mid_epoch_with_the_same_order():
    dataset = list(range(50))
    full = ResumableSampler(dataset, num_replicas=2, rank=1, seed=3)
    full.set_position(epoch=2, start=0)
    resumed = ResumableSampler(dataset, num_replicas=2, rank=1, seed=3)
    resumed.set_position(epoch=2, start=10)
    assert list(resumed) == list(full)[10:] and len(resumed) == 15
    full.set_position(epoch=3, start=0)
    assert list(full) != list(resumed)


def test_cifar10_trains_end_to_end(python_module, tmp_path):
    write_cifar10(tmp_path / "cifar")
    run = python_module(
        "training.ddp",
        "--dataset",
        "cifar10",
        "--data-dir",
        str(tmp_path / "cifar"),
        "--model",
        "tiny",
        "--global-batch-size",
        "20",
        "--epochs",
        "2",
        "--log-every",
        "5",
        "--workers",
        "1",
    )
    assert run.returncode == 0, run.explain()
    assert run.lines("data     ") == ["data     cifar10, 10 classes, 3x32x32, 100 train / 20 val"]
    assert "steps    10, 5 per epoch" in run.stdout.splitlines()
    assert run.lines("val accuracy") and run.lines("step 10/10")
