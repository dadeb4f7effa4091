"""Building the training image: the CUDA/NCCL image for GPU machines, or its CPU twin.

Both come from docker/Dockerfile, on the same Debian base with the same pinned torch wheels as
the controller and the tests; the CPU twin drops what only a GPU would load. Which one `make
image` builds is decided by what this machine has (a working `nvidia-smi`) unless KIND= says.
Another base (NVIDIA's PyTorch image, BASE_IMAGE=) is built without wheels and accepted only
when the torch it reports meets the project's minimum. Every image records its torch in a
label (cluster.versions.TORCH_LABEL), which the launcher checks on every node.
"""

from __future__ import annotations

import functools
import hashlib
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from cluster import __version__
from cluster.errors import UserError
from cluster.inventory import DEFAULT_TRAINING_IMAGE
from cluster.sim import REPO_ROOT, debian_base, docker, image_exists, require_engine
from cluster.versions import TORCH_LABEL, minimum_shown, release, torch_meets_minimum

# The base of both kinds: Debian's own packages, no registry account.
CPU_BASE_IMAGE = "torch-multinode/debian-python:bookworm"
KINDS = ("auto", "cpu", "cuda")
CPU_BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates", "iproute2", "procps")
# Debian bookworm's python3: the wheels are fetched for it, whatever Python runs this.
CPU_BASE_PYTHON = "3.11"
# The pair the project pins (pyproject.toml); a test keeps the two in step.
TORCH_VERSION = "2.14.1"
TORCHVISION_VERSION = "0.29.1"
# What the workloads import beside torch, as pyproject.toml requires it (a test checks).
TENSORBOARD_REQUIREMENT = "tensorboard>=2.17"
PYYAML_REQUIREMENT = "pyyaml>=6.0"
DOCKERFILE = REPO_ROOT / "docker" / "Dockerfile"
WHEELS_DIR = REPO_ROOT / "docker" / "wheels"
# What an image was built from (the recipe's digest): a build whose recipe is unchanged is
# skipped, so `make provision` ships nothing new when nothing that makes the image changed.
RECIPE_LABEL = "io.torch-multinode.recipe"
# What the image is made of, beside the wheels and the base (the context .dockerignore lets in).
RECIPE_FILES = ("docker/Dockerfile", "docker/entrypoint.sh", "cluster/versions.py")

Progress = Callable[[str], None]


@dataclass(frozen=True)
class BuiltImage:
    tag: str
    kind: str
    image_id: str
    seconds: float
    torch: str  # as the image reports it, and as its label records it
    up_to_date: bool = False  # nothing built: the tag was made from the same recipe


def gpu_present() -> bool:
    if shutil.which("nvidia-smi") is None:
        return False
    proc = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False)
    return proc.returncode == 0 and "GPU" in proc.stdout


def build_args(kind: str, base_image: str | None = None, wheels_url: str = "") -> list[str]:
    """The `docker build` arguments for one kind, from the repository root as context. With
    `base_image` (one that brings its own torch, such as NVIDIA's), no wheels are installed;
    otherwise pip reads them from `wheels_url`, served on the engine's loopback (see
    serve_wheels), which the build reaches on the host's network."""
    if kind not in ("cpu", "cuda"):
        raise UserError(f"image kind {kind!r} is not one of {', '.join(KINDS)}")
    common = [
        "-f",
        str(DOCKERFILE),
        "--build-arg",
        f"PROJECT_VERSION={__version__}",
        "--build-arg",
        f"TORCH_VERSION={TORCH_VERSION}",
        "--build-arg",
        f"TORCHVISION_VERSION={TORCHVISION_VERSION}",
    ]
    if base_image is not None:
        return [*common, "--build-arg", f"BASE_IMAGE={base_image}"]
    return [
        *common,
        "--network",
        "host",
        "--build-arg",
        f"BASE_IMAGE={CPU_BASE_IMAGE}",
        "--build-arg",
        f"WHEELS_URL={wheels_url}",
        "--build-arg",
        f"KEEP_GPU_LIBRARIES={1 if kind == 'cuda' else 0}",
    ]


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the base's name)
        pass


