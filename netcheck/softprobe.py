"""Node side of the software check: what the training interpreter sees. Prints one JSON line.

Shipped as source (`PYTHON -c SOURCE`) so that a node whose torch or netcheck is missing still
answers, saying what is missing, instead of failing to start.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import shutil
import subprocess
import sys


def probe() -> dict:
    found = {"python": platform.python_version(), "executable": sys.executable}
    try:
        import torch
        import torch.distributed as dist

        found["torch"] = torch.__version__
        found["cuda"] = torch.version.cuda
        found["cuda_available"] = bool(torch.cuda.is_available())
        found["gpus"] = torch.cuda.device_count() if found["cuda_available"] else 0
        try:
            found["nccl"] = ".".join(str(part) for part in torch.cuda.nccl.version())
        except Exception:  # noqa: BLE001 - CPU-only builds have no NCCL
            found["nccl"] = None
        # The GPU architectures its kernels were built for (a CUDA build's constant, no GPU
        # needed); None on a CPU build.
        arch_flags = getattr(getattr(torch, "_C", None), "_cuda_getArchFlags", None)
        found["cuda_archs"] = (arch_flags() or None) if arch_flags else None
        found["gloo"] = bool(dist.is_available() and dist.is_gloo_available())
        found["nccl_backend"] = bool(dist.is_available() and dist.is_nccl_available())
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        found["torch_error"] = f"{type(exc).__name__}: {exc}"
    try:
        import netcheck  # noqa: F401 - the collective workers run as `python -m netcheck...`

        found["netcheck"] = True
    except Exception:  # noqa: BLE001
        found["netcheck"] = False
    try:
        stat = os.statvfs("/dev/shm")
        found["shm_bytes"] = stat.f_frsize * stat.f_blocks
    except OSError:
        found["shm_bytes"] = None
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    found["memlock_bytes"] = -1 if soft == resource.RLIM_INFINITY else soft  # -1: unlimited
    found["nvidia_smi_gpus"] = None
    if shutil.which("nvidia-smi"):
        try:
            out = _nvidia_smi("-L")
            found["nvidia_smi_gpus"] = sum(line.startswith("GPU ") for line in out.splitlines())
            driver = _nvidia_smi("--query-gpu=driver_version", "--format=csv,noheader").split()
            found["driver"] = driver[0] if driver else None
            listed = _nvidia_smi("--query-gpu=name,compute_cap", "--format=csv,noheader")
            found["gpu_capabilities"] = [
                [part.strip() for part in line.rsplit(",", 1)]
                for line in listed.splitlines()
                if line.count(",") >= 1
            ]
        except (OSError, subprocess.SubprocessError):
            pass
    return found


def _nvidia_smi(*args: str) -> str:
    return subprocess.run(
        ["nvidia-smi", *args], capture_output=True, text=True, timeout=20, check=False
    ).stdout


if __name__ == "__main__":
    sys.stdout.write(json.dumps(probe()) + "\n")
