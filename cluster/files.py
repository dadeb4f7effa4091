"""Files the controller keeps beside the inventory and in the run directories, written whole or
not at all: a reader (the launcher, a script, a second make) never finds half of one."""

from __future__ import annotations

import datetime
import json
import os
import tempfile
from pathlib import Path

from torch_multinode.cluster.errors import UserError


def beside_inventory(inventory_path: str | os.PathLike, name: str) -> Path:
    """The file `name` kept beside an inventory file (inside an inventory directory), where a
    command given the same INVENTORY finds it again."""
    inventory = Path(inventory_path).resolve()
    return (inventory if inventory.is_dir() else inventory.parent) / name


def write_atomically(path: str | os.PathLike, text: str) -> None:
    """`text` as the whole of `path` (readable by all), through a temporary file beside it
    that takes its name at once; nothing is left behind when writing fails."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_nodes(path: str | os.PathLike, nodes: dict, what: str, hint: str) -> Path:
    """{"nodes": nodes, "written_at": now} as JSON at `path`, atomically; a path that cannot be
    written is one UserError naming `what` it is and the remedy `hint`."""
    path = Path(path)
    document = {
        "nodes": nodes,
        "written_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    try:
        write_atomically(path, json.dumps(document, indent=2, sort_keys=True) + "\n")
    except OSError as exc:
        raise UserError(
            f"cannot write the {what} {path}: {exc.strerror or exc}", hint=hint, exit_code=1
        ) from None
    return path