@contextmanager
def serve_wheels(directory: Path = WHEELS_DIR) -> Iterator[str]:
    """The wheels directory as a pip --find-links page on 127.0.0.1, for one build's length:
    the build reads the wheels from there instead of receiving them in its context."""
    handler = functools.partial(_QuietHandler, directory=str(directory))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, name="wheels", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def recipe(kind: str, base_image: str | None = None, root: Path = REPO_ROOT) -> str:
    """The digest of everything an image is made from: its kind, the base image's id, the
    pinned versions, the files the build reads and the wheels (by name and size). The
    project's code is not part of it: editing the code never rebuilds the image."""
    base = base_image or CPU_BASE_IMAGE
    base_id = docker("image", "inspect", "--format", "{{.Id}}", base, check=False).stdout.strip()
    digest = hashlib.sha256()
    for part in (kind, base, base_id, __version__, TORCH_VERSION, TORCHVISION_VERSION):
        digest.update(f"{part}\0".encode())
    for name in RECIPE_FILES:
        digest.update(name.encode() + b"\0" + (root / name).read_bytes() + b"\0")
    if base_image is None:
        wheels = root / WHEELS_DIR.relative_to(REPO_ROOT)
        for wheel in sorted(wheels.glob("*.whl")):
            digest.update(f"{wheel.name}\0{wheel.stat().st_size}\0".encode())
    return digest.hexdigest()[:32]


def image_label(tag: str, name: str) -> str:
    """One label of an image ('' where it has none)."""
    template = f'{{{{with .Config.Labels}}}}{{{{index . "{name}"}}}}{{{{end}}}}'
    return docker("image", "inspect", "--format", template, tag).stdout.strip()


def torch_refusal(reported: str, base_image: str | None) -> UserError | None:
    """Why an image whose own `--version` says torch `reported` is refused, or None."""
    if base_image is not None:
        hint = (
            f"make image without BASE_IMAGE, the default build with the pinned torch "
            f"{TORCH_VERSION}, or a newer NVIDIA release"
        )
    else:
        hint = "make image again (docker/wheels may hold other wheels: delete it to refetch)"
    base = base_image or CPU_BASE_IMAGE
    if release(reported) == ():
        problem = f"base {base} brings no torch (its --version says torch: {reported})"
    elif not torch_meets_minimum(reported):
        problem = (
            f"base {base} carries torch {reported}, older than the {minimum_shown()} this "
            f"project needs"
        )
    elif base_image is None and release(reported)[:3] != release(TORCH_VERSION):
        problem = (
            f"the image reports torch {reported}, not the pinned {TORCH_VERSION} its wheels "
            f"should have installed"
        )
    else:
        return None
    return UserError(problem, hint=hint, exit_code=1)


def label_command(image_id: str, tag: str, torch: str, made_from: str) -> tuple[list[str], str]:
    """The `docker build` that puts the torch and recipe labels on a built image, and the
    Dockerfile it reads on stdin: no context is sent, and a rebuild with the same labels is a
    cache hit."""
    command = [
        "docker",
        "build",
        "--quiet",
        "--label",
        f"{TORCH_LABEL}={torch}",
        "--label",
        f"{RECIPE_LABEL}={made_from}",
        "-t",
        tag,
        "-",
    ]
    return command, f"FROM {image_id}\n"


def torch_label(tag: str) -> str:
    """The torch an image's label records ('' where it has none)."""
    return image_label(tag, TORCH_LABEL)


