"""A local job asks torch for this machine's GPUs only where the machine shows a sign of an
NVIDIA GPU: elsewhere torch's import (seconds of CPU at every launch) is skipped."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from torch_multinode.launch.nodes import local_gpu_count, signs_of_an_nvidia_gpu


def _pci(root: Path, slot: str, vendor: str, kind: str) -> None:
    device = root / "sys/bus/pci/devices" / slot
    device.mkdir(parents=True)
    (device / "vendor").write_text(f"{vendor}\n")
    (device / "class").write_text(f"{kind}\n")


@pytest.fixture
def asked(monkeypatch) -> list[str]:
    """A stand-in for torch that counts 3 GPUs and records that it was asked."""
    calls: list[str] = []
    cuda = SimpleNamespace(
        is_available=lambda: calls.append("is_available") or True,
        device_count=lambda: calls.append("device_count") or 3,
    )
    monkeypatch.setitem(sys.modules, "torch", SimpleNamespace(cuda=cuda))
    return calls


def test_a_machine_without_any_sign_counts_no_gpu_without_asking_torch(tmp_path, asked):
    _pci(tmp_path, "0000:00:01.0", "0x1af4", "0x020000")  # a virtio NIC
    _pci(tmp_path, "0000:00:02.0", "0x10de", "0x040300")  # NVIDIA, but an audio function
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev/nvidia-caps").mkdir()  # not a GPU's device file
    assert not signs_of_an_nvidia_gpu(tmp_path)
    assert local_gpu_count(tmp_path) == 0
    assert asked == []


@pytest.mark.parametrize(
    "sign",
    ["dev/nvidia0", "dev/dxg", "proc/driver/nvidia", "pci 3D controller", "pci VGA"],
)
def test_any_sign_of_an_nvidia_gpu_asks_torch(tmp_path, asked, sign):
    if sign.startswith("pci"):
        _pci(tmp_path, "0000:17:00.0", "0x10de", "0x030200" if "3D" in sign else "0x030000")
    else:
        (tmp_path / sign).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / sign).touch()
    assert signs_of_an_nvidia_gpu(tmp_path)
    assert local_gpu_count(tmp_path) == 3
    assert asked == ["is_available", "device_count"]
