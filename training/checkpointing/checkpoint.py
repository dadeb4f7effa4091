"""Checkpoints on node-local disks, written atomically, agreed on by every rank before loading.

No shared filesystem is assumed: every rank writes its own file, `step-00000120-rank-00003.pt`,
into the --checkpoint-dir of the node it runs on. A file only ever appears under that name
complete (temp file in the same directory, fsync, os.replace, fsync of the directory), so a
crash leaves at worst a dot-prefixed temp file that listing never matches.

On resume each rank lists the steps it holds complete (training.checkpointing.complete: a
file whose zip directory reads whole) and the ranks resume from the newest step that every rank
holds: the newest step of each rank's own list may differ when a node died while writing, and
a step some rank holds only in part is said and skipped, never loaded.

A directory that cannot take a checkpoint (read-only, full) is one error line naming it; the
checkpoints already there are left as they are.
"""

from __future__ import annotations

import errno
import pickle
import random
import re
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from torch_multinode.cluster.errors import UserError
from torch_multinode.training.checkpointing import complete
from torch_multinode.training.checkpointing.durable import write_atomically

_NAME = re.compile(r"^step-(\d{8})-rank-(\d{5})\.pt$")


def file_name(step: int, rank: int) -> str:
    return f"step-{step:08d}-rank-{rank:05d}.pt"


class CheckpointStore:
    """This rank's checkpoint files in one node-local directory."""

    def __init__(self, directory: Path, rank: int, keep: int):
        self.directory, self.rank, self.keep = Path(directory), rank, keep

    def steps(self) -> list[int]:
        """The steps this rank can resume from, oldest first: those it holds complete
        checkpoints of (complete.torch_file_whole); a rank that holds none of its own (its node
        took another rank's place after a restart on fewer nodes) can read another rank's file
        of a step found here, since every data-parallel rank's file holds the same model,
        optimizer and position."""
        return self._held(self.rank, whole=True) or self._held(None, whole=True)

    def seen(self) -> list[int]:
        """Every step this rank has a file of under its final name, complete or not."""
        return self._held(self.rank) or self._held(None)

    def _held(self, rank: int | None, whole: bool = False) -> list[int]:
        """The steps of `rank`'s files here (None: any rank's); with `whole`, of complete ones."""
        if not self.directory.is_dir():
            return []
        found = set()
        for entry in self.directory.iterdir():
            match = _NAME.match(entry.name)
            if match and rank in (None, int(match.group(2))):
                if not whole or complete.torch_file_whole(entry):
                    found.add(int(match.group(1)))
        return sorted(found)

    def path(self, step: int) -> Path:
        return self.directory / file_name(step, self.rank)

    def _readable(self, step: int) -> Path:
        """This rank's file of `step`, else the lowest rank's complete file of it here (see
        steps)."""
        own = self.path(step)
        if own.exists():
            return own
        others = sorted(self.directory.glob(f"step-{step:08d}-rank-*.pt"))
        whole = [path for path in others if complete.torch_file_whole(path)]
        return (whole or others or [own])[0]

    def save(
        self,
        step: int,
        state: dict[str, Any],
        *,
        prune: bool = True,
        before_rename: Callable[[Path], None] | None = None,
    ) -> Path:
        """Write this rank's checkpoint of `step`; then, unless told not to, prune older ones.
        A write that fails leaves the older checkpoints as they were."""
        path = self.path(step)
        try:
            write_atomically(path, state, before_rename)
        except (OSError, RuntimeError) as error:
            cause = _os_error(error)  # torch.save reports a failed write as a RuntimeError
            if cause is None:
                raise
            kept = self._held(self.rank, whole=True)
            raise self._write_error(
                f"cannot write checkpoint step {step} to",
                cause,
                f"; step {kept[-1]} is kept" if kept else "",
            ) from None
        if prune:
            self.prune()
        return path

    def check_writable(self) -> None:
        """Fail before training, naming the directory, rather than at the first checkpoint."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(
                dir=self.directory, prefix=f".write-test-rank-{self.rank:05d}."
            ):
                pass
        except OSError as error:
            raise self._write_error("cannot write checkpoints to", error) from None

    def _write_error(self, what: str, error: OSError, after: str = "") -> UserError:
        reason = error.strerror or str(error) or type(error).__name__
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            hint = "freeing space there, a smaller --keep, or a --checkpoint-dir with more room"
        elif error.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            hint = "a writable --checkpoint-dir"
        else:
            hint = "another --checkpoint-dir"
        return UserError(f"{what} {self.directory}: {reason}{after}", hint=hint, exit_code=1)

    def load(self, step: int) -> dict[str, Any]:
        """This rank's checkpoint of `step`, every tensor on the CPU whatever device wrote it.
        State reaches the rank's device through load_state_dict (model, optimizer) and
        restore_rng_states; loaded onto a GPU, numpy's generator keys could not be read back
        (Tensor.numpy() takes CPU tensors only) and every rank's resume crashed."""
        path = self._readable(step)
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as error:
            reason = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise UserError(f"cannot load checkpoint {path}: {reason}", exit_code=1) from None

    def prune(self) -> None:
        for step in self._held(self.rank)[: -self.keep]:
            self.path(step).unlink(missing_ok=True)

    def remove_temporaries(self) -> None:
        """Temp files this rank left behind when it died mid-write (no other rank writes them)."""
        if self.directory.is_dir():
            marker = f"-rank-{self.rank:05d}.pt."
            for entry in self.directory.iterdir():
                if entry.name.startswith(".step-") and marker in entry.name:
                    entry.unlink(missing_ok=True)

    def clear(self) -> int:
        """Delete this rank's checkpoints; how many there were."""
        steps = self._held(self.rank)
        for step in steps:
            self.path(step).unlink(missing_ok=True)
        return len(steps)


