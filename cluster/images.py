"""Building the training image: the CUDA/NCCL image for GPU machines, or its CPU twin.

Both come from docker/Dockerfile, on the same Debian base with the same pinned torch wheels as
the controller and the tests; the CPU twin drops what only a GPU would load. Which one `make
image` builds is decided by what this machine has (a working `nvidia-smi`) unless KIND= says.
Another base (NVIDIA's PyTorch image, BASE_IMAGE=) is built without wheels and accepted only
when the torch it reports meets the project's minimum. Every image records its torch in a
label (cluster.versions.TORCH_LABEL), which the launcher checks on every node.
"""

from __future__ import annotations

import collections
import errno
import functools
import hashlib
import queue
import random
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING

from torch_multinode.cluster import __version__
from torch_multinode.cluster.engine import debian_base, docker, image_exists, require_engine
from torch_multinode.cluster.errors import UserError, shown
from torch_multinode.cluster.inventory import DEFAULT_TRAINING_IMAGE, Host
from torch_multinode.cluster.sync import TOOL_ROOT
from torch_multinode.cluster.versions import (
    TORCH_LABEL,
    minimum_shown,
    release,
    torch_meets_minimum,
)

if TYPE_CHECKING:
    from torch_multinode.cluster.execution import Nodes

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
# py-spy reads a hung job's Python stacks from outside its ranks (launch/hang.py); pinned here
# and in pyproject.toml alike (a test keeps the two in step).
PY_SPY_VERSION = "0.4.3"
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
# (BASE_IMAGE=), which nodes may pull themselves (inventory image_base_from_nodes, cluster.ship).
BASE_LABEL = "org.opencontainers.image.base.name"


