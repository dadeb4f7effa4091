"""What a simulated node container is made of: its image (a Debian base from the distribution's
packages, then docker/sim-node), this controller's Python environment mounted at the same paths,
and the options a Docker engine (or systemd) inside it needs. sim.nodes starts the containers.
"""

from __future__ import annotations

import sys
from pathlib import Path

from torch_multinode.cluster.engine import Progress, debian_base, docker
from torch_multinode.cluster.sync import TOOL_ROOT

SIM_NODE_CONTEXT = TOOL_ROOT / "docker" / "sim-node"
BASE_IMAGE = "torch-multinode/sim-base:bookworm"
NODE_IMAGE = "torch-multinode/sim-node:latest"
# rsync as on Ubuntu Server, where it is installed by default (provisioning installs it where
# it is not): the launcher sends a job's project with it, also to unprovisioned nodes.
BASE_PACKAGES = (
    "python3",
    "openssh-server",
    "iproute2",
    "iputils-ping",
    "procps",
    "sudo",
    "ca-certificates",
    "less",
    "iptables",
    "mount",
    "rsync",
)
PACKAGE_DIRS = ("torch_multinode", "cluster", "training", "netcheck")


# What a Docker engine (or systemd) inside a node container needs: --privileged is refused on
# this kernel (ENVIRONMENT.md), one capability cannot be granted.
NESTED_ENGINE_OPTIONS = (
    "--cap-add",
    "ALL",
    "--cap-drop",
    "SYS_RESOURCE",
    "--security-opt",
    "seccomp=unconfined",
    "--security-opt",
    "apparmor=unconfined",
    "--cgroupns",
    "private",
)


def _quiet(_: str) -> None:
    pass


def build_images(progress: Progress = _quiet) -> None:
    """The node base from Debian's packages once, then the node image (cached layers)."""
    debian_base(BASE_IMAGE, BASE_PACKAGES, progress)
    progress("Building the node image (cached after the first time)...")
    docker(
        "build",
        "--quiet",
        "--build-arg",
        f"BASE={BASE_IMAGE}",
        "-t",
        NODE_IMAGE,
        str(SIM_NODE_CONTEXT),
    )


def python_mounts() -> list[str]:
    """Bind mounts giving a node this controller's Python environment at the same paths.

    A venv is not relocatable (its interpreter link and script shebangs are absolute), so the
    venv, its base interpreter and the project's package directories (the editable install
    points at them) appear in the node exactly where they are here, read-only. The repository
    itself is not mounted: the simulator's private key lives in it.
    """
    paths = [Path(sys.prefix)]
    base = Path(sys.base_prefix)
    if str(base) not in ("/", "/usr", "/usr/local"):
        paths.append(base)
    paths += [TOOL_ROOT / name for name in PACKAGE_DIRS]
    mounts = []
    for path in paths:
        mounts += ["-v", f"{path}:{path}:ro"]
    return mounts
