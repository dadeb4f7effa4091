"""The CUDA/NCCL image: the pinned wheels its default build installs carry every GPU library
(read from this run's venv, made from the same wheels), and the CUDA build on another base
(BASE_IMAGE=, NVIDIA's in real use) checked for real: refused when the torch it reports is older
than the minimum, labelled with it otherwise. Their own xdist group, beside the CPU twin's tests."""

from __future__ import annotations

import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT
from torch_multinode.cluster.engine import debian_base, docker, image_exists
from torch_multinode.cluster.versions import gpu_runs, oldest_capability
from torch_multinode.provision import images

pytestmark = pytest.mark.sim


def test_the_pinned_wheels_the_cuda_image_installs_carry_every_gpu_library():
    """What the default CUDA image's build installs is the pinned wheels this run's venv was
    made from (docker/Dockerfile: the same wheels, KEEP_GPU_LIBRARIES=1 keeps all of them), so
    the image's own report (cluster/versions.py, its `--version`) is read here from the venv:
    the pinned torch with CUDA 13, NCCL, cuDNN's engines and triton, kernels from Turing on.
    The 7 GB build itself left CI for its time (docs/ci-time.md, run 45); the Dockerfile's
    CUDA branch is built below on a small base, the CPU twin's install in tests/docker/, and
    `make selftest` runs the image on the first GPU node."""
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "cluster" / "versions.py")],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = images.read_report(proc.stdout)
    assert found["torch"] == f"{images.TORCH_VERSION}+cu130", found
    assert found["torchvision"].split("+")[0] == images.TORCHVISION_VERSION, found
    assert re.fullmatch(r"13\.\d+", found["cuda"]), found
    assert re.fullmatch(r"\d+\.\d+\.\d+", found["nccl"]), found
    assert found["cudnn-engines"] == "present", found
    assert re.fullmatch(r"\d+\.\d+\.\d+", found["triton"]), found
    # Its kernels: Turing (7.5) and newer, no Volta; README says so, netcheck checks it.
    assert oldest_capability(found["cuda-archs"]) == "7.5", found
    assert not gpu_runs(found["cuda-archs"], "7.0"), found


# A stand-in for NVIDIA's image, made here from the Debian base: a `torch` package that only
# says its version, and the other modules the Dockerfile's check imports.
FAKE_TORCH = """\
from types import SimpleNamespace as _Namespace

__version__ = "{version}"
version = _Namespace(cuda=None)
backends = _Namespace(cudnn=_Namespace(version=lambda: None))
distributed = _Namespace(is_nccl_available=lambda: False)
cuda = _Namespace(is_available=lambda: False, device_count=lambda: 0)
"""


@pytest.fixture
def base_with_torch(tmp_path):
    debian_base(images.CPU_BASE_IMAGE, images.CPU_BASE_PACKAGES)
    made: list[str] = []

    def make(version: str) -> str:
        tag = f"tmn-fake-torch-base:{uuid.uuid4().hex[:8]}"
        context = tmp_path / tag.split(":")[1]
        site = context / "site"
        (site / "torch").mkdir(parents=True)
        (site / "torch" / "__init__.py").write_text(FAKE_TORCH.format(version=version))
        for module in ("torchvision", "tensorboard", "yaml", "numpy"):
            (site / f"{module}.py").write_text('__version__ = "0.0.0"\n')
        (context / "Dockerfile").write_text(
            f"FROM {images.CPU_BASE_IMAGE}\nCOPY site/ /usr/lib/python3/dist-packages/\n"
        )
        docker("build", "--quiet", "-t", tag, str(context))
        made.append(tag)
        return tag

    yield make
    for tag in made:
        docker("rmi", tag, check=False)


def test_a_base_whose_torch_is_older_than_the_minimum_is_refused_and_removed(base_with_torch):
    base = base_with_torch("2.10.0a0+b558c986e8.nv25.12")  # what NVIDIA's 25.12 carries
    tag = f"tmn-refused:{uuid.uuid4().hex[:8]}"
    try:
        proc = subprocess.run(
            [
                str(Path(sys.executable).parent / "cluster"),
                "image",
                "--kind",
                "cuda",
                "--base-image",
                base,
                "--tag",
                tag,
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        assert proc.returncode == 1, proc.stdout + proc.stderr
        # The build's progress, then one error line.
        lines = proc.stderr.splitlines()
        assert [line for line in lines if line.startswith("Error:")] == lines[-1:], proc.stderr
        assert lines[-1] == (
            f"Error: base {base} carries torch 2.10.0a0+b558c986e8.nv25.12, older than the 2.14 "
            "this project needs (try make image without BASE_IMAGE, the default build with the "
            "pinned torch 2.14.1, or a newer NVIDIA release)"
        )
        assert not image_exists(tag)  # nothing half-made under the name
    finally:
        docker("rmi", tag, check=False)


def test_a_base_whose_torch_meets_the_minimum_is_labelled_with_it(base_with_torch):
    base = base_with_torch("2.14.0a0+4c1f3b2.nv26.10")
    tag = f"tmn-accepted:{uuid.uuid4().hex[:8]}"
    try:
        built = images.build("cuda", tag, progress=lambda _: None, base_image=base)
        assert built.torch == "2.14.0a0+4c1f3b2.nv26.10" == images.torch_label(tag)
        found = images.versions(tag)
        assert found["torch"] == built.torch and found["cudnn-engines"] == "unknown", found
        assert found["triton"] == "none" and found["nccl"] == "none", found
        assert found["cuda-archs"] == "none", found  # a torch without torch._C still answers
    finally:
        docker("rmi", tag, check=False)
