"""Files between two ranks over a gloo group (replicate's copies): every file's size, then its
bytes in pieces of CHUNK bytes as CPU tensors, received into a temporary name beside the file,
fsynced and renamed into place once whole (cluster.durable's AtomicFile), paced to a bandwidth
cap.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from torch_multinode.cluster.durable import AtomicFile  # each received file, written whole

CHUNK = 4 << 20  # bytes per message


# -- the stream: sizes, then every file's bytes in pieces --------------------------------------


def sending(directory: Path, names: list[str]) -> Iterator[torch.Tensor]:
    """The tensors to send: every file's size (-1: absent), then their bytes in CHUNKs."""
    paths = [directory / name for name in names]
    yield torch.tensor([p.stat().st_size if p.is_file() else -1 for p in paths])
    for path in paths:
        if path.is_file():
            with path.open("rb") as file:
                while piece := file.read(CHUNK):
                    yield torch.frombuffer(bytearray(piece), dtype=torch.uint8)


def receiving(directory: Path, names: list[str], failed: list[str]) -> Iterator[torch.Tensor]:
    """The tensors to receive into, each filled before the next is asked for; every file
    written atomically into `directory`. A file that cannot be written is drained and named
    in `failed` (the stream goes on)."""
    sizes = torch.empty(len(names), dtype=torch.int64)
    yield sizes
    for name, size in zip(names, sizes.tolist(), strict=True):
        if size < 0:
            failed.append(f"{name} (absent on the sender)")
            continue
        target, problem = None, None
        try:
            target = AtomicFile(directory / name)
        except OSError as error:
            problem = error
        for offset in range(0, size, CHUNK):
            buffer = torch.empty(min(CHUNK, size - offset), dtype=torch.uint8)
            yield buffer
            if target is not None:
                try:
                    target.write(buffer.numpy().tobytes())
                except OSError as error:
                    target.abort()
                    target, problem = None, error
        if target is not None:
            try:
                target.commit()
            except OSError as error:
                target.abort()
                problem = error
        if problem is not None:
            failed.append(f"{name} ({problem.strerror or problem})")


def exchange(group, outgoing, to: int | None, incoming, source: int | None, mbps: float) -> None:
    """Send `outgoing`'s tensors to rank `to` while receiving `incoming`'s from `source` (either
    may be None), one of each at a time; sending at most `mbps` megabits per second (0: any)."""
    started, sent = time.monotonic(), 0
    while True:
        out = next(outgoing, None) if outgoing is not None else None
        into = next(incoming, None) if incoming is not None else None
        if out is None and into is None:
            return
        works = []
        if out is not None:
            works.append(dist.isend(out, dst=to, group=group))
            sent += out.numel() * out.element_size()
        if into is not None:
            works.append(dist.irecv(into, src=source, group=group))
        for work in works:
            work.wait()
        if mbps > 0:
            ahead = sent * 8 / (mbps * 1e6) - (time.monotonic() - started)
            if ahead > 0:
                time.sleep(ahead)
