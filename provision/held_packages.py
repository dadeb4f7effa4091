"""What a Python environment holds, as a project's dependencies see it (provision.dependencies):
the training image's, or this machine's (the .venv `train` runs in), and which of its packages a
requirement may never change.

- **What it holds.** The environment's own interpreter reports its Python, the wheel tags it
  installs (most preferred first) and its installed distributions (`PROBE`): the image's asked
  once per image ID (`probe_image`; an ID names its content) and kept in CACHE/images, this
  machine's asked each time (`probe_here`). `Environment` is that answer.
- **What is held.** torch, torchvision, triton and the CUDA libraries the environment carries
  (each of its `nvidia-*` and `cuda-*` distributions, `held`) stay at its versions:
  `constraints` is the one list of them (the layer's, a local job's, the digest's). A
  requirement naming one of them with a version the environment does not carry is refused
  before anything is downloaded (`refusal`); one whose own dependencies need another version of
  one is refused by provision.resolution when the resolution meets it; both in one line naming
  the requirement (`replacing`).

CACHE, the directory of this checkout (git-ignored) that every part of a project's dependencies
keeps its files in (the probes' answers here; the stand-ins, resolutions and wheels of
provision.resolution; a local job's packages), is named here alone: the other modules read it
as `held_packages.CACHE` when they use it.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from torch_multinode.cluster import files
from torch_multinode.cluster.engine import docker
from torch_multinode.cluster.errors import UserError
from torch_multinode.cluster.sync import TOOL_ROOT

CACHE = TOOL_ROOT / ".cache" / "torch-multinode" / "deps"
HELD_NAMES = ("torch", "torchvision", "triton")
HELD_PREFIXES = ("nvidia-", "cuda-")

# Run by the image's own interpreter (or this machine's): its Python, the wheel tags it installs
# (most preferred first) and its installed distributions. The standalone packaging module where
# there is one, else pip's own copy of it.
PROBE = """\
import importlib.metadata as metadata, json, sys
try:
    from packaging import tags
except ImportError:
    from pip._vendor.packaging import tags
installed = {}
for distribution in metadata.distributions():
    name = distribution.metadata["Name"]
    if name:
        installed.setdefault(name, distribution.version)
print(json.dumps({"python": "%d.%d" % sys.version_info[:2],
                  "tags": [str(tag) for tag in tags.sys_tags()], "installed": installed}))
"""


def canonical(name: str) -> str:
    """A distribution's name as the index compares names (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class Environment:
    """A Python environment as the resolution sees it: the image's, or this machine's."""

    where: str  # how lines name it: "the training image NAME", "this machine's /path/.venv"
    python: str  # "3.11"
    tags: tuple[str, ...]  # the wheel tags it installs, most preferred first
    installed: dict[str, tuple[str, str]]  # canonical name -> (its own spelling, version)

    @property
    def abi(self) -> str:
        return self.tags[0].split("-")[1] if self.tags else "none"

    @property
    def implementation(self) -> str:
        interpreter = self.tags[0].split("-")[0] if self.tags else "py3"
        return re.sub(r"\d+$", "", interpreter) or "py"

    @property
    def platforms(self) -> tuple[str, ...]:
        found: list[str] = []
        for tag in self.tags:
            platform = tag.rsplit("-", 1)[-1]
            if platform != "any" and platform not in found:
                found.append(platform)
        return tuple(found)

    @property
    def shown(self) -> str:
        """Its Python and platform, as a line shows them: 'Python 3.11, manylinux_2_36_x86_64'
        (the newest manylinux it takes, where it takes one)."""
        named = [p for p in self.platforms if p.startswith("manylinux")] or list(self.platforms)
        return f"Python {self.python}" + (f", {named[0]}" if named else "")


def environment_from(text: str, where: str, errors: str = "") -> Environment:
    """The PROBE's answer (its standard output, `text`) as an Environment; `errors`: what it
    wrote on its standard error, for the error line where there is no answer."""
    try:
        found = json.loads(text.strip().splitlines()[-1])
        installed = {
            canonical(name): (name, str(version)) for name, version in found["installed"].items()
        }
        return Environment(where, str(found["python"]), tuple(found["tags"]), installed)
    except (ValueError, LookupError, AttributeError, TypeError):
        said = (errors + text).strip().splitlines() or ["no answer"]
        raise UserError(
            f"cannot read which Python and packages {where} holds: {said[-1][:200]}",
            exit_code=1,
        ) from None


def probe_image(image: str, image_id: str) -> Environment:
    """What the image's own interpreter reports, asked once per image ID (an ID names its
    content, so the answer cannot change) and kept in the cache."""
    where = f"the training image {image}"
    cached = CACHE / "images" / f"{image_id.removeprefix('sha256:')}.json"
    if cached.is_file():
        return environment_from(cached.read_text(), where)
    answer = docker(
        "run",
        "--rm",
        "--network",
        "none",
        "--entrypoint",
        "python3",
        image_id,
        "-c",
        PROBE,
        check=False,
        timeout=300,
    )
    found = environment_from(answer.stdout, where, answer.stderr)
    files.write_atomically(cached, answer.stdout.strip().splitlines()[-1] + "\n")
    return found


def probe_here() -> Environment:
    """What this machine's environment (the one `train` runs in) holds."""
    answer = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=False
    )
    return environment_from(answer.stdout, f"this machine's {sys.prefix}", answer.stderr)


def held(environment: Environment) -> dict[str, tuple[str, str]]:
    """torch, torchvision, triton and the CUDA libraries the environment carries: what a
    requirement never changes."""
    return {
        name: found
        for name, found in environment.installed.items()
        if name in HELD_NAMES or name.startswith(HELD_PREFIXES)
    }


def constraints(environment: Environment) -> str:
    """The constraints file that holds torch, torchvision, triton and the CUDA libraries to the
    environment's versions: the one list of them (the layer's, a local job's, the digest's)."""
    return "".join(
        f"{name}=={version}\n" for _, (name, version) in sorted(held(environment).items())
    )


def replacing(
    source: str, what: str, name: str, environment: Environment, who: str | None = None
) -> UserError:
    """The refusal of a requirement that would change a held package: `what` asks for `name`,
    directly (`who` None) or as a dependency of the package `who`."""
    have = held(environment)[name][1]
    if who is None:
        fix = f"leaving {name} out of {source}, or a range that holds {have}"
    else:
        fix = f"another version of {who} in {source}, one that takes {name} {have}"
    return UserError(
        f"{source}: {what}, which would replace the {name} {have} of {environment.where}",
        hint=f"{fix}: jobs run with the torch, torchvision and CUDA libraries of the environment "
        "they run in",
    )


def refusal(requirements: Sequence[str], source: str, environment: Environment) -> UserError | None:
    """Why a requirement that names torch, torchvision, triton or a CUDA library of the
    environment is refused, before anything is downloaded: a version the environment does not
    carry (or a URL in its place). None when every one agrees with what is there."""
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.version import InvalidVersion, Version

    kept = held(environment)
    for line in requirements:
        try:
            requirement = Requirement(line)
        except InvalidRequirement:
            continue  # launch.requirements refused it already, naming its line
        name = canonical(requirement.name)
        if name not in kept:
            continue
        if requirement.marker is not None and not requirement.marker.evaluate(
            {"python_version": environment.python}
        ):
            continue
        try:
            agrees = requirement.url is None and requirement.specifier.contains(
                Version(kept[name][1]), prereleases=True
            )
        except InvalidVersion:
            agrees = False
        if not agrees:
            return replacing(source, line, name, environment)
    return None
