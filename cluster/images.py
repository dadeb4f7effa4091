"""Building the training image: the CUDA/NCCL image for GPU machines, or its CPU twin.

Both come from docker/Dockerfile. Which one `make image` builds is decided by what this
machine has (a working `nvidia-smi`), never by a flag a test could forget to flip.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from cluster import __version__
from cluster.errors import ClusterError
from cluster.inventory import DEFAULT_TRAINING_IMAGE
from cluster.sim import REPO_ROOT, debian_base, docker, require_engine

# The CUDA image's default base, and what NVIDIA's release notes say it brings.
CUDA_BASE_IMAGE = "nvcr.io/nvidia/pytorch:25.12-py3"
CPU_BASE_IMAGE = "torch-multinode/debian-python:bookworm"
CPU_BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates", "iproute2", "procps")
# The pair the project pins (pyproject.toml); a test keeps the two in step.
TORCH_VERSION = "2.14.1"
TORCHVISION_VERSION = "0.29.1"
DOCKERFILE = REPO_ROOT / "docker" / "Dockerfile"
WHEELS_DIR = REPO_ROOT / "docker" / "wheels"

Progress = Callable[[str], None]


@dataclass(frozen=True)
class BuiltImage:
    tag: str
    kind: str
    image_id: str
    seconds: float


def gpu_present() -> bool:
    if shutil.which("nvidia-smi") is None:
        return False
    proc = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False)
    return proc.returncode == 0 and "GPU" in proc.stdout


def build_args(kind: str) -> list[str]:
    """The `docker build` arguments for one kind, from the repository root as context."""
    common = [
        "-f", str(DOCKERFILE),
        "--build-arg", f"PROJECT_VERSION={__version__}",
        "--build-arg", f"TORCH_VERSION={TORCH_VERSION}",
        "--build-arg", f"TORCHVISION_VERSION={TORCHVISION_VERSION}",
    ]  # fmt: skip
    if kind == "cuda":
        return [*common, "--build-arg", f"BASE_IMAGE={CUDA_BASE_IMAGE}"]
    if kind == "cpu":
        return [
            *common,
            "--build-arg", f"BASE_IMAGE={CPU_BASE_IMAGE}",
            "--build-arg", f"WHEELS={WHEELS_DIR.relative_to(REPO_ROOT)}",
        ]  # fmt: skip
    raise ClusterError(f"image kind {kind!r} is not one of auto, cpu, cuda")


def fetch_wheels(progress: Progress) -> None:
    """torch and torchvision wheels into the build context: pip inside the image cannot reach
    the package index, so it installs from these with --no-index."""
    wanted = (f"torch-{TORCH_VERSION}", f"torchvision-{TORCHVISION_VERSION}")
    present = [p.name for p in WHEELS_DIR.glob("*.whl")] if WHEELS_DIR.exists() else []
    if all(any(name.startswith(w) for name in present) for w in wanted):
        return
    progress(f"Downloading torch {TORCH_VERSION} and torchvision {TORCHVISION_VERSION} wheels "
             f"into {WHEELS_DIR} (once, ~3 GB)...")  # fmt: skip
    WHEELS_DIR.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--dest", str(WHEELS_DIR),
         f"torch=={TORCH_VERSION}", f"torchvision=={TORCHVISION_VERSION}", "pyyaml>=6.0"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or ["(no output)"]
        raise ClusterError(f"downloading the wheels failed: {tail[0]}", exit_code=1)


def build(
    kind: str = "auto", tag: str = DEFAULT_TRAINING_IMAGE, progress: Progress = print
) -> BuiltImage:
    require_engine()
    if kind == "auto":
        kind = "cuda" if gpu_present() else "cpu"
    arguments = build_args(kind)
    started = time.monotonic()
    if kind == "cpu":
        debian_base(CPU_BASE_IMAGE, CPU_BASE_PACKAGES, progress)
        fetch_wheels(progress)
    progress(f"Building the {kind.upper()} training image {tag}...")
    process = subprocess.Popen(
        ["docker", "build", *arguments, "-t", tag, str(REPO_ROOT)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    tail: list[str] = []
    for line in process.stdout:
        line = line.rstrip()
        tail = (tail + [line])[-10:]
        if line.startswith("Step "):
            progress(f"  {line}")
    if process.wait() != 0:
        raise ClusterError(
            f"docker build of {tag} failed: {tail[-1] if tail else 'no output'}",
            hint="the lines above" if kind == "cpu" else f"'docker pull {CUDA_BASE_IMAGE}' first",
            exit_code=1,
        )
    image_id = docker("image", "inspect", "--format", "{{.Id}}", tag).stdout.strip()
    return BuiltImage(tag, kind, image_id, time.monotonic() - started)


def versions(tag: str) -> dict[str, str]:
    """What the image says it holds (its default command)."""
    proc = docker("run", "--rm", tag, "--version", timeout=120)
    return dict(line.split(": ", 1) for line in proc.stdout.splitlines() if ": " in line)
