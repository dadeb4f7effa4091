"""Datasets and the per-rank loaders over them.

Every sample is a pure function of (seed, epoch, index): synthetic images are generated from
their index, and augmentation draws from a generator seeded per sample. Which worker loads a
sample therefore never matters, and a resumed run sees bit-identical batches.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import pickle
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from torch_multinode.cluster.errors import UserError

CIFAR10_TRAIN_FILES = tuple(f"data_batch_{number}" for number in range(1, 6))
CIFAR10_TEST_FILE = "test_batch"
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
_SPLIT_OFFSET = {"train": 0, "val": 1 << 40}  # val samples never coincide with train samples


def _generator(*seeds: int | str) -> torch.Generator:
    # torch's CPU generator keeps only the low 32 bits of a seed, so the parts are hashed
    # into 32 bits rather than combined arithmetically (which would collide above 2**32).
    digest = hashlib.blake2b(repr(seeds).encode(), digest_size=4).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little"))


class SyntheticImages(Dataset):
    """Learnable generated images: a fixed smooth pattern per class plus gaussian noise.

    The class patterns come from `seed` alone, so train and val share them; each sample's
    label and noise come from (seed, split, index).
    """

    def __init__(
        self, *, split: str, size: int, num_classes: int, image_size: int, noise: float, seed: int
    ):
        self.split, self.size, self.num_classes = split, size, num_classes
        self.image_size, self.noise, self.seed = image_size, noise, seed
        coarse = torch.randn(num_classes, 3, 4, 4, generator=_generator(seed))
        self.patterns = F.interpolate(coarse, size=image_size, mode="bilinear", align_corners=False)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        generator = _generator(self.seed, _SPLIT_OFFSET[self.split] + index)
        label = int(torch.randint(self.num_classes, (), generator=generator))
        noise = torch.randn(self.patterns.shape[1:], generator=generator)
        return self.patterns[label] + self.noise * noise, label


class Cifar10(Dataset):
    """CIFAR-10 from the python pickle batches (cifar-10-batches-py), normalized."""

    def __init__(self, directory: Path, *, split: str, image_size: int):
        files = CIFAR10_TRAIN_FILES if split == "train" else (CIFAR10_TEST_FILE,)
        images: list = []  # numpy arrays
        labels: list[int] = []
        for name in files:
            batch = _unpickle(directory / name)
            images.append(np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
            labels.extend(int(label) for label in batch[b"labels"])
        self.images = torch.from_numpy(np.concatenate(images))
        self.labels = labels
        self.image_size = image_size
        self.mean = torch.tensor(CIFAR10_MEAN).view(3, 1, 1)
        self.std = torch.tensor(CIFAR10_STD).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image = (self.images[index].float() / 255 - self.mean) / self.std
        if self.image_size != image.shape[-1]:
            image = F.interpolate(image[None], size=self.image_size, mode="bilinear")[0]
        return image, self.labels[index]


def _unpickle(path: Path) -> dict:
    try:
        with path.open("rb") as file:
            batch = pickle.load(file, encoding="bytes")
    except FileNotFoundError:
        raise UserError(
            f"CIFAR-10 batch {path} is missing (needs {', '.join(CIFAR10_TRAIN_FILES)} and "
            f"{CIFAR10_TEST_FILE})",
            hint="extracting cifar-10-python.tar.gz into --data-dir on every node",
        ) from None
    except (pickle.UnpicklingError, EOFError, ValueError) as error:
        raise UserError(f"{path} is not a CIFAR-10 python batch: {error}") from None
    if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
        raise UserError(f"{path} is not a CIFAR-10 python batch: no data/labels entries")
    return batch


class Augmented(Dataset):
    """Random crop (zero padding of 1/8 of the side) and horizontal flip, seeded per sample.

    The epoch is part of the seed; set it before each epoch's loader iterator is created so
    the workers (started per epoch) receive it.
    """

    def __init__(self, dataset: Dataset, seed: int):
        self.dataset, self.seed, self.epoch = dataset, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image, label = self.dataset[index]
        generator = _generator(self.seed, self.epoch, index)
        side = image.shape[-1]
        pad = max(1, side // 8)
        top, left = torch.randint(2 * pad + 1, (2,), generator=generator).tolist()
        image = F.pad(image, (pad, pad, pad, pad))[:, top : top + side, left : left + side]
        if torch.rand((), generator=generator) < 0.5:
            image = image.flip(-1)
        return image, label


@dataclass
class Splits:
    train: Dataset
    val: Dataset
    num_classes: int
    description: str


def build_splits(config, seed: int) -> Splits:
    """The train and val datasets a DataConfig names."""
    if config.dataset == "synthetic":
        common = dict(
            num_classes=config.num_classes,
            image_size=config.image_size,
            noise=config.noise,
            seed=seed,
        )
        train = SyntheticImages(split="train", size=config.train_samples, **common)
        val = SyntheticImages(split="val", size=config.val_samples, **common)
        return Splits(
            train,
            val,
            config.num_classes,
            _describe("synthetic", config, train, val, config.num_classes),
        )
    if not config.data_dir:
        raise UserError(f"--dataset {config.dataset} needs --data-dir")
    root = Path(config.data_dir)
    if not root.is_dir():
        raise UserError(f"--data-dir {root} is not a directory on this node")
    if config.dataset == "cifar10":
        if (root / "cifar-10-batches-py").is_dir():
            root = root / "cifar-10-batches-py"
        train = Cifar10(root, split="train", image_size=config.image_size)
        val = Cifar10(root, split="val", image_size=config.image_size)
        num_classes = 10
    else:
        train, val, num_classes = _image_folders(root, config.image_size)
    if config.augment:
        train = Augmented(train, seed)
    return Splits(
        train, val, num_classes, _describe(config.dataset, config, train, val, num_classes)
    )


def _image_folders(root: Path, image_size: int) -> tuple[Dataset, Dataset, int]:
    from torchvision import datasets, transforms

    for split in ("train", "val"):
        if not (root / split).is_dir():
            raise UserError(f"imagefolder needs {root / split}/<class>/<image> files")
    transform = transforms.Compose(
        [
            transforms.Resize(image_size),
            transforms.CenterCrop(image_size),
            transforms.ToTensor(),
            transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ]
    )
    try:
        train = datasets.ImageFolder(str(root / "train"), transform=transform)
        val = datasets.ImageFolder(str(root / "val"), transform=transform)
    except (FileNotFoundError, OSError) as error:
        raise UserError(f"imagefolder {root}: {error}") from None
    if train.classes != val.classes:
        only_train = sorted(set(train.classes) - set(val.classes))
        only_val = sorted(set(val.classes) - set(train.classes))
        raise UserError(
            f"{root}: train/ and val/ hold different classes (only in train: {only_train}, "
            f"only in val: {only_val})"
        )
    return train, val, len(train.classes)


def _describe(name: str, config, train: Dataset, val: Dataset, num_classes: int) -> str:
    side = config.image_size
    return f"{name}, {num_classes} classes, 3x{side}x{side}, {len(train)} train / {len(val)} val"


class ResumableSampler(DistributedSampler):
    """DistributedSampler that can start part-way into an epoch, where a checkpoint left off."""

    def __init__(self, dataset: Dataset, **kwargs):
        super().__init__(dataset, **kwargs)
        self.start = 0

    def set_position(self, epoch: int, start: int) -> None:
        """Epoch `epoch`, skipping the first `start` of this rank's samples."""
        self.set_epoch(epoch)
        self.start = start

    def __iter__(self):
        return itertools.islice(super().__iter__(), self.start, None)

    def __len__(self) -> int:
        return self.num_samples - self.start


