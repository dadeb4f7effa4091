"""One run's record kept around its job (Recorder): begun before the job, completed with the
project's code and the image once the job has begun, finished after it however it ends. What the
record holds, and its writing, are launch.record's; this is when each part is written, and what
a disk that refuses it leaves."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch_multinode.cluster.errors import (
    INTERRUPTED_EXIT,
    TERMINATED_EXIT,
    Terminated,
    UserError,
)
from torch_multinode.cluster.inventory import Inventory
from torch_multinode.launch import image_check, local, record, snapshot, staging
from torch_multinode.launch.spec import JobResult, JobSpec


def _image(inventory: Inventory | None, image: str | None = None) -> dict[str, str | None] | None:
    """The image a job in containers runs (`image`: the project's dependency layer, else the
    training image): its name, and its ID in this machine's engine (the nodes are checked
    against it before launch: launch.prepare)."""
    if inventory is None or inventory.launch_mode != "container":
        return None
    name = image or inventory.training_image
    try:
        found = image_check.local_image_id(name)
    except UserError:
        found = None  # not here: the launch says so
    return {"name": name, "id": found}


def _outside(spec: JobSpec, project: Path, here: bool) -> tuple[Path, ...]:
    """The places on this machine the run writes, which its code snapshot leaves out: the
    runs' records and logs, the checkpoint and data roots, the job's own outputs (those of a
    job `here`; none that holds the project)."""
    places_written = [
        record.RUNS_ROOT.absolute(),
        *record.places(spec),
        *staging.local_roots().values(),
    ]
    if here:
        places_written += [Path(path) for path in record.outputs(spec, project).values()]
    return tuple(
        place
        for place in places_written
        if not project.absolute().is_relative_to(Path(os.path.abspath(place)))
    )


def _origin_code(origin: dict[str, Any], origin_dir: Path, log_dir: Path) -> dict[str, Any]:
    """A rerun's code: its origin's snapshot, which it ran (launch.runs restores it), with the
    origin's difference from its commit copied beside the rerun's record."""
    found = dict(origin.get("code") or {})
    if found.get("diff") and (origin_dir / record.DIFF).is_file():
        shutil.copyfile(origin_dir / record.DIFF, log_dir / record.DIFF)
    return found


class Recorder:
    """One run's record around its job: begun before it, completed once when it has begun
    (`started`, the hook the backend calls), finished after it however it ends (Ctrl-C and
    SIGTERM included). A job refused before anything of it ran (a check on the way, Ctrl-C
    during its staging) leaves no run behind, record included. A local job's outputs are in
    its project's run directory (launch.local), the record in this machine's .runs/ID either
    way."""

    def __init__(
        self,
        spec: JobSpec,
        argv: list[str],
        inventory: Inventory | None,
        rerun_of: tuple[dict[str, Any], Path] | None = None,
        emit: Callable[[str], None] = print,
        image: str | None = None,
        dependencies: dict[str, Any] | None = None,
    ) -> None:
        self.spec, self.argv, self.inventory, self.emit = spec, argv, inventory, emit
        self.rerun_of = rerun_of  # (the record, its directory) of the run a rerun runs again
        self.image = image  # the project's dependency layer, where the job runs in one
        self.dependencies = dependencies
        self.project = local.project_directory(spec)
        self.record: dict[str, Any] | None = None
        self.completed = False

    def started(self) -> None:
        """The begun record completed with the project's code (its snapshot: launch.snapshot,
        which leaves out the places the run writes; what it left out is said, in one line) and
        the training image's ID, rewritten. Called by the backend once the job has begun
        (the launcher built, the local torchrun started), so that a job refused on the way runs
        no git and no docker for its record; once per job (a restart calls it again: the first
        run's code is the job's)."""
        if self.record is None or self.completed:
            return
        self.completed = True
        spec = self.spec
        log_dir = record.places(spec)[0]
        try:
            if self.rerun_of:
                found = _origin_code(*self.rerun_of, log_dir)
            else:
                outside = _outside(spec, self.project, here=self.inventory is None)
                found = record.code(self.project, log_dir, spec.run_id, outside)
                if line := snapshot.said(found if found.get("repository") else None):
                    self.emit(f"[launcher] {line}")  # what it left out, or why there is none
            self.record.update(code=found, image=_image(self.inventory, self.image))
            record.write(spec, self.record)
        except OSError as failed:  # the job goes on: its record is the one begun
            self.emit(f"[launcher] {_not_written(spec, failed, 'its code')}")

    def kept(self, job: Callable[[], JobResult]) -> JobResult:
        spec = self.spec
        origin = self.rerun_of[0] if self.rerun_of else None
        try:
            self.record = record.begin(
                spec, self.argv, self.inventory, self.project, origin, self.dependencies
            )
        except OSError as failed:  # no job without its record: nothing has started
            for place in record.places(spec):  # nor a run directory left empty for `make runs`
                with contextlib.suppress(OSError):
                    place.rmdir()
            raise UserError(
                f"cannot write the run record in {record.places(spec)[0]}: "
                f"{failed.strerror or failed}",
                hint="freeing space there",
                exit_code=1,
            ) from None
        run_dir = local.run_directory(spec) if self.inventory is None else None
        result, code = None, 1
        try:
            result = job()
            code = result.exit_code
            return result
        except UserError as exc:
            code = exc.exit_code
            raise
        except KeyboardInterrupt as signalled:
            code = TERMINATED_EXIT if isinstance(signalled, Terminated) else INTERRUPTED_EXIT
            raise
        finally:
            if result is None and all(
                {p.name for p in place.iterdir()} <= {record.RECORD, record.DIFF}
                for place in record.places(spec)
            ):
                for place in record.places(spec):  # refused before it started: no run
                    shutil.rmtree(place, ignore_errors=True)
            else:
                try:
                    record.finish(self.record, spec, result, code, run_dir)
                except OSError as failed:  # the job's own result stands; said, not a traceback
                    self.emit(f"[launcher] {_not_written(spec, failed, 'how it ended')}")


def _not_written(spec: JobSpec, failed: OSError, what: str) -> str:
    """The launcher's line for a record its disk refused (full, read-only): the record on disk
    stays whole as last written, without `what`."""
    return (
        f"the run record {record.places(spec)[0] / record.RECORD} was not updated with {what}: "
        f"{failed.strerror or failed}; it stays as last written (free space there for the "
        "next run's)"
    )
