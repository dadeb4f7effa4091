"""A project's Python dependencies: a layer on the training image for its jobs on the nodes,
and the same packages in a directory of this checkout for its jobs on this machine.

Which requirements a project has is launch.staging's decision (requirements.txt, else
pyproject.toml's [project] dependencies, else REQUIREMENTS=path; REQUIREMENTS=none: none).
Here they become packages, on the controller alone: only it reaches the package index.

- **What is held.** torch, torchvision, triton and the CUDA libraries the image carries (each of
  its `nvidia-*` and `cuda-*` distributions) stay at the image's versions: `constraints` is the
  one list of them. A requirement naming one of them with a version the image does not carry is
  refused before anything is downloaded (`refusal`); one whose own dependencies need another
  version of one is refused when the resolution meets it, before anything is built; both in one
  line naming the requirement. Every other package the image carries is kept at its version
  unless a requirement needs another (pip's `only-if-needed`, done here: each is pinned to the
  image's version, and a pin is let go only where the resolution conflicts with it).
- **How it resolves.** pip's own resolver, `pip download --only-binary=:all:` for the wheel
  tags the image's own interpreter reports (its Python, ABI and platforms: asked once per image
  ID, `probe_image`), against stand-ins for every distribution the image holds (`stand_ins`:
  tiny wheels of its name and version, no files, no dependencies, which sort above the index's
  copy of that version), the held ones pinned. What it downloads that is no stand-in is exactly
  what the layer adds. A requirement published only as source is built into a wheel here
  (`pip wheel`) and taken only if that wheel suits the image's tags (a pure-Python one always
  does). Cached per digest in .cache/torch-multinode/deps/ of this checkout (git-ignored).
- **The layer.** One RUN on the training image's ID (one layer): `pip install --no-index
  --no-deps` of exactly the resolved packages, from wheels served to the build on a loopback
  address as the training image's are (provision.images.serve_wheels): nodes need no package
  index, and no wheel enters the build context or a layer. Its tag is the digest of the
  requirements, the training image's ID and the constraints (`layer_digest`): built once; a
  later run with the same three builds nothing and says so, and a changed requirement is a new
  tag, one layer on the same base, which provision.ship sends by layers (only that layer
  travels; a node that holds it gets nothing). Its labels record the digest and the resolved
  packages (pip freeze's form), which the run's record keeps.
- **This machine.** A local job resolves the same requirements the same way against this
  machine's environment (the .venv `train` runs in, which holds the same pinned torch), and the
  packages go into .cache/torch-multinode/deps/DIGEST/site with `pip install --target`, which
  launch.environment puts on the job's import path: .venv itself is never changed.
"""

from __future__ import annotations

import email.parser
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from torch_multinode.cluster import files
from torch_multinode.cluster.engine import docker
from torch_multinode.cluster.errors import UserError
from torch_multinode.cluster.inventory import Host, Inventory
from torch_multinode.cluster.sync import TOOL_ROOT
from torch_multinode.provision import images, ship, ship_progress
from torch_multinode.provision.build_watch import duration

Emit = Callable[[str], None]

CACHE = TOOL_ROOT / ".cache" / "torch-multinode" / "deps"
REPOSITORY = "torch-multinode/deps"
DIGEST_LABEL = "io.torch-multinode.dependencies"
RESOLVED_LABEL = "io.torch-multinode.dependencies.resolved"
# In the layer: what it installed, one `name==version` a line.
LIST_PATH = "/usr/local/lib/torch-multinode/dependencies.txt"
RESOLVED_FILE = "resolved.txt"
SITE = "site"  # a local job's packages, in its digest's directory
# What the digests are made of, and how: a change here makes every layer anew.
FORMAT = "torch-multinode dependencies 1"
HELD_NAMES = ("torch", "torchvision", "triton")
HELD_PREFIXES = ("nvidia-", "cuda-")
# The local version label of a stand-in whose distribution's version has none: it sorts above
# the index's copy of the same version, so the resolution takes the stand-in.
STAND_IN_LABEL = "tmnheld"
RESOLUTION_ROUNDS = 12  # each round lets go of the pins a conflict named, or builds a wheel
PIP_TIMEOUT = 1800.0
PIP_TICK = 10.0  # seconds between two progress lines while pip resolves

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


