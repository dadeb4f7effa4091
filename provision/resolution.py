"""A project's requirements resolved against what a Python environment holds
(provision.held_packages): which packages they add to it, their wheels downloaded here, on the
controller alone (only it reaches the package index). provision.dependencies puts them into the
layer, or into a local job's directory.

- **How it resolves.** pip's own resolver, `pip download --only-binary=:all:` for the wheel
  tags the environment's own interpreter reports (its Python, ABI and platforms), against
  stand-ins for every distribution it holds (`stand_ins`: tiny wheels of its name and version,
  no files, no dependencies, which sort above the index's copy of that version), the held ones
  pinned by provision.held_packages' `constraints`. What it downloads that is no stand-in is
  exactly what the requirements add (`resolve`).
- **Only if needed.** Every other package the environment carries is kept at its version unless
  a requirement needs another (pip's `only-if-needed`, done here: each is pinned to the
  environment's version, and a pin is let go only where the resolution conflicts with it, as
  pip names the conflict's causes: `conflict`). A conflict with a held package is refused in one
  line naming the requirement that asks for it, before anything is built.
- **Source only.** A requirement published only as source is built into a wheel here (`pip
  wheel`, `_from_source`) and taken only if that wheel suits the environment's tags (a
  pure-Python one always does).

Resolved once per directory (a layer's or a local environment's digest, in
held_packages.CACHE): RESOLVED_FILE lists what it added, pip freeze's form, beside its wheels.
Every pip this tool runs for a project's dependencies is `run_pip`'s.
"""

from __future__ import annotations

import email.parser
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from torch_multinode.cluster.errors import UserError
from torch_multinode.provision import held_packages
from torch_multinode.provision.build_watch import duration
from torch_multinode.provision.held_packages import (
    Environment,
    canonical,
    constraints,
    held,
    replacing,
)

Emit = Callable[[str], None]

RESOLVED_FILE = "resolved.txt"
# The local version label of a stand-in whose distribution's version has none: it sorts above
# the index's copy of the same version, so the resolution takes the stand-in.
STAND_IN_LABEL = "tmnheld"
RESOLUTION_ROUNDS = 12  # each round lets go of the pins a conflict named, or builds a wheel
PIP_TIMEOUT = 1800.0
PIP_TICK = 10.0  # seconds between two progress lines while pip resolves


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
    directory = held_packages.CACHE / "stand-ins" / key
    if directory.is_dir():
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".making-", dir=directory.parent))
    for name, version in listed:
        stand_in = stand_in_version(version)
        if stand_in is not None:
            write_stand_in(scratch, name, stand_in)
    settle(scratch, directory)
    return directory


def settle(scratch: Path, directory: Path) -> None:
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


def last_error(output: str) -> str:
    """Why pip failed, in one line: its last `ERROR:` line (else its last line), at most 300
    characters."""
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


def run_pip(arguments: list[str], emit: Emit | None = None, what: str = "") -> tuple[int, str]:
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
    return run_pip(
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
    code, output = run_pip(
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
            f"here failed: {last_error(output)}",
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
    held_packages.CACHE.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".resolving-", dir=held_packages.CACHE))
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
                    raise replacing(source, cause.text, cause.name, environment, cause.requester)
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
                f"resolving {source} on the package index failed: {last_error(output)}",
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
                raise replacing(source, f"{package} (resolved)", name, environment)
        (scratch / RESOLVED_FILE).write_text("".join(f"{package}\n" for package in packages))
        emit(
            f"dependencies: {source} adds {len(packages)} package(s) to {environment.where}"
            + (f": {', '.join(packages)}" if packages else "")
            + f" (resolved in {duration(time.monotonic() - started)})"
        )
        directory.parent.mkdir(parents=True, exist_ok=True)
        settle(scratch, directory)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return tuple(done.read_text().split())
