"""When a checkpoint file, and a checkpoint step, is complete: the one rule every resume follows
(checkpoint.CheckpointStore's files of DDP and the spare's broadcast, dcp.Checkpoints' steps of
FSDP2, replicate's restore between nodes).

A file is complete when it is there under its final name with the size it was written with: a
DCP step's manifest lists every file with its size (`sizes`); a file torch.save wrote (a DDP
checkpoint, a DCP rank file, a manifest) is a zip archive whose central directory, at its very
end, names every entry and its size, so a file cut short is told by opening it
(`torch_file_whole`). A step is complete for a rank when every file that rank needs to load it
is; a resume takes the newest step complete for every rank, and says which newer ones it
skipped and why (`skipped`): an incomplete step is never loaded.
"""

from __future__ import annotations

import zipfile
from collections.abc import Iterable, Mapping
from pathlib import Path


def size_of(path: Path) -> int | None:
    """The file's size, None when it is not a file."""
    try:
        return path.stat().st_size if path.is_file() else None
    except OSError:
        return None


def sizes(directory: Path, names: Iterable[str]) -> dict[str, int]:
    """name -> size of each of `names` that is a file in `directory`."""
    found = {}
    for name in names:
        size = size_of(directory / name)
        if size is not None:
            found[name] = size
    return found


def lacking(directory: Path, expected: Mapping[str, int | None]) -> list[str]:
    """The files of `expected` (name -> size written, None where not recorded) that `directory`
    does not hold complete: absent, or of another size. Sorted."""
    missing = []
    for name, size in sorted(expected.items()):
        found = size_of(directory / name)
        if found is None or (size is not None and found != size):
            missing.append(name)
    return missing


def matches(found: int | None, expected: int | None) -> bool:
    """Whether a file of size `found` (None: absent) is the one written with size `expected`
    (None: not recorded, any size will do)."""
    return found is not None and (expected is None or found == expected)


def torch_file_whole(path: Path) -> bool:
    """Whether a file torch.save wrote is all there: its zip central directory reads and every
    entry it lists lies inside the file. A file cut short loses the directory first."""
    try:
        with zipfile.ZipFile(path) as archive:
            end = path.stat().st_size
            return all(
                entry.header_offset + entry.compress_size <= end for entry in archive.infolist()
            )
    except (OSError, zipfile.BadZipFile, ValueError):
        return False


def newest_everywhere(per_rank: Iterable[Iterable[int]]) -> int | None:
    """The newest step in every rank's list of complete steps, None when there is none."""
    common = None
    for steps in per_rank:
        common = set(steps) if common is None else common & set(steps)
    return max(common) if common else None


def skipped(
    seen: Iterable[Iterable[int]], chosen: int | None, why: Mapping[int, str] | None = None
) -> str | None:
    """One line naming the steps newer than `chosen` that some rank holds but that are not
    complete for every rank (with `why`: step -> what is missing where), or None."""
    newer = sorted({step for steps in seen for step in steps if chosen is None or step > chosen})
    if not newer:
        return None
    said = ", ".join(
        f"{step}" + (f" ({why[step]})" if why and step in why else "") for step in newer
    )
    plural = "s" if len(newer) > 1 else ""
    return f"checkpoint step{plural} {said} not complete on every rank: skipped, never loaded"