def _replacing(
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
            continue  # launch.staging refused it already, naming its line
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
            return _replacing(source, line, name, environment)
    return None


def layer_digest(requirements: Sequence[str], base: str, held_text: str) -> str:
    """The digest of the requirements, the base they go on (the training image's ID) and the
    constraints: the layer's tag, and the name of its resolution's cache."""
    digest = hashlib.sha256()
    for part in (FORMAT, base, held_text, *requirements):
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()


def layer_tag(digest: str) -> str:
    return f"{REPOSITORY}:{digest[:20]}"


def dockerfile(base_id: str, packages: Sequence[str]) -> str:
    """The layer's Dockerfile: one RUN on the base's ID (one layer), for the legacy builder as
    for BuildKit (no BuildKit syntax). pip installs exactly `packages` from the wheels served to
    the build (images.WHEELS_URL) and resolves nothing itself; the list stays in the image."""
    listed = " ".join(shlex.quote(package) for package in packages)
    return (
        "# A project's dependencies on the training image (torch-multinode, "
        "provision/dependencies.py):\n"
        "# the packages resolved on the controller, installed from wheels served to this build.\n"
        f"FROM {base_id}\n"
        f"RUN mkdir -p {posix_dirname(LIST_PATH)} \\\n"
        f"    && printf '%s\\n' {listed} > {LIST_PATH} \\\n"
        "    && python3 -m pip install --no-cache-dir --no-index --no-deps "
        "--disable-pip-version-check \\\n"
        f"        --trusted-host {images.WHEELS_HOST} --find-links {images.WHEELS_URL} "
        f"-r {LIST_PATH}\n"
    )


def posix_dirname(path: str) -> str:
    return path.rsplit("/", 1)[0]


# -- the stand-ins and the resolution -------------------------------------------------------


def stand_in_version(version: str) -> str | None:
    """The version of a distribution's stand-in: its own with STAND_IN_LABEL as local label
    (above the index's copy of it), or as it is where it has a local label of its own (no index
    has it); None where it is no version pip reads."""
    from packaging.version import InvalidVersion, Version

    try:
        parsed = Version(version)
    except InvalidVersion:
        return None
    return str(parsed) if parsed.local else f"{parsed}+{STAND_IN_LABEL}"


def _wheel_name(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name)


def write_stand_in(directory: Path, name: str, version: str) -> Path:
    """A wheel that installs nothing and needs nothing: only its name and version."""
    info = f"{_wheel_name(name)}-{version}.dist-info"
    texts = {
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: torch-multinode\n"
        "Root-Is-Purelib: true\nTag: py3-none-any\n",
    }
    texts[f"{info}/RECORD"] = "".join(f"{path},,\n" for path in [*texts, f"{info}/RECORD"])
    path = directory / f"{_wheel_name(name)}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        for member, text in texts.items():
            wheel.writestr(member, text)
    return path


def stand_ins(environment: Environment) -> Path:
    """A directory of a stand-in for each distribution the environment holds, made once per
    set of distributions."""
    listed = sorted(environment.installed.values())
    key = hashlib.sha256(json.dumps(listed).encode()).hexdigest()[:20]
    directory = CACHE / "stand-ins" / key
    if directory.is_dir():
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".making-", dir=directory.parent))
    for name, version in listed:
        stand_in = stand_in_version(version)
        if stand_in is not None:
            write_stand_in(scratch, name, stand_in)
    _settle(scratch, directory)
    return directory


def _settle(scratch: Path, directory: Path) -> None:
    """`scratch` becomes `directory`, unless another run made it first (then it is dropped)."""
    try:
        os.rename(scratch, directory)
    except OSError:
        shutil.rmtree(scratch, ignore_errors=True)
        if not directory.is_dir():
            raise


