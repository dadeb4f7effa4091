"""torch.save on top of the one durable write (cluster.durable): both checkpoint formats
(checkpoint's files, dcp's rank files and manifests) and the saved models and stages. A name
only ever holds a complete file.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from torch_multinode.cluster import durable

sync_directory = durable.sync_directory  # dcp's and replicate's renamed step directories


def _saving(payload: Any) -> durable.Writer:
    """The writer of `payload`: bytes as they are, anything else torch.saved into the file."""
    if isinstance(payload, bytes):
        return lambda file: file.write(payload)
    return lambda file: torch.save(payload, file)


def write_synced(path: Path, payload: Any) -> None:
    """torch.save `payload` (bytes as they are) to `path` in place, fsynced before return:
    dcp's files inside a step directory that is renamed into place once whole."""
    durable.write_synced(path, _saving(payload))


def write_atomically(
    path: Path, payload: Any, before_rename: Callable[[Path], None] | None = None
) -> None:
    """torch.save `payload` to `path` so that `path` is either absent, old, or complete.
    `before_rename` is called with the complete temp file just before it takes the name."""
    durable.write_streamed(path, _saving(payload), before_rename)
