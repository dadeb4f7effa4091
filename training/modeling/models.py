"""The image classifiers the data-parallel workloads train."""

from __future__ import annotations

from torch import nn


class TinyCNN(nn.Module):
    """Two convolutions and a linear head, no BatchNorm: nothing depends on the batch split,
    so data-parallel training can be compared parameter for parameter with one process."""

    def __init__(self, num_classes: int, width: int = 16):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.classifier = nn.Linear(2 * width, num_classes)

    def forward(self, images):
        return self.classifier(self.features(images))


def build_model(name: str, num_classes: int) -> nn.Module:
    if name == "tiny":
        return TinyCNN(num_classes)
    # torchvision's import costs seconds (it pulls in torch._dynamo): only pay it when used.
    from torchvision import models

    return getattr(models, name)(weights=None, num_classes=num_classes)


def count_parameters(model: nn.Module) -> int:
    return sum(parameter.numel() for parameter in model.parameters())