@dataclass(frozen=True)
class Cause:
    """One line of pip's "The conflict is caused by:"."""

    text: str  # "foo 1.0 depends on torch<2", "torch==2.13.0"
    name: str  # the canonical name of the package it asks for
    constraint: bool  # a line of the constraints file
    requester: str | None = None  # the package whose dependency it is ("foo"); None: asked


_CAUSE = re.compile(
    r"^\s+(?:The user requested (?P<constraint>\(constraint\) )?(?P<asked>\S.*)"
    r"|(?P<who>\S+ \S+) depends on (?P<needs>\S.*))$"
)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_NO_VERSION = re.compile(r"Could not find a version that satisfies the requirement (\S+)")


def conflict(output: str) -> list[Cause]:
    """The causes pip names for a conflict it cannot resolve ([] where it names none)."""
    lines = output.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if "The conflict is caused by:" in line)
    except StopIteration:
        return []
    causes = []
    for line in lines[start + 1 :]:
        found = _CAUSE.match(line)
        if not line.strip() or found is None:
            break
        asked = found.group("asked") or found.group("needs")
        name = _NAME.match(asked)
        if name is None:
            continue
        who = found.group("who")
        text = asked if who is None else f"{who} depends on {asked}"
        requester = None if who is None else who.split()[0]
        causes.append(
            Cause(text, canonical(name.group(0)), bool(found.group("constraint")), requester)
        )
    return causes


def _excludes(cause: Cause, version: str) -> bool:
    """Whether what `cause` asks for leaves out `version` (True where it cannot be read)."""
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.version import InvalidVersion, Version

    asked = cause.text.split(" depends on ", 1)[-1]
    try:
        return not Requirement(asked).specifier.contains(Version(version), prereleases=True)
    except (InvalidRequirement, InvalidVersion):
        return True


def no_wheel(output: str) -> str | None:
    """The requirement pip found no wheel for ('antlr4-python3-runtime==4.9.*'), if that is
    why it stopped."""
    found = _NO_VERSION.search(output)
    return found.group(1) if found else None


def _requirement_name(requirement: str) -> str:
    found = _NAME.match(requirement)
    return found.group(0) if found else requirement


def _last_error(output: str) -> str:
    errors = [line.strip() for line in output.splitlines() if line.strip().startswith("ERROR:")]
    lines = errors or [line.strip() for line in output.splitlines() if line.strip()]
    return (lines or ["no output"])[-1].removeprefix("ERROR: ")[:300]


def wheel_tags(filename: str) -> set[str]:
    """The tags a wheel's file name says it installs on ('py3-none-any', ...)."""
    parts = filename.removesuffix(".whl").split("-")
    if len(parts) < 5:
        return set()
    python, abi, platform = parts[-3:]
    return {
        f"{p}-{a}-{m}"
        for p in python.split(".")
        for a in abi.split(".")
        for m in platform.split(".")
    }


def wheel_pin(path: Path) -> str:
    """`Name==version` of a wheel, as its metadata spells them (pip freeze's form)."""
    with zipfile.ZipFile(path) as wheel:
        member = next(
            name
            for name in wheel.namelist()
            if name.count("/") == 1 and name.endswith(".dist-info/METADATA")
        )
        headers = email.parser.HeaderParser().parsestr(wheel.read(member).decode(errors="replace"))
    return f"{headers['Name']}=={headers['Version']}"


