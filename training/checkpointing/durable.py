"""The one durable write of both checkpoint formats (checkpoint's files, dcp's rank files and
manifests): a file written and fsynced, renamed into place (os.replace) and its directory entry
fsynced, so a name only ever holds a complete file.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

FILE_MODE = 0o644  # what open() makes under the usual umask 022


def write_synced(path: Path, payload: Any) -> None:
    """torch.save `payload` (bytes as they are) to `path`, flushed to the disk before return.
    The one durable write of both checkpoint formats: this one's files and DCP's manifests."""
    with path.open("wb") as file:
        if isinstance(payload, bytes):
            file.write(payload)
        else:
            torch.save(payload, file)
        file.flush()
        os.fsync(file.fileno())


def sync_directory(path: Path) -> None:
    """A rename into `path` (or a file made there) is only durable once its entry is."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write_atomically(
    path: Path, payload: Any, before_rename: Callable[[Path], None] | None = None
) -> None:
    """torch.save `payload` to `path` so that `path` is either absent, old, or complete.
    `before_rename` is called with the complete temp file just before it takes the name."""
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(
        dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"
    )
    os.close(descriptor)
    try:
        # mkstemp's 0600 would outlive the rename: in a container the job writes as root, and
        # the inventory's user who fetches --out over SSH (launch.staging) could not read it.
        os.chmod(temporary, FILE_MODE)
        write_synced(Path(temporary), payload)
        if before_rename is not None:
            before_rename(Path(temporary))
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    sync_directory(path.parent)
