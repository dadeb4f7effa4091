"""Which Python dependencies a project has, and host mode's check that each node holds them.

- Which (`requirements`, read on the controller): REQUIREMENTS=path (a requirements file, or a
  pyproject.toml's [project] dependencies), else requirements.txt at the project's root, else
  its pyproject.toml's [project] dependencies; none with REQUIREMENTS=none, for this project's
  own packages (the image is made for them) and where the project has none. A requirements file
  is read as pip reads it (comments, line joins, --hash, `-r FILE` includes); each line must be
  a name with versions and markers: a URL, a path or a pip option is refused, naming its line.
- What becomes of them is not decided here: in containers, a layer on the training image that
  the job then runs in (made by provision.dependencies; launch.staging's `Project.image`); for a
  local job, packages on its import path (provision.dependencies too).
- In host mode the launcher installs nothing: each node's training_python must hold them, and a
  node that does not is named before anything starts (`requirements_check_command`,
  `requirements_missing`; `host_mode_note` says so).
"""

from __future__ import annotations

import json
import re
import shlex
import tomllib
from dataclasses import dataclass
from pathlib import Path

from torch_multinode.cluster import sync
from torch_multinode.cluster.errors import UserError, printable, shown
from torch_multinode.cluster.inventory import Host

# The project's requirements: REQUIREMENTS=path, else these at its root; REQUIREMENTS=none: none.
REQUIREMENTS_FILE = "requirements.txt"
PYPROJECT_FILE = "pyproject.toml"
NO_REQUIREMENTS = "none"
_INCLUDE = re.compile(r"^(?:-r|--requirement)(?:\s+|=)(\S+)$")
_HASH = re.compile(r"\s+--hash[=\s]\S+")


@dataclass(frozen=True)
class Requirements:
    """The project's requirements, as read: where from, and one requirement a line."""

    source: str  # as lines name it: "requirements.txt", "pyproject.toml", the path given
    lines: tuple[str, ...]


def requirements(root: Path | None, given: str | None = None) -> Requirements | None:
    """The project's requirements: REQUIREMENTS=path (`given`; a pyproject.toml's dependencies
    where it is one), else requirements.txt at the project's root, else its pyproject.toml's
    [project] dependencies; None with REQUIREMENTS=none, for this project's own packages (the
    image is made for them) and where the project has none."""
    if given == NO_REQUIREMENTS:
        return None
    if given:
        path = Path(given).expanduser()
        if not path.is_file():
            raise UserError(
                f"REQUIREMENTS={given} is not a file",
                hint="a requirements file, a pyproject.toml, or REQUIREMENTS=none",
            )
        if path.name == PYPROJECT_FILE:
            return Requirements(given, pyproject_requirements(path, given))
        return Requirements(given, read_requirements(path, given))
    if root is None or root.resolve() == sync.TOOL_ROOT:
        return None
    listed = root / REQUIREMENTS_FILE
    if listed.is_file():
        lines = read_requirements(listed, REQUIREMENTS_FILE)
        return Requirements(REQUIREMENTS_FILE, lines) if lines else None
    pyproject = root / PYPROJECT_FILE
    if pyproject.is_file():
        lines = pyproject_requirements(pyproject, PYPROJECT_FILE)
        return Requirements(PYPROJECT_FILE, lines) if lines else None
    return None


def _requirement(text: str, where: str) -> str:
    """One requirement, checked: a name with versions and markers (PEP 508), which the layer
    installs from the package index; a URL, a path or a pip option is refused, naming it."""
    from packaging.requirements import InvalidRequirement, Requirement

    hint = "one requirement a line, a name and versions (omegaconf>=2.3); -r FILE includes one"
    if text.startswith("-"):
        raise UserError(
            f"{where}: {shown(text)} is a pip option, not a requirement the layer installs",
            hint=hint,
        )
    try:
        found = Requirement(text)
    except InvalidRequirement:
        raise UserError(f"{where}: {shown(text)} is not a requirement", hint=hint) from None
    if found.url:
        raise UserError(
            f"{where}: {shown(text)} names a URL; the project's packages come from the package "
            "index",
            hint=hint,
        )
    return text