def _pip(arguments: list[str], emit: Emit | None = None, what: str = "") -> tuple[int, str]:
    """`python -m pip ARGUMENTS` with this machine's pip (and its configuration: its index);
    its exit code and output. With `emit`, a line every PIP_TICK seconds while it works, with
    the package it is at."""
    process = subprocess.Popen(
        [sys.executable, "-m", "pip", *arguments, "--disable-pip-version-check"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
    )
    started = shown = time.monotonic()
    lines: list[str] = []
    try:
        assert process.stdout is not None  # stdout=PIPE
        for line in process.stdout:
            lines.append(line)
            now = time.monotonic()
            if emit is not None and now - shown >= PIP_TICK and line.strip():
                shown = now
                emit(
                    f"dependencies: {what} still going ({duration(now - started)}): "
                    f"{line.strip()[:100]}"
                )
        code = process.wait(timeout=PIP_TIMEOUT)
    except BaseException:  # Ctrl-C, or pip never ending: it stops with us
        process.kill()
        process.wait()
        raise
    return code, "".join(lines)


def _download(
    requirements: Path,
    pins: Path,
    environment: Environment,
    wheels: Path,
    finds: Sequence[Path],
    emit: Emit,
) -> tuple[int, str]:
    target = [
        "--only-binary=:all:",
        "--python-version",
        environment.python,
        "--implementation",
        environment.implementation,
        "--abi",
        environment.abi,
    ]
    for platform in environment.platforms:
        target += ["--platform", platform]
    links = [argument for path in finds for argument in ("--find-links", str(path))]
    return _pip(
        [
            "download",
            "--progress-bar",
            "off",
            "--dest",
            str(wheels),
            *links,
            *target,
            "-c",
            str(pins),
            "-r",
            str(requirements),
        ],
        emit,
        "resolving",
    )


def _from_source(
    requirement: str, source: str, environment: Environment, built: Path, pins: Path, emit: Emit
) -> None:
    """A wheel of `requirement`, published only as source, built here: kept where it suits the
    environment's tags (a pure-Python one always does)."""
    emit(f"dependencies: {requirement} has no wheel on the package index: building one here...")
    before = set(built.iterdir())
    code, output = _pip(
        ["wheel", "--no-deps", "--wheel-dir", str(built), "-c", str(pins), requirement],
        emit,
        f"building {requirement}",
    )
    if code != 0 and "No matching distribution found" in output:
        raise UserError(
            f"{source}: the package index this machine reaches has no {requirement}",
            hint=f"the name and versions of {_requirement_name(requirement)} in {source}",
        )
    if code != 0:
        raise UserError(
            f"{source}: {requirement} has no wheel for {environment.where}, and building one "
            f"here failed: {_last_error(output)}",
            hint=f"a version of {_requirement_name(requirement)} that publishes wheels",
            exit_code=1,
        )
    for wheel in sorted(set(built.iterdir()) - before):
        tags = wheel_tags(wheel.name)
        if not tags & set(environment.tags):
            wheel.unlink()
            raise UserError(
                f"{source}: {requirement} has no wheel for {environment.where} "
                f"({environment.shown}), and the one built here is for {sorted(tags)[0]}",
                hint="a version of it that publishes wheels for that Python and platform",
                exit_code=1,
            )


def resolve(
    requirements: Sequence[str],
    source: str,
    environment: Environment,
    directory: Path,
    emit: Emit,
) -> tuple[str, ...]:
    """What `requirements` add to `environment`, as `Name==version` (pip freeze's form), their
    wheels downloaded into `directory`/wheels (resolved once per `directory`: a layer's or a
    local environment's digest). A held package that would change is refused, naming the
    requirement that asks for it."""
    done = directory / RESOLVED_FILE
    if done.is_file():
        return tuple(done.read_text().split())
    CACHE.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".resolving-", dir=CACHE))
    try:
        wheels, built = scratch / "wheels", scratch / "built"
        wheels.mkdir()
        built.mkdir()
        wanted, pins = scratch / "requirements.txt", scratch / "constraints.txt"
        wanted.write_text("".join(f"{line}\n" for line in requirements))
        stand_in = stand_ins(environment)
        kept_held = held(environment)
        # Every other package it holds stays at its version until a conflict says otherwise.
        kept = {
            name: found
            for name, found in environment.installed.items()
            if name not in kept_held and stand_in_version(found[1]) is not None
        }
        emit(
            f"dependencies: resolving {source} ({len(requirements)} requirement(s)) for "
            f"{environment.where} ({environment.shown}) on the package index this machine "
            "reaches..."
        )
        started = time.monotonic()
        built_from_source: set[str] = set()
        for _ in range(RESOLUTION_ROUNDS):
            pins.write_text(
                constraints(environment)
                + "".join(f"{name}=={version}\n" for _, (name, version) in sorted(kept.items()))
            )
            for leftover in wheels.iterdir():
                leftover.unlink()
            code, output = _download(wanted, pins, environment, wheels, (stand_in, built), emit)
            if code == 0:
                break
            causes = conflict(output)
            if causes:
                pinned = {cause.name for cause in causes if cause.constraint}
                against = [
                    cause
                    for cause in causes
                    if not cause.constraint and cause.name in pinned & set(kept_held)
                ]
                if against:  # the one that asks for another version than the held one
                    cause = next(
                        (c for c in against if _excludes(c, kept_held[c.name][1])), against[0]
                    )
                    raise _replacing(source, cause.text, cause.name, environment, cause.requester)
                released = sorted(pinned & set(kept))
                if not released:
                    raise UserError(
                        f"{source}: its requirements do not go together: "
                        + "; ".join(cause.text for cause in causes),
                        hint=f"versions in {source} that agree",
                    )
                emit(
                    f"dependencies: {source} needs another version of "
                    f"{', '.join(kept[name][0] for name in released)} than {environment.where} "
                    "holds: it comes with the project's packages"
                )
                for name in released:
                    del kept[name]
                continue
            missing = no_wheel(output)
            if missing is not None and missing not in built_from_source:
                built_from_source.add(missing)
                _from_source(missing, source, environment, built, pins, emit)
                continue
            raise UserError(
                f"resolving {source} on the package index failed: {_last_error(output)}",
                hint=f"the names and versions in {source}, and that this machine reaches its "
                "package index (pip download works here)",
                exit_code=1,
            )
        else:
            raise UserError(
                f"resolving {source} took more than {RESOLUTION_ROUNDS} rounds of pip download",
                hint=f"pinning the versions of {source}",
                exit_code=1,
            )
        ours = {path.name for path in stand_in.iterdir()}
        packages = []
        for wheel in sorted(wheels.glob("*.whl")):
            if wheel.name in ours:
                wheel.unlink()
            else:
                packages.append(wheel_pin(wheel))
        packages.sort(key=str.lower)
        for package in packages:  # the stand-ins hold them; should pip ever take another
            name = canonical(package.split("==")[0])
            if name in kept_held:
                raise _replacing(source, f"{package} (resolved)", name, environment)
        (scratch / RESOLVED_FILE).write_text("".join(f"{package}\n" for package in packages))
        emit(
            f"dependencies: {source} adds {len(packages)} package(s) to {environment.where}"
            + (f": {', '.join(packages)}" if packages else "")
            + f" (resolved in {duration(time.monotonic() - started)})"
        )
        directory.parent.mkdir(parents=True, exist_ok=True)
        _settle(scratch, directory)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return tuple(done.read_text().split())