def label_command(
    image_id: str,
    tag: str,
    torch: str,
    made_from: str,
    platform: str | None = None,
    base_image: str | None = None,
) -> tuple[list[str], str]:
    """The `docker build` that puts the torch and recipe labels on a built image (and, built on
    BASE_IMAGE, the name of that base), and the Dockerfile it reads on stdin: no context is
    sent, and a rebuild with the same labels is a cache hit. With `platform`, pinned to it as
    the image's own build was."""
    command = [
        "docker",
        "build",
        "--quiet",
        *(["--platform", platform] if platform else []),
        "--label",
        f"{TORCH_LABEL}={torch}",
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


def label(
    image_id: str,
    tag: str,
    torch: str,
    made_from: str,
    platform: str | None = None,
    base_image: str | None = None,
) -> str:
    """Label `image_id` with the torch it carries and its recipe, under `tag`; the labelled
    image's id."""
    command, dockerfile = label_command(image_id, tag, torch, made_from, platform, base_image)
    proc = subprocess.run(command, input=dockerfile, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        detail = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()[-1]
        raise UserError(f"labelling {tag} with its torch failed: {detail}", exit_code=1)
    return _image_id(tag)


def fetch_wheels(progress: Progress, directory: Path = WHEELS_DIR) -> None:
    """torch, torchvision, TensorBoard, PyYAML and py-spy wheels (with their dependencies) into
    `directory` (the build context's docker/wheels): pip inside the image cannot reach the
    package index, so it installs from these with --no-index."""
    wanted = (
        f"torch-{TORCH_VERSION}-",
        f"torchvision-{TORCHVISION_VERSION}-",
        "tensorboard-",
        f"py_spy-{PY_SPY_VERSION}-",
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
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or ["(no output)"]
        raise UserError(f"downloading the wheels failed: {tail[0]}", exit_code=1)


# --- the image's platform: the nodes' one -------------------------------------------------

# A machine's architecture as `uname -m` or Docker (`docker info`, an image's .Architecture)
# names it -> the architecture part of a Docker platform.
ARCHITECTURES = {
    "x86_64": "amd64",
    "amd64": "amd64",
    "aarch64": "arm64",
    "arm64": "arm64",
    "armv7l": "arm",
    "arm": "arm",
    "ppc64le": "ppc64le",
    "s390x": "s390x",
    "riscv64": "riscv64",
}
ARCHITECTURE_COMMAND = "uname -m"  # on a node: needs nothing installed (no Docker yet)
PROBE_TIMEOUT = 30.0


def platform_of(architecture: str) -> str:
    """The Docker platform ("linux/amd64", "linux/arm64") of a machine or an image, from its
    architecture as `uname -m` prints it (x86_64, aarch64), as `docker info --format
    '{{.Architecture}}'` prints it (x86_64, aarch64) or as an image records it (amd64,
    arm64). For the shipping code: a node runs image TAG when platform_of(the node's `uname
    -m`) == platform_of(image_architecture(TAG)). A UserError for an architecture Docker
    builds no image for."""
    name = architecture.strip()
    if name not in ARCHITECTURES:
        raise UserError(
            f"architecture {shown(name)} is not one Docker builds images for "
            f"({', '.join(sorted(set(ARCHITECTURES.values())))})",
            exit_code=1,
        )
    return f"linux/{ARCHITECTURES[name]}"


def image_architecture(tag: str) -> str:
    """The architecture image `tag` is built for, as Docker records it (`docker image inspect
    --format '{{.Architecture}}'`: amd64, arm64; platform_of turns it into the platform). A
    UserError when this machine's engine has no such image."""
    proc = docker("image", "inspect", "--format", "{{.Architecture}}", tag, check=False)
    if proc.returncode != 0 or not proc.stdout.strip():
        raise UserError(
            f"no image {tag} on this machine's engine", hint=f"make image TAG={tag}", exit_code=1
        )
    return proc.stdout.strip()


def architecture_refusal(tag: str, architecture: str, platform: str) -> UserError | None:
    """Why image `tag`, whose recorded architecture is `architecture`, is refused for nodes of
    `platform`, or None when it is theirs."""
    if platform_of(architecture) == platform:
        return None
    return UserError(
        f"the image {tag} was built for {platform_of(architecture)}, not the nodes' {platform}: "
        f"the build did not follow --platform {platform}",
        hint="building on a machine of the nodes' architecture",
        exit_code=1,
    )


def _base_refusal(base_image: str | None, platform: str) -> UserError | None:
    """Why the build's base cannot make an image for `platform`, or None. Docker 20.10's
    legacy builder takes --platform, yet builds on a local base of another architecture as it
    is (measured: --platform linux/arm64 on the amd64 Debian base gave an amd64 image), so
    the base is checked first. A base not on this machine is pulled for `platform` by the
    build itself."""
    base = base_image or CPU_BASE_IMAGE
    if base_image is not None and not image_exists(base):
        return None
    architecture = platform_of(image_architecture(base))
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


def nodes_platform(hosts: Sequence[Host], nodes: Nodes) -> str:
    """The one Docker platform all `hosts` run on, asked over SSH (`uname -m`, all nodes at
    once, through `nodes`: cluster.execution's SshNodes, or a fake). A UserError naming the
    nodes when they differ in architecture (one image serves one), when one cannot be reached
    or answers with an architecture Docker has no platform for."""
    if not hosts:
        raise UserError("no nodes to build the image for", exit_code=2)

    def ask(host: Host) -> str | UserError:
        try:
            answer = nodes.run(host, ARCHITECTURE_COMMAND, PROBE_TIMEOUT)
        except UserError as exc:
            return exc
        if not answer.ok:
            return UserError(
                f"host '{host.name}': {ARCHITECTURE_COMMAND} exited {answer.exit_code}: "
                f"{answer.last_line}",
                exit_code=1,
            )
        try:
            return platform_of(answer.stdout.strip().splitlines()[-1] if answer.stdout else "")
        except UserError as exc:
            return UserError(f"host '{host.name}': {exc}", exit_code=1)

    from torch_multinode.cluster.remote import (
        on_all,  # fabric and paramiko, only when nodes are asked
    )

    answers = on_all(list(hosts), ask)
    for answer in answers.values():
        if isinstance(answer, UserError):
            raise UserError(
                f"cannot learn the nodes' architecture, which the image is built for: {answer}",
                hint="bringing the node back; make image without INVENTORY builds for this "
                "machine's platform",
                exit_code=1,
            )
    return one_platform(answers)


def one_platform(platforms: dict[str, str]) -> str:
    """The platform every node (name -> its platform) shares; a UserError naming the nodes
    of each when they differ."""
    by_platform: dict[str, list[str]] = {}
    for name, platform in platforms.items():
        by_platform.setdefault(platform, []).append(name)
    if len(by_platform) == 1:
        return next(iter(by_platform))
    groups = "; ".join(
        f"{', '.join(names)} {'is' if len(names) == 1 else 'are'} {platform}"
        for platform, names in by_platform.items()
    )
    raise UserError(
        f"the nodes differ in architecture ({groups}), and one training image serves one",
        hint="an inventory or --group of nodes of one architecture",
        exit_code=2,
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
    ("linux/arm64", the nodes' one: nodes_platform), the build is pinned to it (`docker build
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
        and torch_label(tag)
        and (platform is None or platform_of(image_architecture(tag)) == platform)
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
        refusal = architecture_refusal(tag, image_architecture(tag), platform)
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
    image_id = label(_image_id(tag), tag, reported, made_from, platform, base_image)
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
    """`docker build` of `tag`, its progress shown live (see BuildWatch); on failure the
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
    try:
        watched = watch(build_events(process.stdout), progress)
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


# --- the build's output, shown live -------------------------------------------------------
# Both builders' output is read line by line: the legacy builder's ("Step 3/12 : RUN ...",
# then the step's own output) and BuildKit's with --progress=plain ("#5 [2/6] RUN ...",
# "#5 12.3 Collecting ...", "#5 DONE 40.1s"). A user sees each step's line, a short line every
# TICK_EVERY seconds while one step runs long (a base pulled, pip installing, a big layer
# written), and on failure the output's last lines: never the hundreds of lines pip prints.

TICK_EVERY = 10.0  # seconds between "still running" lines in a step's first minute (then 3x)
TAIL_LINES = 20  # the output's last lines shown when a build fails
SHOWN_CHARS = 100  # of one output line in a progress line

_LEGACY_STEP = re.compile(r"^Step (\d+/\d+) : (.*)$")
_BUILDKIT_LINE = re.compile(r"^#(\d+) (.*)$")
_BUILDKIT_STEP = re.compile(r"^\[(?:(\S+) )?(\d+/\d+)\] (.*)$")
_BUILDKIT_OUTPUT = re.compile(r"^\d+\.\d+ (.*)$")  # "12.3 Collecting ...": seconds, output
_BUILDKIT_END = re.compile(r"^(DONE \d+(\.\d+)?s|CACHED|CANCELED|ERROR\b.*)$")
# What the legacy builder says about its own work, not the step's output.
_LEGACY_OWN = (" ---> ", "Removing intermediate container", "Sending build context")
# The docker client's notice before a legacy build (3 lines), not part of the build.
_LEGACY_NOTICE = "DEPRECATED: The legacy builder is deprecated"
_FAILURES = re.compile(r"^(ERROR|Error|error|The command '|failed to |unable to )")


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


def duration(seconds: float) -> str:
    """A time as progress lines and summaries say it: "42 s", "2 min 05 s"."""
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds} s"
    return f"{seconds // 60} min {seconds % 60:02d} s"


def _clean(text: str, limit: int = SHOWN_CHARS) -> str:
    """One output line as a progress line shows it: what a carriage return left visible,
    control characters as spaces, cut to `limit` characters."""
    text = text.rstrip("\r\n").rsplit("\r", 1)[-1]
    text = "".join(c if c.isprintable() else " " for c in text).strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _said(line: str) -> str:
    """A line of output without BuildKit's vertex number and seconds ("#5 12.3 ")."""
    vertex = _BUILDKIT_LINE.match(line)
    if vertex is None:
        return line.strip()
    output = _BUILDKIT_OUTPUT.match(vertex[2])
    return (output[1] if output else vertex[2]).strip()


@dataclass
class _Phase:
    """What the build is doing: a step ("step 5/12") or BuildKit's other work ("exporting to
    image"), since when, and its latest output line."""

    name: str
    started: float
    latest: str = ""
    latest_at: float = 0.0
    next_tick: float = 0.0


class BuildWatch:
    """What a `docker build`'s output shows a user, fed one (time, line) at a time; a line of
    None says only that time passed. The legacy builder's and BuildKit's plain output are both
    read, told apart by their lines, so nothing needs to know beforehand which builder runs.

    `feed` returns the lines to show: each step's line ("  Step 5/12 : RUN ..."), and while a
    step runs long, one line after `every` seconds and again every `every` seconds for its first
    minute, then every 3 x `every` ("  ... step 5/12 still running (40 s): <its latest output
    line>"). On failure `failure_lines` is the output's last lines and `reason` the line that
    says why."""

    def __init__(self, every: float = TICK_EVERY):
        self.every = every
        self.builder: str | None = None  # "legacy" or "buildkit", once a line tells
        self.phase: _Phase | None = None
        self.last_step = ""  # the step the build reached ("5/12"), for the error line
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._open: dict[str, _Phase] = {}  # BuildKit: the vertices under way, by number
        self._notice = False  # inside the client's notice about the legacy builder

    def feed(self, now: float, text: str | None) -> list[str]:
        shown = [] if text is None else self._line(now, text.rstrip("\r\n"))
        return shown + self._tick(now)

    def _line(self, now: float, text: str) -> list[str]:
        if text.startswith(_LEGACY_NOTICE):
            self._notice = True
        elif self._notice and not text[:1].isspace():
            self._notice = False
        if self._notice or not text.strip():
            return []
        self.tail.append(text)
        step = _LEGACY_STEP.match(text) if self.builder != "buildkit" else None
        if step:
            self.builder = "legacy"
            return self._begin(now, step[1], step[2])
        vertex = _BUILDKIT_LINE.match(text) if self.builder != "legacy" else None
        if vertex and (self.builder == "buildkit" or vertex[2].startswith("[")):
            self.builder = "buildkit"
            return self._buildkit(now, vertex[1], vertex[2])
        if text.startswith("Successfully built "):
            self.phase = None  # the legacy build is done; only the tag is left
        elif self.builder == "legacy" and self.phase and not text.startswith(_LEGACY_OWN):
            self._output(now, self.phase, text)
        return []

    def _begin(self, now: float, step: str, what: str, stage: str = "") -> list[str]:
        self.last_step = step
        name = f"step {step}" + (f" of {stage}" if stage else "")
        self.phase = _Phase(name, now, next_tick=now + self.every)
        return [f"  Step {step}{f' ({stage})' if stage else ''} : {_clean(what)}"]

    def _buildkit(self, now: float, number: str, rest: str) -> list[str]:
        if number not in self._open:
            if _BUILDKIT_END.match(rest):
                return []  # the end of a vertex whose start went by
            step = _BUILDKIT_STEP.match(rest)
            if step:
                shown = self._begin(now, step[2], step[3], step[1] or "")
            else:
                what = rest.removeprefix("[internal] ")
                self.phase, shown = _Phase(_clean(what), now, next_tick=now + self.every), []
            self._open[number] = self.phase
            return shown
        phase = self._open[number]
        if _BUILDKIT_END.match(rest):
            del self._open[number]
            if phase is self.phase:  # the newest vertex still under way, if any, is shown next
                self.phase = next(reversed(self._open.values()), None)
            return []
        output = _BUILDKIT_OUTPUT.match(rest)
        self._output(now, phase, output[1] if output else rest)
        return []

    def _output(self, now: float, phase: _Phase, text: str) -> None:
        if _clean(text):
            phase.latest, phase.latest_at = _clean(text), now

    def _tick(self, now: float) -> list[str]:
        phase = self.phase
        if phase is None or now < phase.next_tick:
            return []
        running = now - phase.started
        while phase.next_tick <= now:  # on the schedule, not drifting with the events' times
            since = phase.next_tick - phase.started
            phase.next_tick += self.every if since < 6 * self.every else 3 * self.every
        line = f"  ... {phase.name} still running ({duration(running)})"
        if not phase.latest:
            return [f"{line}, no output yet"]
        if now - phase.latest_at >= self.every:
            quiet = duration(now - phase.latest_at)
            return [f"{line}, no output for {quiet}; last: {phase.latest}"]
        return [f"{line}: {phase.latest}"]

    def where(self) -> str:
        """' at step 5/12' once a step began, for the error line ('' before)."""
        return f" at step {self.last_step}" if self.last_step else ""

    def reason(self) -> str:
        """The output's line that says why the build failed: the builder's own error line, else
        the last line ('no output' when there was none)."""
        lines = [_said(line) for line in self.tail]
        said = [line for line in lines if _FAILURES.match(line)]
        why = (said or lines or ["no output"])[-1]
        return _clean(why.removeprefix("ERROR: "), 2 * SHOWN_CHARS)

    def failure_lines(self) -> list[str]:
        """The output's last lines (up to TAIL_LINES), indented, under one line that says so."""
        if not self.tail:
            return []
        return [f"  The build's last {len(self.tail)} lines:"] + [
            f"    {line}" for line in self.tail
        ]


def build_events(
    stream: Iterable[str], clock: Callable[[], float] = time.monotonic, poll: float = 1.0
) -> Iterator[tuple[float, str | None]]:
    """A build's output as BuildWatch reads it: (time, line) for each line as it comes, and
    (time, None) after `poll` seconds without one, so that a step silent for minutes is still
    reported. A thread reads `stream`; the events end when it does."""
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        try:
            for line in stream:
                lines.put(line)
        finally:
            lines.put(None)

    threading.Thread(target=read, name="docker-build-output", daemon=True).start()
    while True:
        try:
            line = lines.get(timeout=poll)
        except queue.Empty:
            yield clock(), None
            continue
        if line is None:
            return
        yield clock(), line


def watch(
    events: Iterable[tuple[float, str | None]], progress: Progress, every: float = TICK_EVERY
) -> BuildWatch:
    """Every event through a BuildWatch, what it shows given to `progress` as it comes; the
    watch, for the lines a failure shows."""
    watched = BuildWatch(every)
    for now, text in events:
        for line in watched.feed(now, text):
            progress(line)
    return watched


# What `--version` said, per image ID and `gpus`, in this process: an image ID names its layers
# and configuration, so the answer cannot differ, and `cluster image` asks again right after
# the build asked (a torch import in a container: 10 to 30 s on a busy 2-core machine).
_VERSIONS: dict[tuple[str, bool], dict[str, str]] = {}


def versions(tag: str, gpus: bool = False) -> dict[str, str]:
    """What the image says it holds (its default command). No GPU is needed; with `gpus` (on a
    machine with NVIDIA's container toolkit) a CUDA image also counts this machine's GPUs."""
    identity = docker("image", "inspect", "--format", "{{.Id}}", tag, check=False).stdout.strip()
    if identity and (identity, gpus) in _VERSIONS:
        return dict(_VERSIONS[identity, gpus])
    with_gpus = ["--gpus", "all"] if gpus else []
    proc = docker("run", "--rm", *with_gpus, tag, "--version", timeout=120)
    found = dict(line.split(": ", 1) for line in proc.stdout.splitlines() if ": " in line)
    if identity:
        _VERSIONS[identity, gpus] = dict(found)
    return found
