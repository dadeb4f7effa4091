"""What a node or an image runs: Python, torch, torchvision, CUDA, cuDNN (and whether its engine
libraries are there), NCCL, triton, TensorBoard, the project.

`python3 -m torch_multinode.cluster.versions` prints one `name: version` line each; `--json` prints a mapping.
Anything absent says so ("none") instead of failing: a CPU node has no NCCL to speak of.

The training image carries this file alone, as a script, without the project's code (which
reaches the nodes at run time): so it imports nothing of the project, and there the project's
version comes from TMN_PROJECT_VERSION, which the image sets when it is built.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path

PROJECT_VERSION_VARIABLE = "TMN_PROJECT_VERSION"
# The oldest torch the project's code runs on: the minor release it is tested on (pyproject.toml
# pins 2.14.1). An image or node with an older torch is refused, naming both versions.
TORCH_MINIMUM = (2, 14)
# The image label where `make image` records the torch the image reported; the launcher reads it
# on every node (docker image inspect) and refuses an image below TORCH_MINIMUM.
TORCH_LABEL = "io.torch-multinode.torch"
# Beside it, the CUDA and NCCL the image reported: each node's lock and run record read the three
# in the one `docker image inspect` (cluster.version_lock).
STACK_LABELS = {
    "torch": TORCH_LABEL,
    "cuda": "io.torch-multinode.cuda",
    "nccl": "io.torch-multinode.nccl",
}
# py-spy reads a hung job's Python stacks from outside its ranks (launch/hang.py): the training
# image installs this version (provision/images.py), and pyproject.toml pins it too (a test
# keeps them in step).
PY_SPY_VERSION = "0.4.3"
# torchft, PyTorch's per-step fault tolerance (a Rust lighthouse, `torchft_lighthouse`, and a
# Python Manager that keeps the surviving replica groups training): pinned like py-spy, in
# pyproject.toml and the image, from the wheel set torch comes from.
TORCHFT_VERSION = "0.2.0"
# The oldest NVIDIA driver branch each CUDA major runs on (NVIDIA's CUDA Compatibility guide,
# "Minimum Required Driver Version" under minor version compatibility): torch's wheels carry
# their CUDA runtime, so the node's driver is what must be new enough.
DRIVER_MINIMUM = {13: 580, 12: 525, 11: 450}


def driver_needed(cuda: str | None) -> int | None:
    """The driver branch a torch built for CUDA `cuda` ('13.0') needs, or None if unknown."""
    found = release(cuda or "")
    return DRIVER_MINIMUM.get(found[0]) if found else None


def release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string: '2.10.0a0+5e4b2c1' -> (2, 10, 0), '2.14.1+cu130'
    -> (2, 14, 1); () when it does not start with a number ('none', 'unknown')."""
    parts: list[int] = []
    for piece in version.split("+", 1)[0].split("."):
        digits = ""
        for character in piece:
            if not character.isdigit():
                break
            digits += character
        if not digits:
            break
        parts.append(int(digits))
        if digits != piece:  # a pre-release tail ('0a0', '0rc1') ends the release
            break
    return tuple(parts)


def torch_meets_minimum(version: str) -> bool:
    """Whether a torch version string is at least TORCH_MINIMUM (a pre-release of the minimum
    counts as the minimum: NVIDIA's images carry '2.N.0a0' builds of the release they precede)."""
    found = release(version)
    return bool(found) and found[: len(TORCH_MINIMUM)] >= TORCH_MINIMUM


def minimum_shown() -> str:
    return ".".join(map(str, TORCH_MINIMUM))


def project_version() -> str:
    """The project's own version where its code is importable, else what the image recorded."""
    try:
        from torch_multinode import cluster
    except ImportError:
        version = None
    else:
        version = getattr(cluster, "__version__", None)
    return version or os.environ.get(PROJECT_VERSION_VARIABLE) or "unknown"


def collect() -> dict[str, str]:
    found = {"python": platform.python_version(), "torch-multinode": project_version()}
    try:
        import torch
    except ImportError:
        return {**found, "torch": "none", "tensorboard": _tensorboard_version()}
    found["torch"] = torch.__version__
    try:
        import torchvision

        found["torchvision"] = torchvision.__version__
    except ImportError:
        found["torchvision"] = "none"
    found["tensorboard"] = _tensorboard_version()
    found["cuda"] = torch.version.cuda or "none"
    found["cudnn"] = str(torch.backends.cudnn.version() or "none")
    found["nccl"] = _nccl_version(torch)
    found["cudnn-engines"] = _cudnn_engines()
    found["triton"] = _distribution_version("triton")
    found["cuda-archs"] = cuda_archs(torch) or "none"
    found["gpus"] = str(torch.cuda.device_count() if torch.cuda.is_available() else 0)
    return found