# -- the result, for the job and its record -------------------------------------------------


@dataclass(frozen=True)
class Dependencies:
    """A project's dependencies, made ready for one job."""

    source: str  # "requirements.txt", "pyproject.toml", a path given
    requirements: tuple[str, ...]
    digest: str
    packages: tuple[str, ...]  # what they add, `Name==version`
    image: str | None = None  # the layer's tag, for jobs in containers (None: none needed)
    image_id: str | None = None
    base: str | None = None  # the training image the layer is on, and its ID
    base_id: str | None = None
    directory: Path | None = None  # a local job's packages, for its import path
    built: bool = False  # made by this call (False: found ready)

    def record(self) -> dict[str, Any]:
        """What the run's record keeps (launch.record): the requirements, what they resolved
        to, and where: the layer (tag, ID, base) or this machine's directory."""
        return {
            "source": self.source,
            "requirements": list(self.requirements),
            "digest": self.digest,
            "resolved": list(self.packages),
            "image": None
            if self.image is None
            else {
                "tag": self.image,
                "id": self.image_id,
                "base": self.base,
                "base_id": self.base_id,
            },
            "directory": None if self.directory is None else str(self.directory),
        }

    @classmethod
    def recorded(cls, recorded: dict[str, Any], **where: Any) -> Dependencies:
        """What a run's record kept (`record`'s dict), with `where` it is ready now: the
        layer's fields or a local job's directory."""
        return cls(
            str(recorded.get("source")),
            tuple(recorded.get("requirements") or ()),
            str(recorded.get("digest")),
            tuple(recorded.get("resolved") or ()),
            **where,
        )


