"""Wheels made on this machine, and pip's environment that resolves against them alone: what a
benchmark or a test of a project's requirements installs, so that no package index is asked
(the network rule: tests and benchmarks send traffic to no address they did not create)."""

from __future__ import annotations

import os
import zipfile
from collections.abc import Sequence
from pathlib import Path


def wheel(
    directory: Path,
    name: str,
    version: str,
    requires: Sequence[str] = (),
    module: str = "VALUE = 1\n",
) -> Path:
    """A real pure-Python wheel of that name and version in `directory`: one module, named as
    the distribution with underscores, holding `module`, and needing `requires`."""
    stem = name.replace("-", "_")
    info = f"{stem}-{version}.dist-info"
    texts = {
        f"{stem}.py": module,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        + "".join(f"Requires-Dist: {r}\n" for r in requires),
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: torch-multinode\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    texts[f"{info}/RECORD"] = "".join(f"{path},,\n" for path in [*texts, f"{info}/RECORD"])
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{stem}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for member, text in texts.items():
            archive.writestr(member, text)
    return path


def offline_pip(directory: Path) -> dict[str, str]:
    """Environment variables under which pip takes packages from the wheels in `directory`
    alone: no package index, no configuration file of this machine or its user (pip adds the
    --find-links a command gives to this one)."""
    return {
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": str(directory),
    }
