"""Which GPUs a torch build can run on: a CUDA 13 build of torch has kernels for compute
capability 7.5 (Turing) and newer only, so a V100 (7.0) fails at its first kernel ("no kernel
image is available"); netcheck's software check names such a GPU before any job."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO_ROOT
from torch_multinode.cluster.versions import cuda_archs, gpu_runs, oldest_capability

# torch 2.14.1's CUDA 13.0 wheel, as its build constant says (torch.cuda.get_arch_list()).
CU130 = "sm_75 sm_80 sm_86 sm_90 sm_100 sm_120"


@pytest.mark.parametrize(
    ("archs", "capability", "runs"),
    [
        (CU130, "7.0", False),  # V100: Volta, dropped by CUDA 13
        (CU130, "6.1", False),  # GTX 1080: Pascal
        (CU130, "7.5", True),  # T4, RTX 20xx
        (CU130, "8.9", True),  # L4, RTX 40xx: sm_86's binary runs on 8.9
        (CU130, "12.1", True),  # sm_120's binary runs on 12.1
        ("sm_80 sm_90", "7.5", False),  # nothing of major 7
        ("sm_80 compute_80", "9.0", True),  # no sm_90, but PTX the driver compiles
        ("sm_80 compute_80", "10.0", True),
        ("sm_90a", "9.0", True),  # an arch-specific suffix
        (CU130, "N/A", True),  # nvidia-smi had nothing to say: nothing to refuse
    ],
)
def test_a_gpu_runs_a_build_with_a_binary_of_its_major_or_ptx_no_newer(archs, capability, runs):
    assert gpu_runs(archs, capability) is runs


def test_the_oldest_capability_is_read_from_the_arch_list():
    assert oldest_capability(CU130) == "7.5"
    assert oldest_capability("sm_90 sm_100 compute_100") == "9.0"
    assert oldest_capability("") == "unknown"


def test_the_pinned_torch_is_a_cuda_13_build_without_volta():
    # The controller's torch is the pinned wheel the images install (tests/test_torch_api.py):
    # what README says of GPU generations is this build's own list.
    archs = cuda_archs(torch)
    assert torch.version.cuda is not None and torch.version.cuda.startswith("13."), torch.version
    assert archs is not None
    assert oldest_capability(archs) == "7.5", archs
    assert not gpu_runs(archs, "7.0") and gpu_runs(archs, "7.5")


def test_the_node_probe_lists_each_gpus_compute_capability(tmp_path):
    # nvidia-smi as it answers on a node with a V100 and an A100 (the probe runs it by name).
    smi = tmp_path / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\n"
        'case "$*" in\n'
        '  -L) printf "GPU 0: Tesla V100-SXM2-16GB (UUID: a)\\nGPU 1: NVIDIA A100 (UUID: b)\\n";;\n'
        '  *driver_version*) printf "580.95.05\\n580.95.05\\n";;\n'
        '  *compute_cap*) printf "Tesla V100-SXM2-16GB, 7.0\\nNVIDIA A100-SXM4-40GB, 8.0\\n";;\n'
        "esac\n"
    )
    smi.chmod(0o755)
    done = subprocess.run(
        [sys.executable, str(REPO_ROOT / "netcheck" / "softprobe.py")],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"},
    )
    found = json.loads(done.stdout)
    assert found["gpu_capabilities"] == [
        ["Tesla V100-SXM2-16GB", "7.0"],
        ["NVIDIA A100-SXM4-40GB", "8.0"],
    ]
    assert found["nvidia_smi_gpus"] == 2 and found["driver"] == "580.95.05"
    assert found["cuda_archs"] == cuda_archs(torch)