def label(image_id: str, tag: str, torch: str, made_from: str) -> str:
    """Label `image_id` with the torch it carries and its recipe, under `tag`; the labelled
    image's id."""
    command, dockerfile = label_command(image_id, tag, torch, made_from)
    proc = subprocess.run(command, input=dockerfile, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        detail = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()[-1]
        raise UserError(f"labelling {tag} with its torch failed: {detail}", exit_code=1)
    return _image_id(tag)


def fetch_wheels(progress: Progress) -> None:
    """torch, torchvision, TensorBoard and PyYAML wheels (with their dependencies) into the
    build context: pip inside the image cannot reach the package index, so it installs from
    these with --no-index."""
    wanted = (f"torch-{TORCH_VERSION}-", f"torchvision-{TORCHVISION_VERSION}-", "tensorboard-")
    present = [p.name for p in WHEELS_DIR.glob("*.whl")] if WHEELS_DIR.exists() else []
    if all(any(name.startswith(w) for name in present) for w in wanted):
        return
    progress(
        f"Downloading torch {TORCH_VERSION}, torchvision {TORCHVISION_VERSION} and "
        f"TensorBoard wheels into {WHEELS_DIR} (once, ~3 GB)..."
    )
    WHEELS_DIR.mkdir(parents=True, exist_ok=True)
    # Wheels only (nothing to compile in the image), for the base's Python and this machine's
    # platform, which is the engine's.
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--dest",
            str(WHEELS_DIR),
            "--only-binary",
            ":all:",
            "--python-version",
            CPU_BASE_PYTHON,
            f"torch=={TORCH_VERSION}",
            f"torchvision=={TORCHVISION_VERSION}",
            TENSORBOARD_REQUIREMENT,
            PYYAML_REQUIREMENT,
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or ["(no output)"]
        raise UserError(f"downloading the wheels failed: {tail[0]}", exit_code=1)


def build(
    kind: str = "auto",
    tag: str = DEFAULT_TRAINING_IMAGE,
    progress: Progress = print,
    base_image: str | None = None,
) -> BuiltImage:
    require_engine()
    if kind == "auto":
        kind = "cuda" if gpu_present() else "cpu"
    arguments = build_args(kind, base_image)  # refuses an unknown kind before any work
    started = time.monotonic()
    if base_image is None:
        debian_base(CPU_BASE_IMAGE, CPU_BASE_PACKAGES, progress)
        fetch_wheels(progress)
    made_from = recipe(kind, base_image)
    if image_exists(tag) and image_label(tag, RECIPE_LABEL) == made_from and torch_label(tag):
        progress(f"{tag} is up to date: built from the same Dockerfile, base and wheels.")
        seconds = time.monotonic() - started
        return BuiltImage(tag, kind, _image_id(tag), seconds, torch_label(tag), up_to_date=True)
    on = f" on {base_image}" if base_image else ""
    progress(f"Building the {kind.upper()} training image {tag}{on}...")
    if base_image is None:
        with serve_wheels() as wheels_url:
            _docker_build(build_args(kind, None, wheels_url), tag, progress, base_image)
    else:
        _docker_build(arguments, tag, progress, base_image)
    # Whatever the kind, the torch is the one the image itself reports: checked against the
    # minimum, then recorded in the label the launcher reads on every node.
    try:
        reported = versions(tag).get("torch", "none")
    except UserError:
        docker("rmi", tag, check=False)  # nothing half-made left under the name
        raise
    refusal = torch_refusal(reported, base_image)
    if refusal is not None:
        docker("rmi", tag, check=False)
        raise refusal
    image_id = label(_image_id(tag), tag, reported, made_from)
    return BuiltImage(tag, kind, image_id, time.monotonic() - started, reported)


def _image_id(tag: str) -> str:
    return docker("image", "inspect", "--format", "{{.Id}}", tag).stdout.strip()


def _docker_build(arguments: list[str], tag: str, progress: Progress, base: str | None) -> None:
    process = subprocess.Popen(
        ["docker", "build", *arguments, "-t", tag, str(REPO_ROOT)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    tail: list[str] = []
    for line in process.stdout:
        line = line.rstrip()
        tail = (tail + [line])[-10:]
        if line.startswith("Step "):
            progress(f"  {line}")
    if process.wait() != 0:
        raise UserError(
            f"docker build of {tag} failed: {tail[-1] if tail else 'no output'}",
            hint=f"'docker pull {base}' first" if base else "the lines above",
            exit_code=1,
        )


def versions(tag: str, gpus: bool = False) -> dict[str, str]:
    """What the image says it holds (its default command). No GPU is needed; with `gpus` (on a
    machine with NVIDIA's container toolkit) a CUDA image also counts this machine's GPUs."""
    with_gpus = ["--gpus", "all"] if gpus else []
    proc = docker("run", "--rm", *with_gpus, tag, "--version", timeout=120)
    return dict(line.split(": ", 1) for line in proc.stdout.splitlines() if ": " in line)