def _image_id(image: str) -> str:
    return docker("image", "inspect", "--format", "{{.Id}}", image, check=False).stdout.strip()


# An image's ID and labels in one `docker image inspect`: a later run's layer is found with
# one call of the engine, not four (its time to the first step is measured, bench section 16).
_ID_AND_LABELS = '{{.Id}}{{"\\t"}}{{json .Config.Labels}}'


def _id_and_labels(image: str) -> tuple[str, dict[str, str]] | None:
    """The image's ID and its labels, or None where this machine has no such image."""
    answer = docker("image", "inspect", "--format", _ID_AND_LABELS, image, check=False)
    identity, _, labels = answer.stdout.strip().partition("\t")
    if answer.returncode != 0 or not identity:
        return None
    return identity, json.loads(labels or "null") or {}


def _recorded_layer(recorded: dict[str, Any] | None, emit: Emit) -> Dependencies | None:
    """The layer a recorded run ran in (`make rerun`), where this machine still has it, under
    its tag again; None where it has not (then it is made again from the same requirements)."""
    if recorded is None:
        return None
    image = recorded.get("image") or {}
    tag, wanted = image.get("tag"), image.get("id")
    if not tag or not wanted:
        return None
    if _image_id(wanted) != wanted:
        emit(
            f"dependencies: the layer the run ran in ({tag}, {wanted[7:19]}) is no longer on "
            "this machine: making it again from the same requirements"
        )
        return None
    if _image_id(tag) != wanted:
        docker("tag", wanted, tag)
    emit(f"dependencies: the run's own layer {tag} ({wanted[7:19]}): nothing to build")
    return Dependencies.recorded(
        recorded, image=tag, image_id=wanted, base=image.get("base"), base_id=image.get("base_id")
    )


def prepare_layer(
    base: str,
    requirements: Sequence[str],
    source: str,
    emit: Emit,
    recorded: dict[str, Any] | None = None,
) -> Dependencies:
    """The layer of `requirements` on the training image `base`, built here unless it is up to
    date (said), after the refusal of a requirement that would change a held package. Without
    anything to add, no layer: the jobs run in `base`. `recorded`: a recorded run's
    dependencies (`make rerun`), whose own layer is taken where this machine still has it."""
    reused = _recorded_layer(recorded, emit)
    if reused is not None:
        return reused
    base_id = _image_id(base)
    if not base_id:
        raise UserError(
            f"the training image {base} is not on this machine, so {source} cannot be put on it",
            hint="make provision INVENTORY=... (it builds the image here and ships it)",
            exit_code=1,
        )
    environment = probe_image(base, base_id)
    refused = refusal(requirements, source, environment)
    if refused is not None:
        raise refused
    digest = layer_digest(requirements, base_id, constraints(environment))
    tag = layer_tag(digest)
    common = (source, tuple(requirements), digest)
    found = _id_and_labels(tag)
    if found is not None and found[1].get(DIGEST_LABEL) == digest:
        packages = tuple(found[1].get(RESOLVED_LABEL, "").split())
        emit(
            f"dependencies: {tag} holds {source}'s {len(packages)} package(s) on {base} "
            "already: nothing to build"
        )
        return Dependencies(*common, packages, tag, found[0], base, base_id)
    packages = resolve(requirements, source, environment, CACHE / digest, emit)
    if not packages:
        emit(f"dependencies: {base} holds everything {source} asks for: no layer to build")
        return Dependencies(*common, packages, None, None, base, base_id)
    emit(f"dependencies: building {tag}, one layer on {base} ({len(packages)} package(s))...")
    started = time.monotonic()
    build_layer(tag, base_id, packages, digest, CACHE / digest / "wheels", emit)
    image_id = _image_id(tag)
    emit(f"dependencies: built {tag} ({image_id[7:19]}) in {duration(time.monotonic() - started)}")
    return Dependencies(*common, packages, tag, image_id, base, base_id, built=True)


