"""Building the training image: the CUDA/NCCL image for GPU machines, or its CPU twin.

Both come from docker/Dockerfile, on the same Debian base with the same pinned torch wheels as
the controller and the tests; the CPU twin drops what only a GPU would load. Which one `make
image` builds is decided by what this machine has (a working `nvidia-smi`) unless KIND= says.
Another base (NVIDIA's PyTorch image, BASE_IMAGE=) is built without wheels and accepted only
when the torch it reports meets the project's minimum. Every image records its torch in a
label (cluster.versions.TORCH_LABEL), which the launcher checks on every node.
The build's live output is provision.build_watch's; the nodes' platform, which the build is
pinned to, provision.platforms'.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import random
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

from torch_multinode.cluster import __version__
from torch_multinode.cluster.engine import debian_base, docker, image_exists, require_engine
from torch_multinode.cluster.errors import UserError
from torch_multinode.cluster.inventory import DEFAULT_TRAINING_IMAGE
from torch_multinode.cluster.sync import TOOL_ROOT
from torch_multinode.cluster.versions import (
    PY_SPY_VERSION,
    STACK_LABELS,
    TORCH_LABEL,
    TORCHFT_VERSION,
    minimum_shown,
    release,
    torch_meets_minimum,
)
from torch_multinode.provision import build_watch, platforms

KINDS = ("auto", "cpu", "cuda")
# The base of both kinds: Debian's own packages, no registry account. Beside Python: a C and C++
# compiler and Python's headers, which torch.compile needs (triton builds its GPU launcher with
# them, inductor's CPU path compiles its C++ kernels), and rdma-core's userspace libraries, which
# NCCL loads to use InfiniBand or RoCE from a container.
CPU_BASE_PACKAGES = (
    "python3",
    "python3-venv",
    "python3-dev",
    "gcc",
    "g++",
    "ca-certificates",
    "iproute2",
    "procps",
    "libibverbs1",
    "ibverbs-providers",
    "librdmacm1",
)
# Named after its packages: a machine holding a base made from another list makes a new one.
CPU_BASE_IMAGE = (
    "torch-multinode/debian-python:bookworm-"
    + hashlib.sha256(" ".join(CPU_BASE_PACKAGES).encode()).hexdigest()[:8]
)
# Debian bookworm's python3: the wheels are fetched for it, whatever Python runs this.
CPU_BASE_PYTHON = "3.11"
# The pair the project pins (pyproject.toml); a test keeps the two in step.
TORCH_VERSION = "2.14.1"
TORCHVISION_VERSION = "0.29.1"
# What the workloads import beside torch, as pyproject.toml requires it (a test checks).
TENSORBOARD_REQUIREMENT = "tensorboard>=2.17"
PYYAML_REQUIREMENT = "pyyaml>=6.0"
DOCKERFILE = TOOL_ROOT / "docker" / "Dockerfile"
WHEELS_DIR = TOOL_ROOT / "docker" / "wheels"
# What an image was built from (the recipe's digest): a build whose recipe is unchanged is
# skipped, so `make provision` ships nothing new when nothing that makes the image changed.
RECIPE_LABEL = "io.torch-multinode.recipe"
# What the image is made of, beside the wheels and the base (the context .dockerignore lets in).
RECIPE_FILES = ("docker/Dockerfile", "docker/entrypoint.sh", "cluster/versions.py")

# Where the build finds the wheels: a name and a port that never change, so that the install
# layer's cache key (which holds WHEELS_URL) is the same from one build to the next; the name
# is resolved for each build to the loopback address its server took (--add-host, outside the
# key). A random port or address in the URL rebuilt torch's 3.8 GB layer on every build.
WHEELS_HOST = "tmn-wheels"
WHEELS_PORT = 47719
WHEELS_URL = f"http://{WHEELS_HOST}:{WHEELS_PORT}/"
WHEELS_ADDRESS_TRIES = 20

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


def build_args(
    kind: str,
    base_image: str | None = None,
    wheels_address: str = "127.0.0.1",
    context: Path = TOOL_ROOT,
) -> list[str]:
    """The `docker build` arguments for one kind, with `context` (the repository root) as the
    build's context. With `base_image` (one that brings its own torch, such as NVIDIA's), no
    wheels are installed; otherwise pip reads them from WHEELS_URL, which names the wheels'
    server by WHEELS_HOST, resolved to `wheels_address` (see serve_wheels) by --add-host: the
    build reaches it on the host's network. Every value that enters a layer's cache key is
    the same from build to build; the address, which changes, goes only into --add-host,
    which is not part of it."""
    if kind not in ("cpu", "cuda"):
        raise UserError(f"image kind {kind!r} is not one of {', '.join(KINDS)}")
    common = [
        "-f",
        str(context / DOCKERFILE.relative_to(TOOL_ROOT)),
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
        "--add-host",
        f"{WHEELS_HOST}:{wheels_address}",
        "--build-arg",
        f"BASE_IMAGE={CPU_BASE_IMAGE}",
        "--build-arg",
        f"WHEELS_URL={WHEELS_URL}",
        "--build-arg",
        f"KEEP_GPU_LIBRARIES={1 if kind == 'cuda' else 0}",
    ]


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the base's name)
        pass


def _loopback_server(handler: Callable[..., SimpleHTTPRequestHandler]) -> ThreadingHTTPServer:
    """A server on WHEELS_PORT of a loopback address of its own (127.X.Y.Z, chosen at random):
    the port stays the same from build to build, and two builds at once never meet."""
    chooser = random.SystemRandom()
    for _ in range(WHEELS_ADDRESS_TRIES):
        address = ".".join(["127", *(str(chooser.randint(1, 254)) for _ in range(3))])
        try:
            return ThreadingHTTPServer((address, WHEELS_PORT), handler)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
    raise UserError(
        f"no free loopback address for the wheels' server on port {WHEELS_PORT} after "
        f"{WHEELS_ADDRESS_TRIES} tries",
        hint="make image again",
        exit_code=1,
    )


@contextmanager
def serve_wheels(directory: Path = WHEELS_DIR) -> Iterator[str]:
    """The wheels directory as a pip --find-links page on WHEELS_PORT of a loopback address of
    its own, for one build's length: the build reads the wheels from there (as WHEELS_URL,
    WHEELS_HOST resolved to that address) instead of receiving them in its context. Yields the
    address."""
    handler = functools.partial(_QuietHandler, directory=str(directory))
    server = _loopback_server(handler)
    thread = threading.Thread(target=server.serve_forever, name="wheels", daemon=True)
    thread.start()
    try:
        yield str(server.server_address[0])
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def recipe(kind: str, base_image: str | None = None, root: Path = TOOL_ROOT) -> str:
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
        wheels = root / WHEELS_DIR.relative_to(TOOL_ROOT)
        for wheel in sorted(wheels.glob("*.whl")):
            digest.update(f"{wheel.name}\0{wheel.stat().st_size}\0".encode())
    return digest.hexdigest()[:32]


def image_label(tag: str, name: str) -> str:
    """One label of an image ('' where it has none)."""
    template = f'{{{{with .Config.Labels}}}}{{{{index . "{name}"}}}}{{{{end}}}}'
    return docker("image", "inspect", "--format", template, tag).stdout.strip()


def image_size(tag: str) -> int:
    """The image's size unpacked, as its engine reports it (`docker image inspect`'s .Size)."""
    return int(docker("image", "inspect", "--format", "{{.Size}}", tag).stdout.strip())


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


# The OCI annotation of the image a build started from: set when that is a registry's image
# (BASE_IMAGE=), which nodes may pull themselves (inventory image_base_from_nodes, provision.ship).
BASE_LABEL = "org.opencontainers.image.base.name"


def label_command(
    image_id: str,
    tag: str,
    torch: str,
    made_from: str,
    platform: str | None = None,
    base_image: str | None = None,
    stack: dict[str, str] | None = None,
) -> tuple[list[str], str]:
    """The `docker build` that puts the torch and recipe labels on a built image (with `stack`,
    the CUDA and NCCL it reported too; built on BASE_IMAGE, the name of that base), and the
    Dockerfile it reads on stdin: no context is sent, and a rebuild with the same labels is a
    cache hit. With `platform`, pinned to it as the image's own build was."""
    reported = [
        argument
        for field, value in (stack or {}).items()
        for argument in ("--label", f"{STACK_LABELS[field]}={value}")
    ]
    command = [
        "docker",
        "build",
        "--quiet",
        *(["--platform", platform] if platform else []),
        "--label",
        f"{TORCH_LABEL}={torch}",
        *reported,
        "--label",
        f"{RECIPE_LABEL}={made_from}",
        *(["--label", f"{BASE_LABEL}={base_image}"] if base_image else []),
        "-t",
        tag,
        "-",
    ]
    return command, f"FROM {image_id}\n"