def read_requirements(path: Path, source: str, seen: tuple[Path, ...] = ()) -> tuple[str, ...]:
    """A requirements file's requirements, one a line: comments, blank lines, line joins and
    --hash options as pip reads them, `-r FILE` includes followed (relative to the file)."""
    resolved = path.resolve()
    if resolved in seen:
        raise UserError(f"{source}: {path} includes itself", hint="one -r per file, no circle")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{source}: cannot read {path}: {exc}") from None
    found: list[str] = []
    joined = re.sub(r"\\\n", "", text)
    for number, raw in enumerate(joined.splitlines(), 1):
        line = re.sub(r"(^|\s)#.*$", "", raw).strip()
        line = _HASH.sub("", line).strip()
        if not line:
            continue
        include = _INCLUDE.match(line)
        if include:
            found += read_requirements(path.parent / include.group(1), source, (*seen, resolved))
            continue
        where = (
            f"{source} line {number}" if path.name == Path(source).name else f"{path} line {number}"
        )
        found.append(_requirement(line, where))
    return tuple(found)


def pyproject_requirements(path: Path, source: str) -> tuple[str, ...]:
    """A pyproject.toml's [project] dependencies (none where it has no such list)."""
    try:
        document = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise UserError(f"{source}: cannot read it: {exc}") from None
    listed = (document.get("project") or {}).get("dependencies") or []
    if not isinstance(listed, list) or not all(isinstance(item, str) for item in listed):
        raise UserError(f"{source}: [project] dependencies is not a list of requirements")
    return tuple(_requirement(item.strip(), f"{source} [project] dependencies") for item in listed)


# Run by a node's training_python (host mode): the version of each named distribution there.
_INSTALLED = """\
import importlib.metadata as metadata, json, sys
found = {}
for name in sys.argv[1:]:
    try:
        found[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
        found[name] = None
print(json.dumps(found))
"""


def requirements_check_command(python: str, wanted: Requirements) -> str:
    """Asks a node's `python` which version of each requirement's distribution it holds."""
    from packaging.requirements import Requirement

    names = sorted({Requirement(line).name for line in wanted.lines})
    return shlex.join([python, "-c", _INSTALLED, *names])


def requirements_missing(host: Host, wanted: Requirements, answer: str) -> str | None:
    """Why a node's training_python cannot run the project (host mode: the launcher installs
    nothing there): the first requirement it lacks, or holds at a version the requirement
    excludes; None when it holds them all."""
    from packaging.requirements import Requirement
    from packaging.version import InvalidVersion, Version

    fix = (
        f"pip install -r {wanted.source} with {host.python} on {host.name}: in host mode jobs run "
        "each node's own Python, which the launcher never changes"
    )
    try:
        found = json.loads(answer.strip().splitlines()[-1])
    except (ValueError, IndexError):
        said = printable((answer.strip().splitlines() or ["no answer"])[-1])
        return (
            f"on {host.name}: cannot ask {host.python} which packages it holds: {said} (try {fix})"
        )
    for line in wanted.lines:
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue
        have = found.get(requirement.name)
        if have is None:
            return (
                f"on {host.name}: {host.python} lacks {requirement.name}, which {wanted.source} "
                f"asks for ({line}) (try {fix})"
            )
        try:
            agrees = requirement.specifier.contains(Version(have), prereleases=True)
        except InvalidVersion:
            agrees = True  # not a version pip reads: nothing to compare
        if not agrees:
            return (
                f"on {host.name}: {host.python} holds {requirement.name} {have}, but "
                f"{wanted.source} asks for {line} (try {fix})"
            )
    return None


def host_mode_note(wanted: Requirements) -> str:
    """What a job in host mode says of the project's requirements."""
    return (
        f"launch_mode: host: {wanted.source} is not installed by the launcher; each node's "
        "training_python must hold it (checked on every node before the job starts)"
    )
