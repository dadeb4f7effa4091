"""A rank's Flight Recorder trace, written when the launcher asks: on a hang it creates
jobenv.FLIGHT_REQUEST in the run directory (TMN_RUN_DIR, the same path in the container), and
each rank that started this watcher writes its trace (its last collectives: sequence number,
op, sizes, state) to jobenv.FLIGHT_DUMP there within a second, atomically.

torch records the trace when TORCH_FR_BUFFER_SIZE is set (the launcher sets it for every job),
for gloo and NCCL alike, and reads it only from inside the process: a thread of the rank's own
does, which runs while the main thread waits in a collective (the wait releases the GIL).

The same trace is written when the rank dies of an exception it did not catch (a collective
that timed out, gloo's "Timed out waiting ... for recv operation"), so that a failed job's
summary can say which collective each rank was in. NCCL's watchdog ends the process without
Python's help; it writes its own dump there instead (jobenv.FLIGHT_TIMEOUT_DUMP, which the
launcher sets with TORCH_NCCL_DUMP_ON_TIMEOUT).

Every workload of ours starts it (training.distributed.parallel.start); in a script of yours
that the launcher runs, our sitecustomize does when init_process_group returns
(training/distributed/site). Under torchrun typed by hand, after init_process_group:

    from torch_multinode.training.distributed import flight
    flight.start()
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from torch_multinode.cluster import durable
from torch_multinode.cluster.jobenv import (
    FLIGHT_BUFFER_VARIABLE,
    FLIGHT_DUMP,
    FLIGHT_REQUEST,
    RUN_DIR_VARIABLE,
)

POLL = 0.5  # seconds between two looks for the launcher's request
_started: threading.Thread | None = None


def trace_json(backend: str | None = None) -> bytes:
    """This rank's trace as torch writes it (JSON): NCCL's own buffer for an NCCL job."""
    import torch.distributed as dist
    from torch._C import _distributed_c10d as c10d

    if backend is None and dist.is_available() and dist.is_initialized():
        backend = str(dist.get_backend())
    # (include collectives, only active ones): every entry the ring holds, completed ones too,
    # so that a rank outside any collective still shows its last one. On an H200 with torch
    # 2.11, NCCL's entries are in _dump_nccl_trace_json only, and only_active=True left none.
    if backend == "nccl":
        return c10d._dump_nccl_trace_json(True, False)
    return c10d._dump_fr_trace_json(True, False)


def write(out: Path, backend: str | None = None) -> None:
    """The trace into `out`, whole or not at all (a reader never sees half of it)."""
    durable.write_atomically(out, trace_json(backend))


def _serve(request: Path, out: Path, poll: float) -> None:
    answered = None  # the request (its mtime) last answered
    while True:
        try:
            asked = request.stat().st_mtime_ns
        except OSError:
            asked = None
        if asked is not None and asked != answered:
            answered = asked
            try:
                write(out)
            except Exception as exc:  # a trace is a help, never a reason for the rank to fail
                out.with_name(out.name + ".error").write_text(f"{type(exc).__name__}: {exc}\n")
        time.sleep(poll)


def _dump_on_uncaught(out: Path) -> None:
    """The trace into `out` as the rank dies of an uncaught exception, then the usual report."""
    previous = sys.excepthook

    def hook(kind, value, traceback) -> None:
        try:
            write(out)
        except Exception:  # the exception itself matters more than its trace
            pass
        previous(kind, value, traceback)

    sys.excepthook = hook


def start(environ: Mapping[str, str] | None = None, poll: float = POLL) -> threading.Thread | None:
    """The watcher, once per process, and the trace written on an uncaught exception; None
    where there is nothing to serve (no run directory, no rank, or the Flight Recorder off)."""
    global _started
    environ = os.environ if environ is None else environ
    run_dir, rank = environ.get(RUN_DIR_VARIABLE), environ.get("RANK")
    if not run_dir or rank is None or not environ.get(FLIGHT_BUFFER_VARIABLE, "").strip("0"):
        return None
    if _started is not None and _started.is_alive():
        return _started
    directory = Path(run_dir)
    out = directory / FLIGHT_DUMP.format(rank=rank)
    _started = threading.Thread(
        target=_serve, args=(directory / FLIGHT_REQUEST, out, poll), name="tmn-flight", daemon=True
    )
    _started.start()
    _dump_on_uncaught(out)
    return _started