def torch_label(tag: str) -> str:
    """The torch an image's label records ('' where it has none)."""
    return image_label(tag, TORCH_LABEL)


def stack_labels(tag: str) -> dict[str, str]:
    """The torch, CUDA and NCCL an image's labels record ('unknown' where it has none)."""
    found = json.loads(
        docker("image", "inspect", "--format", "{{json .Config.Labels}}", tag).stdout
    )
    return {field: (found or {}).get(name) or "unknown" for field, name in STACK_LABELS.items()}


def label(
    image_id: str,
    tag: str,
    torch: str,
    made_from: str,
    platform: str | None = None,
    base_image: str | None = None,
    stack: dict[str, str] | None = None,
) -> str:
    """Label `image_id` with the torch it carries (and `stack`'s CUDA and NCCL) and its recipe,
    under `tag`; the labelled image's id."""
    command, dockerfile = label_command(
        image_id, tag, torch, made_from, platform, base_image, stack
    )
    proc = subprocess.run(command, input=dockerfile, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        detail = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()[-1]
        raise UserError(f"labelling {tag} with its torch failed: {detail}", exit_code=1)
    return _image_id(tag)


def fetch_wheels(progress: Progress, directory: Path = WHEELS_DIR) -> None:
    """torch, torchvision, TensorBoard, PyYAML, py-spy and torchft wheels (with their
    dependencies) into
    `directory` (the build context's docker/wheels): pip inside the image cannot reach the
    package index, so it installs from these with --no-index."""
    wanted = (
        f"torch-{TORCH_VERSION}-",
        f"torchvision-{TORCHVISION_VERSION}-",
        "tensorboard-",
        f"py_spy-{PY_SPY_VERSION}-",
        f"torchft-{TORCHFT_VERSION}-",
    )
    present = [p.name for p in directory.glob("*.whl")] if directory.exists() else []
    if all(any(name.startswith(w) for name in present) for w in wanted):
        return
    progress(
        f"Downloading torch {TORCH_VERSION}, torchvision {TORCHVISION_VERSION} and "
        f"TensorBoard wheels into {directory} (once, ~3 GB)..."
    )
    directory.mkdir(parents=True, exist_ok=True)
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
            str(directory),
            "--only-binary",
            ":all:",
            "--python-version",
            CPU_BASE_PYTHON,
            f"torch=={TORCH_VERSION}",
            f"torchvision=={TORCHVISION_VERSION}",
            TENSORBOARD_REQUIREMENT,
            PYYAML_REQUIREMENT,
            f"py-spy=={PY_SPY_VERSION}",
            f"torchft=={TORCHFT_VERSION}",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or ["(no output)"]
        raise UserError(f"downloading the wheels failed: {tail[0]}", exit_code=1)


def _base_refusal(base_image: str | None, platform: str) -> UserError | None:
    """Why the build's base cannot make an image for `platform`, or None. Docker 20.10's
    legacy builder takes --platform, yet builds on a local base of another architecture as it
    is (measured: --platform linux/arm64 on the amd64 Debian base gave an amd64 image), so
    the base is checked first. A base not on this machine is pulled for `platform` by the
    build itself."""
    base = base_image or CPU_BASE_IMAGE
    if base_image is not None and not image_exists(base):
        return None
    architecture = platforms.platform_of(platforms.image_architecture(base))
    if architecture == platform:
        return None
    if base_image is None:
        return UserError(
            f"the nodes run {platform}, this machine {architecture}: the image's Debian base and "
            f"wheels are this machine's",
            hint=f"make image on a {platform} machine, then make provision there",
            exit_code=1,
        )
    return UserError(
        f"the base {base} on this machine is {architecture}, the nodes run {platform}",
        hint=f"docker pull --platform {platform} {base}",
        exit_code=1,
    )


def build(
    kind: str = "auto",
    tag: str = DEFAULT_TRAINING_IMAGE,
    progress: Progress = print,
    base_image: str | None = None,
    platform: str | None = None,
    context: Path = TOOL_ROOT,
) -> BuiltImage:
    """Build the training image `tag` of `kind` (see the module's docstring). With `platform`
    ("linux/arm64", the nodes' one: platforms.nodes_platform), the build is pinned to it (`docker build
    --platform`) and the image's architecture checked against it afterwards; a base of
    another architecture is refused before anything is built. Without it, the image is this
    machine's engine's own platform. `context` is the repository the build reads (its docker/
    and cluster/versions.py, its wheels): this checkout's own unless given."""
    require_engine()
    if kind == "auto":
        kind = "cuda" if gpu_present() else "cpu"
    arguments = build_args(kind, base_image, context=context)  # refuses an unknown kind first
    started = time.monotonic()
    if base_image is None:
        debian_base(CPU_BASE_IMAGE, CPU_BASE_PACKAGES, progress)
    if platform is not None:
        base_refusal = _base_refusal(base_image, platform)
        if base_refusal is not None:
            raise base_refusal
    wheels = context / WHEELS_DIR.relative_to(TOOL_ROOT)
    if base_image is None:
        fetch_wheels(progress, wheels)
    made_from = recipe(kind, base_image, context)
    if (
        image_exists(tag)
        and image_label(tag, RECIPE_LABEL) == made_from
        and image_label(tag, STACK_LABELS["nccl"])  # labelled by this version's build
        and (
            platform is None or platforms.platform_of(platforms.image_architecture(tag)) == platform
        )
    ):
        progress(f"{tag} is up to date: built from the same Dockerfile, base and wheels.")
        seconds = time.monotonic() - started
        return BuiltImage(tag, kind, _image_id(tag), seconds, torch_label(tag), up_to_date=True)
    on = f" on {base_image}" if base_image else ""
    pinned = f" for {platform}" if platform else ""
    progress(f"Building the {kind.upper()} training image {tag}{on}{pinned}...")
    if base_image is None:
        with serve_wheels(wheels) as address:
            served = build_args(kind, None, address, context)
            _docker_build(served, tag, progress, None, platform, context)
    else:
        _docker_build(arguments, tag, progress, base_image, platform, context)
    if platform is not None:
        refusal = platforms.architecture_refusal(tag, platforms.image_architecture(tag), platform)
        if refusal is not None:
            docker("rmi", tag, check=False)  # an image the nodes cannot run is not left there
            raise refusal
    # Whatever the kind, the torch is the one the image itself reports: checked against the
    # minimum, then recorded in the label the launcher reads on every node.
    try:
        said = versions(tag)
    except UserError:
        docker("rmi", tag, check=False)  # nothing half-made left under the name
        raise
    reported = said.get("torch", "none")
    refusal = torch_refusal(reported, base_image)
    if refusal is not None:
        docker("rmi", tag, check=False)
        raise refusal
    stack = {field: said.get(field) or "none" for field in ("cuda", "nccl")}
    image_id = label(_image_id(tag), tag, reported, made_from, platform, base_image, stack)
    # Labels change nothing --version reads: the labelled image says what the built one said.
    _VERSIONS[image_id, False] = dict(said)
    return BuiltImage(tag, kind, image_id, time.monotonic() - started, reported)


def _image_id(tag: str) -> str:
    return docker("image", "inspect", "--format", "{{.Id}}", tag).stdout.strip()


def _docker_build(
    arguments: list[str],
    tag: str,
    progress: Progress,
    base: str | None,
    platform: str | None,
    context: Path = TOOL_ROOT,
) -> None:
    """`docker build` of `tag`, its progress shown live (see build_watch.BuildWatch); on failure the
    output's last lines, then a UserError naming the step and what the builder said."""
    pinned = ["--platform", platform] if platform else []
    command = ["docker", "build", *plain_progress(_build_help()), *pinned, *arguments, "-t", tag]
    process = subprocess.Popen(
        [*command, str(context)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
    )
    assert process.stdout is not None  # stdout=PIPE
    try:
        watched = build_watch.watch(build_watch.build_events(process.stdout), progress)
    except BaseException:  # Ctrl-C: the build stops with us
        process.terminate()
        process.wait()
        raise
    if process.wait() != 0:
        for line in watched.failure_lines():
            progress(line)
        raise UserError(
            f"docker build of {tag} failed{watched.where()}: {watched.reason()}",
            hint=f"'docker pull {base}' first" if base else "the lines above",
            exit_code=1,
        )


def build_from(arguments: list[str], tag: str, progress: Progress, context: Path) -> None:
    """`docker build` of `tag` with `arguments` on `context`, its progress shown as the
    training image's is (a project's dependency layer: provision.dependencies)."""
    _docker_build(arguments, tag, progress, None, None, context)


def plain_progress(help_text: str) -> list[str]:
    """`--progress plain` where the `docker build` that runs takes it (BuildKit, buildx: its
    `--help` lists the option), else nothing: the legacy builder of a current client refuses
    the option ("unknown flag"), and its output is plain already. DOCKER_BUILDKIT=0 or 1
    decides which builder `docker build --help` describes, so it decides here too."""
    return ["--progress", "plain"] if "--progress" in help_text else []


def _build_help() -> str:
    proc = subprocess.run(
        ["docker", "build", "--help"], capture_output=True, text=True, check=False, timeout=30
    )
    return proc.stdout + proc.stderr


# What `--version` said, per image ID and `gpus`, in this process: an image ID names its layers
# and configuration, so the answer cannot differ, and `cluster image` asks again right after
# the build asked (a torch import in a container: 10 to 30 s on a busy 2-core machine, and past
# 120 s at times on an overloaded one, so its limit only catches a hang).
_VERSIONS: dict[tuple[str, bool], dict[str, str]] = {}


def read_report(text: str) -> dict[str, str]:
    """cluster/versions.py's report (an image's `--version`), one `name: value` a line."""
    return dict(line.split(": ", 1) for line in text.splitlines() if ": " in line)


def versions(tag: str, gpus: bool = False) -> dict[str, str]:
    """What the image says it holds (its default command). No GPU is needed; with `gpus` (on a
    machine with NVIDIA's container toolkit) a CUDA image also counts this machine's GPUs."""
    identity = docker("image", "inspect", "--format", "{{.Id}}", tag, check=False).stdout.strip()
    if identity and (identity, gpus) in _VERSIONS:
        return dict(_VERSIONS[identity, gpus])
    with_gpus = ["--gpus", "all"] if gpus else []
    proc = docker("run", "--rm", *with_gpus, tag, "--version", timeout=600)
    found = read_report(proc.stdout)
    if identity:
        _VERSIONS[identity, gpus] = dict(found)
    return found
