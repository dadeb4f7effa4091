"""How long this rank waits in collectives, for the launcher's straggler watch (launch.stragglers
reads and judges it): in a synchronous job the rank the others wait for is the one whose
collectives complete as soon as it issues them, while theirs stay open until it comes. Each rank
measures this on its own clock, so nodes whose clocks differ compare as well as any.

What is measured is the time with at least one collective of the default process group open
(issued and not yet complete), so that DDP's buckets in flight together count once:
- under gloo, from the process group's pre- and post-hooks (the time a collective is issued) and
  the time it completes: for a blocking one (async_op=False), which torch waits for right after
  the post-hook, where the hook's own wait for it returns; for an asynchronous one (DDP's
  buckets), from a callback on its work's future;
- under NCCL, where a collective's future completes when it is queued, from the Flight
  Recorder's timing of each collective on the GPU (`duration_ms`, recorded with
  TORCH_NCCL_ENABLE_TIMING=1, which the launcher sets on nodes with GPUs); NCCL runs one
  group's collectives one after another, so their durations add up.

Every EVERY seconds, and as the process ends, the totals since the start go to jobenv.PACE_FILE
in the run directory (TMN_RUN_DIR), whole or not at all and readable by the node's SSH user when
the container's rank writes as root (cluster.durable, as the Flight Recorder's trace):
`{"rank", "node", "wall", "waited", "collectives"}`.

Started after init_process_group, in the main thread (training.distributed.site does it for any
script the launcher runs with a project); nothing here may stop the rank.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from torch_multinode.cluster import durable
from torch_multinode.cluster.jobenv import NODE_NAME_VARIABLE, PACE_FILE, RUN_DIR_VARIABLE

EVERY = 5.0  # seconds between two writes of the totals
HOOK_ID = 0x746D6E  # our hooks' id on the process group
_started: threading.Thread | None = None


class Waits:
    """The time with a collective open, from `opened()` and `closed()` calls (any thread)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.since = clock()
        self.waited = 0.0
        self.collectives = 0
        self._open = 0
        self._open_since = 0.0
        self._issued: dict[int, float] = {}  # op_id -> when its pre-hook ran
        self._lock = threading.Lock()

    def opened(self, at: float) -> None:
        with self._lock:
            if self._open == 0:
                self._open_since = at
            self._open += 1

    def closed(self) -> None:
        with self._lock:
            if self._open == 0:
                return
            self._open -= 1
            self.collectives += 1
            if self._open == 0:
                self.waited += self.clock() - self._open_since

    def add(self, seconds: float, count: int) -> None:
        """Collectives timed elsewhere (NCCL's, on the GPU)."""
        with self._lock:
            self.waited += seconds
            self.collectives += count

    def totals(self) -> dict[str, float | int]:
        """Seconds since the start, seconds with a collective open (the one open now counted
        up to now), collectives completed."""
        with self._lock:
            now = self.clock()
            waited = self.waited + (now - self._open_since if self._open else 0.0)
            return {"wall": now - self.since, "waited": waited, "collectives": self.collectives}

    # The process group's hooks (gloo). They run inside the script's collectives: whatever
    # goes wrong in them stays here. A work without a future (torch's coalesced ones: "Work::
    # getFuture not implemented") is not timed.
    def pre_hook(self, args) -> None:
        try:
            self._issued[args.op_id] = self.clock()
        except Exception:
            pass

    def post_hook(self, args) -> None:
        try:
            issued = self._issued.pop(args.op_id, None)
            work = args.work
            if issued is None or work is None:
                return
            if not args.async_op:
                self.opened(issued)
                self._wait(work)
                return
            future = work.get_future()
            self.opened(issued)
        except Exception:
            return
        try:
            future.add_done_callback(lambda _future: self.closed())
        except Exception:
            self.closed()

    def _wait(self, work) -> None:
        """A blocking collective (async_op=False), which torch waits for right after this hook:
        waited for here first, in the script's thread, it ends where the wait returns. That
        costs the rank nothing, where a callback from gloo's thread on each collective cost
        25 to 50 us (bench/waits_cost.py). An error stays for torch's own wait, which raises it
        to the script; launch.hang does not take this frame for the script's line."""
        try:
            work.wait()
        except Exception:
            pass
        finally:
            self.closed()


def nccl_durations(trace: dict, after: int) -> tuple[float, int, int]:
    """Seconds and count of the completed, timed collectives of the default process group in an
    NCCL Flight Recorder trace with a record id above `after`, and the highest record id
    counted."""
    seconds, count, last = 0.0, 0, after
    for entry in trace.get("entries", []):
        record = int(entry.get("record_id", -1))
        if record <= after or entry.get("is_p2p"):
            continue
        if "default_pg" not in (entry.get("process_group") or []):
            continue  # another group's, on a stream of its own: it may overlap the default's
        if entry.get("state") != "completed" or entry.get("duration_ms") is None:
            continue  # not timed (no TORCH_NCCL_ENABLE_TIMING), or not done: read again later
        seconds += float(entry["duration_ms"]) / 1000
        count += 1
        last = max(last, record)
    return seconds, count, last


class _Writer:
    """Writes the totals to `out`: every `every` seconds in a thread, and once more as the
    process ends (atexit), so that a run's last totals are in its run directory."""

    def __init__(self, waits: Waits, out: Path, head: dict, nccl: bool):
        self.waits, self.out, self.head, self.nccl = waits, out, head, nccl
        self.after = -1  # NCCL: the last Flight Recorder record counted
        self.lock = threading.Lock()

    def write(self, read_trace: bool = True) -> None:
        """The totals written; under NCCL, the Flight Recorder read first (`read_trace`), but
        not as the process ends, when its process groups may be gone."""
        try:
            with self.lock:
                if self.nccl and read_trace:
                    from torch_multinode.training.distributed.flight import trace_json

                    trace = json.loads(trace_json("nccl"))
                    seconds, count, self.after = nccl_durations(trace, self.after)
                    self.waits.add(seconds, count)
                durable.write_atomically(self.out, json.dumps({**self.head, **self.waits.totals()}))
        except Exception:  # a reading is a help, never a reason for the rank to fail
            pass

    def serve(self, every: float) -> None:
        while True:
            time.sleep(every)
            self.write()


def start(environ: Mapping[str, str] | None = None, every: float = EVERY) -> Waits | None:
    """The measurement of this rank's waits, and the thread that writes them, once per process;
    call it right after init_process_group, in the thread that issues the collectives. None
    where there is nothing to serve (no run directory, no process group)."""
    global _started
    import torch.distributed as dist

    environ = os.environ if environ is None else environ
    run_dir = environ.get(RUN_DIR_VARIABLE)
    if not run_dir or not dist.is_available() or not dist.is_initialized():
        return None
    if _started is not None:
        return None
    waits = Waits()
    rank = dist.get_rank()
    nccl = str(dist.get_backend()) == "nccl"
    if not nccl:
        group = dist.group.WORLD
        group.register_pre_hook(HOOK_ID, waits.pre_hook)
        group.register_post_hook(HOOK_ID, waits.post_hook)
    head = {"rank": rank, "node": environ.get(NODE_NAME_VARIABLE, "")}
    writer = _Writer(waits, Path(run_dir) / PACE_FILE.format(rank=rank), head, nccl)
    _started = threading.Thread(target=writer.serve, args=(every,), name="tmn-waits", daemon=True)
    _started.start()
    atexit.register(writer.write, False)
    return waits