def build_arguments(
    dockerfile_path: Path, wheels_address: str, digest: str, packages: Sequence[str]
) -> list[str]:
    """`docker build`'s arguments for the layer: the wheels' server reached on the host's
    network under images.WHEELS_HOST (its address outside every cache key, as for the training
    image), the digest and the resolved packages as labels."""
    return [
        "-f",
        str(dockerfile_path),
        "--network",
        "host",
        "--add-host",
        f"{images.WHEELS_HOST}:{wheels_address}",
        "--label",
        f"{DIGEST_LABEL}={digest}",
        "--label",
        f"{RESOLVED_LABEL}={' '.join(packages)}",
    ]


def build_layer(
    tag: str, base_id: str, packages: Sequence[str], digest: str, wheels: Path, emit: Emit
) -> None:
    """`docker build` of the layer, its steps shown as they come (provision.build_watch); the
    context is a directory holding its Dockerfile alone."""
    with tempfile.TemporaryDirectory(prefix="tmn-deps-") as context:
        path = Path(context) / "Dockerfile"
        path.write_text(dockerfile(base_id, packages))
        with images.serve_wheels(wheels) as address:
            images.build_from(
                build_arguments(path, address, digest, packages), tag, emit, Path(context)
            )


def ship_layer(
    inventory: Inventory,
    dependencies: Dependencies,
    emit: Emit,
    looked: dict[str, tuple[str, str]] | None = None,
) -> None:
    """The layer onto every node that lacks it, by layers (provision.ship): a node that holds
    its base fetches the one layer; one that holds the layer gets nothing, said. `looked`: the
    nodes' answers to ship.node_images, where they were asked already."""
    if dependencies.image is None:
        return
    shipment = ship.ship(
        inventory, dependencies.image, emit=emit, known_id=dependencies.image_id, looked=looked
    )
    if not shipment.via:
        emit(
            f"dependencies: every node holds {dependencies.image} "
            f"({shipment.image_id[7:19]}) already: nothing to ship"
        )
    else:
        emit(f"dependencies: {ship_progress.summary(shipment)}")


class _Look:
    """ship.node_images of a layer, asked in a thread of its own: the nodes answer while the
    launcher goes on here (it connects and sends the project), not before it starts."""

    def __init__(self, inventory: Inventory, image: str) -> None:
        self._answer: dict[str, tuple[str, str]] | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._ask, args=(inventory, image), name="tmn-layer-look", daemon=True
        )
        self._thread.start()

    def _ask(self, inventory: Inventory, image: str) -> None:
        try:
            self._answer = ship.node_images(inventory, image)
        except BaseException as error:  # raised where the answer is wanted
            self._error = error

    def answer(self) -> dict[str, tuple[str, str]]:
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._answer is not None
        return self._answer


