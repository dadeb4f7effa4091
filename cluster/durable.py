"""The one durable write: a file written under a temporary name beside it (mkstemp), made
readable by all, flushed and fsynced, renamed onto its name (os.replace) and its directory
fsynced, so a name only ever holds a complete file, one that outlives a crash. Torch-free; it
runs on the controller and on the nodes (cluster.sync.NODE_SIDE).

Every file written whole or not at all goes through here: cluster.files's (the controller's
state beside the inventory and in the run directories), training.checkpointing.durable's
torch.save (checkpoints, saved models and stages), transfer's received files (AtomicFile),
the flight recorder's traces, the comm-hook cache, the selftest's DCP index copy and the
launcher's exit-code file.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

# mkstemp's 0600 would outlive the rename: in a container the job writes as root, and the
# inventory's user who fetches outputs over SSH (launch.staging) could not read the file. 0644
# is what open() makes under the usual umask 022.
FILE_MODE = 0o644

Writer = Callable[[BinaryIO], object]
BeforeRename = Callable[[Path], None]


def sync_directory(path: str | os.PathLike) -> None:
    """A rename into `path` (or a file made there) is only durable once its entry is."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _synced(file: BinaryIO) -> None:
    file.flush()
    os.fsync(file.fileno())


class AtomicFile:
    """`path` written in pieces under a temporary name beside it (FILE_MODE), which takes the
    name only at commit(), fsynced; aborted, or never committed, `path` is untouched."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        descriptor, name = tempfile.mkstemp(
            dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".tmp"
        )
        self.temporary = Path(name)
        try:
            os.fchmod(descriptor, FILE_MODE)
            self.file: BinaryIO = os.fdopen(descriptor, "wb")
        except BaseException:
            os.close(descriptor)
            self.temporary.unlink(missing_ok=True)
            raise

    def write(self, data: bytes) -> None:
        self.file.write(data)

    def commit(self, before_rename: BeforeRename | None = None) -> None:
        """The temporary file fsynced and renamed onto `path`, then the directory fsynced.
        `before_rename` is called with the complete temporary file just before the rename."""
        _synced(self.file)
        self.file.close()
        if before_rename is not None:
            before_rename(self.temporary)
        os.replace(self.temporary, self.path)
        sync_directory(self.path.parent)

    def abort(self) -> None:
        """The temporary file removed; `path` keeps what it held."""
        try:
            self.file.close()
        finally:
            self.temporary.unlink(missing_ok=True)


def write_streamed(
    path: str | os.PathLike, writer: Writer, before_rename: BeforeRename | None = None
) -> None:
    """`path` as `writer` writes it into a binary file, durably: absent, old, or complete.
    Any exception (BaseException) removes the temporary file and is raised again."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    target = AtomicFile(path)
    try:
        writer(target.file)
        target.commit(before_rename)
    except BaseException:
        target.abort()
        raise


def write_atomically(
    path: str | os.PathLike, data: bytes | str, before_rename: BeforeRename | None = None
) -> None:
    """`data` (text as UTF-8) as the whole of `path`, durably: absent, old, or complete."""
    raw = data.encode() if isinstance(data, str) else data
    write_streamed(path, lambda file: file.write(raw), before_rename)


def write_synced(path: str | os.PathLike, writer: Writer) -> None:
    """`path` written in place by `writer` and fsynced before return: for files inside a
    directory that is itself renamed into place once whole (dcp's step directories)."""
    with open(path, "wb") as file:
        writer(file)
        _synced(file)