def train_loader(
    dataset: Dataset,
    *,
    rank: int,
    world_size: int,
    batch_size: int,
    seed: int,
    workers: int,
    pin_memory: bool,
) -> tuple[DataLoader, ResumableSampler]:
    sampler = ResumableSampler(
        dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=False
    )
    if sampler.num_samples < batch_size:
        raise UserError(
            f"train split of {len(dataset)} samples gives {sampler.num_samples} per rank over "
            f"{world_size} ranks, fewer than the per-rank batch {batch_size}"
        )
    apply_sharing_strategy()
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=workers,
        pin_memory=pin_memory,
        drop_last=True,
        # Worker seeds come from here, not from the global RNG, whose state checkpoints carry.
        generator=torch.Generator().manual_seed(seed),
    )
    return loader, sampler


def apply_sharing_strategy(environ: dict[str, str] | None = None) -> str | None:
    """TMN_SHARING_STRATEGY (the training image sets file_system) picks how DataLoader workers
    hand tensors back: file_system keeps working when /dev/shm is Docker's default 64 MB, where
    the default file_descriptor strategy fails with "Bus error" once batches are large."""
    wanted = (os.environ if environ is None else environ).get("TMN_SHARING_STRATEGY")
    if not wanted:
        return None
    import torch.multiprocessing

    if wanted not in torch.multiprocessing.get_all_sharing_strategies():
        raise UserError(
            f"TMN_SHARING_STRATEGY={wanted!r} is not one of "
            f"{', '.join(sorted(torch.multiprocessing.get_all_sharing_strategies()))}"
        )
    torch.multiprocessing.set_sharing_strategy(wanted)
    return wanted


def val_loader(
    dataset: Dataset, *, rank: int, world_size: int, batch_size: int, workers: int, pin_memory: bool
) -> DataLoader:
    # A strided shard without DistributedSampler's padding, so every sample counts exactly once.
    shard = range(rank, len(dataset), world_size)
    return DataLoader(
        dataset, batch_size=batch_size, sampler=shard, num_workers=workers, pin_memory=pin_memory
    )