def begin_for_inventory(
    inventory: Inventory,
    requirements: Sequence[str],
    source: str,
    emit: Emit,
    recorded: dict[str, Any] | None = None,
    spares: Sequence[Host] = (),
) -> tuple[Dependencies, Callable[[], None]]:
    """A job in containers, in two halves: the layer ready here (built where it must be), and
    a function that makes it ready on every node of the (narrowed) inventory, then on its
    `spares` (RESTARTS=: a lost node's place) as far as they answer, said where one does not
    (a restart onto it would then refuse it, naming it). The job calls the second half before
    it checks the nodes' images. A layer found ready here is looked for on the nodes meanwhile,
    in a thread (a later run's usual case: every node holds it, and the look costs the job no
    time); a layer just built is shipped by the second half, which shows its progress."""
    found = prepare_layer(inventory.training_image, requirements, source, emit, recorded)
    look = None
    if found.image is not None and not found.built:
        look = _Look(inventory, found.image)
    done: list[Exception | None] = []  # once: a restart's second call says the same

    def ready() -> None:
        if not done:
            try:
                _ready_on_nodes(inventory, found, emit, spares, look)
                done.append(None)
            except Exception as error:  # Ctrl-C goes on up, unremembered
                done.append(error)
        if done[0] is not None:
            raise done[0]

    return found, ready


def _ready_on_nodes(
    inventory: Inventory,
    found: Dependencies,
    emit: Emit,
    spares: Sequence[Host],
    look: _Look | None,
) -> None:
    ship_layer(inventory, found, emit, looked=look.answer() if look is not None else None)
    if spares and found.image is not None:
        try:
            ship_layer(replace(inventory, hosts=tuple(spares)), found, emit)
        except UserError as error:
            emit(
                f"dependencies: the spare node(s) {', '.join(h.name for h in spares)} did not "
                f"take {found.image}: {error}"
            )


def _environment_key(environment: Environment) -> str:
    return hashlib.sha256(
        json.dumps([sys.prefix, environment.tags, sorted(environment.installed.values())]).encode()
    ).hexdigest()


def for_this_machine(
    requirements: Sequence[str],
    source: str,
    emit: Emit,
    recorded: dict[str, Any] | None = None,
) -> Dependencies:
    """A local job: the same requirements resolved against this machine's environment, the
    packages it lacks installed (`pip install --target`) into CACHE/DIGEST/site, once; `recorded`
    (`make rerun`): the recorded run's directory, where it is still there."""
    directory = Path((recorded or {}).get("directory") or "/nonexistent")
    if recorded and directory.is_dir():
        emit(f"dependencies: the run's own packages in {directory}: nothing to install")
        return Dependencies.recorded(recorded, directory=directory)
    environment = probe_here()
    refused = refusal(requirements, source, environment)
    if refused is not None:
        raise refused
    digest = layer_digest(requirements, _environment_key(environment), constraints(environment))
    common = (source, tuple(requirements), digest)
    site = CACHE / digest / SITE
    if site.is_dir():
        packages = tuple((CACHE / digest / RESOLVED_FILE).read_text().split())
        emit(
            f"dependencies: {site} holds {source}'s {len(packages)} package(s) already: "
            "nothing to install"
        )
        return Dependencies(*common, packages, directory=site)
    packages = resolve(requirements, source, environment, CACHE / digest, emit)
    if not packages:
        emit(f"dependencies: {sys.prefix} holds everything {source} asks for")
        return Dependencies(*common, packages)
    scratch = Path(tempfile.mkdtemp(prefix=".site-", dir=CACHE / digest))
    emit(f"dependencies: installing {len(packages)} package(s) into {site} (not into .venv)...")
    code, output = _pip(
        [
            "install",
            "--quiet",
            "--no-index",
            "--no-deps",
            "--no-warn-script-location",
            "--target",
            str(scratch),
            "--find-links",
            str(CACHE / digest / "wheels"),
            "-r",
            str(CACHE / digest / RESOLVED_FILE),
        ]
    )
    if code != 0:
        shutil.rmtree(scratch, ignore_errors=True)
        raise UserError(
            f"installing {source}'s packages into {site} failed: {_last_error(output)}",
            exit_code=1,
        )
    _settle(scratch, site)
    return Dependencies(*common, packages, directory=site, built=True)
