"""The default CUDA/NCCL image, built the way `make image KIND=cuda` builds it on any machine
(no GPU and no registry account needed): the pinned torch the tests run, with NCCL, cuDNN's
engines and triton kept. And another base (BASE_IMAGE=, NVIDIA's in real use) checked for real:
refused when the torch it reports is older than the minimum. Their own xdist group: a 7 GB build
beside the CPU twin's tests."""

from __future__ import annotations

import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from torch_multinode.cluster.engine import debian_base, docker, image_exists
from torch_multinode.cluster.versions import gpu_runs, oldest_capability
from torch_multinode.provision import images

# A name of this run's own: another test run on the same engine builds its own beside it.
TAG = f"torch-multinode/train:cuda-test-{uuid.uuid4().hex[:8]}"

pytestmark = pytest.mark.sim


def test_the_cuda_image_carries_the_pinned_torch_and_every_gpu_library():
    built = images.build("cuda", TAG, progress=lambda _: None)
    try:
        assert built.kind == "cuda"
        found = images.versions(TAG)
        assert found["torch"].split("+")[0] == images.TORCH_VERSION == "2.14.1", found
        assert found["torchvision"].split("+")[0] == images.TORCHVISION_VERSION, found
        assert re.fullmatch(r"13\.\d+", found["cuda"]), found
        assert re.fullmatch(r"\d+\.\d+\.\d+", found["nccl"]), found
        assert found["cudnn-engines"] == "present", found
        assert re.fullmatch(r"\d+\.\d+\.\d+", found["triton"]), found
        assert found["gpus"] == "0"  # no GPU here: the report needs none
        # Its kernels: Turing (7.5) and newer, no Volta; README says so, netcheck checks it.
        assert oldest_capability(found["cuda-archs"]) == "7.5", found
        assert not gpu_runs(found["cuda-archs"], "7.0"), found
        # The label holds the torch exactly as the image reported it.
        assert built.torch == found["torch"] == images.torch_label(TAG)
        # ... and the CUDA and NCCL, which each node's lock and run record read from the labels.
        assert images.stack_labels(TAG) == {f: found[f] for f in ("torch", "cuda", "nccl")}
        environment = docker("image", "inspect", "--format", "{{json .Config.Env}}", TAG).stdout
        assert "CUDA_DEVICE_ORDER=PCI_BUS_ID" in environment
        assert "NVIDIA_DRIVER_CAPABILITIES=compute,utility" in environment
        assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in environment
        # torch.compile works: triton builds its launcher (a Python C extension) with the base's
        # gcc and Python's headers, shown here by triton's own build function; inductor's CPU
        # path (the one this machine without a GPU can run) compiles its C++ kernels. And
        # rdma-core's userspace libraries are there for NCCL's InfiniBand/RoCE transport.
        proc = docker(
            "run",
            "--rm",
            TAG,
            "python3",
            "-c",
            COMPILE_PROBE,
            C_EXTENSION,
            timeout=900,
            check=False,
        )
        assert proc.stdout.split() == ["launcher", "42", "compiled", "ibverbs"], proc.stderr[-3000:]
        libraries = docker("run", "--rm", TAG, "ldconfig", "-p").stdout
        for library in ("libibverbs.so.1", "librdmacm.so.1", "libmlx5.so.1"):
            assert library in libraries, library
    finally:
        docker("rmi", TAG, check=False)  # 6 GB that no other test uses


# What triton compiles for its launcher, in miniature: a Python C extension.
C_EXTENSION = """\
#include <Python.h>
static PyObject *answer(PyObject *self, PyObject *args) { return PyLong_FromLong(42); }
static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, ""}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "tmn_probe", NULL, -1, methods};
PyMODINIT_FUNC PyInit_tmn_probe(void) { return PyModule_Create(&module); }
"""
COMPILE_PROBE = """\
import ctypes, sys
import torch
from triton.runtime.build import compile_module_from_src
print("launcher", compile_module_from_src(sys.argv[1], "tmn_probe").answer())
def f(x):
    return torch.sin(x) * 2 + x
x = torch.randn(64)
assert torch.allclose(torch.compile(f)(x), f(x))
print("compiled")
ctypes.CDLL("libibverbs.so.1")
print("ibverbs")
"""

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
