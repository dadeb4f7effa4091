"""Files the controller keeps beside the inventory and in the run directories, written whole or
not at all (cluster.durable's write): a reader (the launcher, a script, a second make) never
finds half of one."""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path

from torch_multinode.cluster import durable
from torch_multinode.cluster.errors import UserError


def beside_inventory(inventory_path: str | os.PathLike, name: str) -> Path:
    """The file `name` kept beside an inventory file (inside an inventory directory), where a
    command given the same INVENTORY finds it again."""
    inventory = Path(inventory_path).resolve()
    return (inventory if inventory.is_dir() else inventory.parent) / name


# `text` as the whole of `path`, durably (readable by all, fsynced, renamed into place): the one
# durable write, cluster.durable's.
write_atomically = durable.write_atomically


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