def _os_error(error: BaseException | None) -> OSError | None:
    """The OSError behind `error`: itself, or what it was raised from or during."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def newest_common_step(steps_per_rank: Iterable[Iterable[int]]) -> int | None:
    """The newest step present in every rank's list, or None when there is none."""
    return complete.newest_everywhere(steps_per_rank)


@dataclass(frozen=True)
class ResumePlan:
    step: int | None  # None: start from scratch
    message: str
    # Ranks that hold no checkpoint at all (their node is new to the job: a spare after a
    # restart) and receive the state of `source`, which holds `step`; () : each rank loads its own.
    receivers: tuple[int, ...] = ()
    source: int | None = None


def plan_resume(
    steps_per_rank: list[list[int]],
    resume: bool | None,
    directory: str,
    replicated: bool = False,
) -> ResumePlan:
    """Decide where to start from every rank's list of steps (identical on every rank).
    `replicated`: every rank's checkpoint holds the same state (data parallel), so ranks that
    hold none receive it from one that does (see ResumePlan)."""
    held = "; ".join(
        f"rank {rank} has {', '.join(map(str, steps)) if steps else 'none'}"
        for rank, steps in enumerate(steps_per_rank)
    )
    if resume is False:
        return ResumePlan(None, f"--no-resume: starting from step 0 in {directory}")
    step = newest_common_step(steps_per_rank)
    if step is None:
        if resume is None and not any(steps_per_rank):
            return ResumePlan(None, f"no checkpoints in {directory}: starting from step 0")
        empty = tuple(rank for rank, steps in enumerate(steps_per_rank) if not steps)
        common = newest_common_step(steps for steps in steps_per_rank if steps)
        if replicated and empty and common is not None:
            source = next(rank for rank, steps in enumerate(steps_per_rank) if common in steps)
            return ResumePlan(
                common,
                f"resuming from step {common}, the newest step every rank with checkpoints has "
                f"({held}); rank {source} sends its state to rank "
                f"{', '.join(map(str, empty))}, whose node holds none",
                empty,
                source,
            )
        raise UserError(
            f"no checkpoint step is present on every rank in {directory} ({held})",
            hint="--no-resume to start over",
        )
    return ResumePlan(step, f"resuming from step {step}, the newest step every rank has ({held})")


def rng_states(device: torch.device) -> dict[str, Any]:
    """Every generator this rank draws from: Python's, numpy's, torch's CPU one and, on a GPU,
    that of the rank's own device only. Every visible GPU's would tie the checkpoint to the
    number of GPUs visible when it was written."""
    numpy_state = np.random.get_state()
    return {
        "python": random.getstate(),
        # weights_only loading accepts tensors and plain containers, not numpy arrays.
        "numpy": (numpy_state[0], torch.from_numpy(numpy_state[1].copy()), *numpy_state[2:]),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
    }


def restore_rng_states(states: dict[str, Any], device: torch.device) -> None:
    random.setstate(states["python"])
    name, keys, *rest = states["numpy"]
    np.random.set_state((name, keys.numpy(), *rest))
    torch.set_rng_state(states["torch"].cpu())
    if device.type != "cuda":
        return
    cuda = states["cuda"]
    if isinstance(cuda, (list, tuple)):
        # Checkpoints written before held every visible GPU's state, in visible order: this
        # rank's is at its device's index, if that GPU was visible then.
        index = device.index if device.index is not None else torch.cuda.current_device()
        cuda = cuda[index] if index < len(cuda) else None
    if cuda is not None:
        torch.cuda.set_rng_state(cuda.cpu(), device)
