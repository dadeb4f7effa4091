"""The training image's platform: the nodes' one. A machine's or an image's architecture as a
Docker platform, the nodes' asked over SSH (`uname -m`), and the refusal of an image built for
another; provision.images pins its build to it and provision.ship checks it before shipping.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from torch_multinode.cluster.engine import docker
from torch_multinode.cluster.errors import UserError, shown
from torch_multinode.cluster.inventory import Host

if TYPE_CHECKING:
    from torch_multinode.cluster.execution import Nodes

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

    platforms: dict[str, str] = {}
    for name, answer in on_all(list(hosts), ask).items():
        if isinstance(answer, UserError):
            raise UserError(
                f"cannot learn the nodes' architecture, which the image is built for: {answer}",
                hint="bringing the node back; make image without INVENTORY builds for this "
                "machine's platform",
                exit_code=1,
            )
        platforms[name] = answer
    return one_platform(platforms)


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