def cuda_archs(torch) -> str | None:
    """The GPU architectures torch's kernels were built for ('sm_75 sm_80 ... compute_120'), as
    torch.cuda.get_arch_list() has them but without needing a GPU (the build's own constant);
    None for a CPU build."""
    flags = getattr(getattr(torch, "_C", None), "_cuda_getArchFlags", None)
    return (flags() or None) if flags else None


def _arch_number(arch: str) -> int | None:
    """'sm_86' -> 86, 'sm_120' -> 120, 'sm_90a' -> 90, 'compute_120' -> 120."""
    digits = ""
    for character in arch.split("_", 1)[-1]:
        if not character.isdigit():
            break
        digits += character
    return int(digits) if digits else None


def gpu_runs(archs: str, capability: str) -> bool:
    """Whether a GPU of compute capability `capability` ('7.0', '8.9', '12.0') can run a torch
    built for `archs`: a kernel binary of its major with a minor no higher than its own
    (sm_80 runs on 8.6), or PTX (compute_XY) no newer than the GPU, which the driver compiles.
    Torch's own check (torch.cuda._check_capability) only warns; the first kernel then fails
    with "no kernel image is available"."""
    major, _, minor = capability.partition(".")
    if not (major.isdigit() and minor.isdigit()):
        return True  # not a capability: nothing to say
    have = int(major) * 10 + int(minor)
    for arch in archs.split():
        number = _arch_number(arch)
        if number is None:
            continue
        if arch.startswith("sm_") and number // 10 == int(major) and number <= have:
            return True
        if arch.startswith("compute_") and number <= have:
            return True
    return False


def oldest_capability(archs: str) -> str:
    """The oldest compute capability `archs` has kernels for: 'sm_75 sm_80' -> '7.5'."""
    numbers = [n for n in map(_arch_number, archs.split()) if n is not None]
    return f"{min(numbers) // 10}.{min(numbers) % 10}" if numbers else "unknown"


def _distribution_version(name: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "none"


# cuDNN 9 loads its engines lazily, at the first convolution: present or not, the version
# answers. A CUDA image needs them; the CPU twin drops them.
CUDNN_ENGINES = ("libcudnn_engines_precompiled.so.9", "libcudnn_engines_runtime_compiled.so.9")


def _cudnn_engines() -> str:
    """'present' or 'absent' where torch's cuDNN wheel (nvidia-cudnn-cu*) is installed, or else
    where a system library directory holds cuDNN 9 (NVIDIA's images install it system-wide);
    'unknown' where no cuDNN is found."""
    from importlib import metadata

    for distribution in metadata.distributions():
        name = (distribution.metadata["Name"] or "").lower().replace("_", "-")
        if not name.startswith("nvidia-cudnn"):
            continue
        # On disk, not in the wheel's record: the CPU twin deletes them after installing.
        found = {
            Path(str(f)).name
            for f in distribution.files or ()
            if Path(str(f)).name in CUDNN_ENGINES
            and Path(str(distribution.locate_file(f))).exists()
        }
        return "present" if found == set(CUDNN_ENGINES) else "absent"
    for directory in _system_library_directories():
        if (directory / "libcudnn.so.9").exists():
            present = all((directory / engine).exists() for engine in CUDNN_ENGINES)
            return "present" if present else "absent"
    return "unknown"


def _system_library_directories() -> list[Path]:
    listed = os.environ.get("LD_LIBRARY_PATH", "").split(":")
    machine = platform.machine()
    usual = [f"/usr/lib/{machine}-linux-gnu", "/usr/local/cuda/lib64", "/usr/local/lib", "/usr/lib"]
    return [Path(d) for d in [*listed, *usual] if d]


def _tensorboard_version() -> str:
    try:
        import tensorboard
    except ImportError:
        return "none"
    return str(getattr(tensorboard, "__version__", "unknown"))


def _nccl_version(torch) -> str:
    if not torch.distributed.is_nccl_available():
        return "none"
    try:
        version = torch.cuda.nccl.version()
    except Exception:  # a build with NCCL but no usable library: report, don't fail
        return "unknown"
    return ".".join(str(part) for part in version) if isinstance(version, tuple) else str(version)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    found = collect()
    if "--json" in argv:
        print(json.dumps(found, sort_keys=True))
    else:
        for name, version in found.items():
            print(f"{name}: {version}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
