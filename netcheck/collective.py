"""Node side of the collective check: one rank of a real all_reduce, all_gather and broadcast.

Run on every node as `PYTHON -m torch_multinode.netcheck.collective --rank R --world-size N ...` with the
socket interface variables set. It first reports the software probe's facts (so a node imports
torch once per netcheck run), agrees with its peers over gloo whether every rank can use NCCL,
then runs each op at each size on NCCL (GPU) or gloo (CPU). Every result is checked exactly
(float32 holding small whole numbers sums exactly), then timed. Each stage (init, then each op at each size) runs under a
watchdog: past --timeout seconds the rank prints which stage hung and exits, so a dead peer
never leaves a process behind. Progress and the final result are JSON lines prefixed with
RESULT_PREFIX; the controller reads the last one.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import threading
import time
from datetime import timedelta

from torch_multinode.cluster.nccl_transport import (
    NCCL_TRANSPORT_ENV,
    gpudirect,
    hcas_used,
    nccl_warnings,
    peermem_loaded,
    rdma_devices,
    transport_used,
    verbs_usable,
    with_nccl_words,
)
from torch_multinode.netcheck import bandwidth
from torch_multinode.netcheck.softprobe import probe

RESULT_PREFIX = "NETCHECK "
WATCHDOG_EXIT = 3
IMPORT_TIMEOUT = 60.0


def emit(data: dict) -> None:
    sys.stdout.write(RESULT_PREFIX + json.dumps(data) + "\n")
    sys.stdout.flush()


class Watchdog:
    """Ends the process when one stage outlives the wall-clock limit."""

    def __init__(self, rank: int, seconds: float, nccl_log: str | None = None):
        self.rank, self.seconds, self.nccl_log = rank, seconds, nccl_log
        self._timer: threading.Timer | None = None

    def start(self, stage: str, seconds: float | None = None) -> None:
        self.stop()
        self._timer = threading.Timer(
            seconds or self.seconds, self._expire, args=(stage, seconds or self.seconds)
        )
        self._timer.daemon = True
        self._timer.start()

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self, stage: str, seconds: float) -> None:
        emit(
            {
                "rank": self.rank,
                "ok": False,
                "stage": stage,
                "error": with_nccl_warnings(
                    f"{stage} did not finish within {seconds:g} s", self.nccl_log
                ),
            }
        )
        os._exit(WATCHDOG_EXIT)


def describe(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:300]}" if lines else type(exc).__name__


def with_nccl_warnings(error: str, nccl_log: str | None, most: int = 2) -> str:
    """`error` with NCCL's own last WARN lines from this worker's log (cluster.nccl_transport.
    with_nccl_words). Gloo's workers have no NCCL log."""
    if nccl_log is None:
        return error
    try:
        with open(nccl_log, errors="replace") as file:
            said = nccl_warnings(file.read())
    except OSError:
        return error
    return with_nccl_words(error, said, most)


def pattern(torch, count: int, device):
    """Small whole numbers, different at each position, exact in float32 after summing."""
    return torch.arange(count, device=device, dtype=torch.float32) % 1021


def run_op(
    torch,
    dist,
    op: str,
    count: int,
    rank: int,
    world: int,
    device,
    iterations: int,
    synchronize,
    group=None,
):
    """One op at one size: a checked call, then `iterations` timed calls. Returns (seconds, bad)."""
    base = pattern(torch, count, device)
    if op == "all_reduce":
        data = base + rank
        dist.all_reduce(data, group=group)
        expected = base * world + world * (world - 1) // 2
        bad = int((data != expected).sum())

        def call():
            dist.all_reduce(data, group=group)
    elif op == "all_gather":
        mine = base + rank
        out = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(out, mine, group=group)
        bad = sum(int((out[r] != base + r).sum()) for r in range(world))

        def call():
            dist.all_gather(out, mine, group=group)
    elif op == "broadcast":
        data = base + 7 if rank == 0 else torch.zeros_like(base)
        dist.broadcast(data, src=0, group=group)
        bad = int((data != base + 7).sum())

        def call():
            dist.broadcast(data, src=0, group=group)
    else:
        raise ValueError(op)
    synchronize()
    dist.barrier(group=group)
    started = time.perf_counter()
    for _ in range(iterations):
        call()
    synchronize()
    elapsed = (time.perf_counter() - started) / iterations
    # The slowest rank defines the op's time.
    slowest = torch.tensor([elapsed], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return float(slowest.item()), bad


def nccl_log_path(token: str) -> str:
    """Where this worker's NCCL writes its INFO lines (NCCL_DEBUG_FILE): a file of its own, so
    that the network NCCL chose is read back without flooding the output the controller
    parses."""
    return os.path.join(tempfile.gettempdir(), f"{token or 'netcheck'}-nccl-{os.getpid()}.log")


def log_nccl_transport(path: str) -> None:
    """Make NCCL say which network it uses, into `path`. NCCL reads these once, when it first
    logs (at the first communicator): this must run before the NCCL group is made."""
    os.environ.update(NCCL_TRANSPORT_ENV)
    os.environ["NCCL_DEBUG_FILE"] = path


def read_transport(backend: str, log_path: str | None) -> dict:
    """What the controller needs to judge the transport: the network NCCL used (None when it did
    not say), the node's RDMA devices, whether this process could open them, the HCA ports NCCL
    took, GPUDirect RDMA (cluster.nccl_transport.gpudirect) and whether nvidia-peermem is
    loaded; on gloo, why there is nothing to judge."""
    hardware = rdma_devices()
    found = {"rdma": hardware, "verbs": verbs_usable() if hardware else False}
    if backend != "nccl":
        return {**found, "used": None, "reason": "gloo on CPU nodes: TCP sockets, no NCCL"}
    log = ""
    if log_path:
        try:
            with open(log_path, encoding="utf-8", errors="replace") as file:
                log = file.read()
        except OSError:
            pass
    used = transport_used(log)
    return {
        **found,
        "used": used,
        "hcas": hcas_used(log),
        "gdr": gpudirect(log, used),
        "peermem": peermem_loaded(),
    }


def nccl_group(dist, device):
    """The NCCL group for the data, bound to this rank's GPU: torch then forms the communicator
    at once (not at the first collective), NCCL's INFO lines are written by the time it
    returns, and its barriers know their device instead of warning that they guess it."""
    return dist.new_group(backend="nccl", device_id=device)


def choose_backend(stacks: list[dict], allow_nccl: bool) -> str:
    """NCCL only when the inventory gives every node GPUs and every rank's torch can use them
    with NCCL; otherwise gloo on the CPU. Every rank decides from the same gathered facts."""
    usable = all(
        s.get("cuda_available") and s.get("gpus", 0) > 0 and s.get("nccl_backend") for s in stacks
    )
    return "nccl" if allow_nccl and stacks and usable else "gloo"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_multinode.netcheck.collective")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--master-addr", required=True)
    parser.add_argument("--master-port", type=int, required=True)
    parser.add_argument(
        "--allow-nccl",
        action="store_true",
        help="the inventory gives every node GPUs: use NCCL if all ranks can",
    )
    parser.add_argument("--sizes", default=bandwidth.sizes_text(bandwidth.QUICK_SIZES))
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per stage")
    parser.add_argument(
        "--import-timeout",
        type=float,
        default=IMPORT_TIMEOUT,
        help="seconds to import torch (cold caches, network filesystems)",
    )
    parser.add_argument("--token", default="", help="marks the process for cleanup")
    args = parser.parse_args(argv)
    rank, world = args.rank, args.world_size
    # Before torch is imported: NCCL must not have logged anything yet.
    nccl_log = nccl_log_path(args.token) if args.allow_nccl else None
    if nccl_log:
        log_nccl_transport(nccl_log)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    watchdog = Watchdog(rank, args.timeout, nccl_log)

    # The software check's facts come from this very process: one torch import per node.
    watchdog.start("import torch and query the GPUs", args.import_timeout)
    stack = probe()
    emit({"rank": rank, "software": stack})
    if "torch_error" in stack:
        watchdog.stop()
        emit({"rank": rank, "ok": False, "stage": "import torch", "error": stack["torch_error"]})
        return 1
    import torch
    import torch.distributed as dist

    # gloo carries the control traffic on every machine; the data group is NCCL only when
    # every rank can use it.
    watchdog.start("init_process_group")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{args.master_addr}:{args.master_port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=args.timeout),
    )
    results = []
    try:
        watchdog.start("agreeing on the backend")
        stacks: list[dict] = [{} for _ in range(world)]
        dist.all_gather_object(stacks, stack)
        backend = choose_backend(stacks, args.allow_nccl)
        if backend == "nccl":
            # One worker per node: its GPU is the first one it sees (local rank 0).
            device = torch.device("cuda", 0)
            torch.cuda.set_device(device)
            watchdog.start("forming the NCCL communicator")
            group = nccl_group(dist, device)

            def synchronize():
                torch.cuda.synchronize(device)
        else:
            device, group = torch.device("cpu"), None

            def synchronize():
                pass

        for op in bandwidth.OPS:
            for size in sizes:
                count = bandwidth.elements(op, size, world)
                nbytes = count * bandwidth.ELEMENT_BYTES * (world if op == "all_gather" else 1)
                watchdog.start(f"{op} of {nbytes} bytes")
                seconds, bad = run_op(
                    torch,
                    dist,
                    op,
                    count,
                    rank,
                    world,
                    device,
                    bandwidth.iterations(nbytes),
                    synchronize,
                    group,
                )
                results.append({"op": op, "bytes": nbytes, "seconds": seconds, "mismatches": bad})
        watchdog.start("barrier")
        dist.barrier()
    except Exception as exc:  # noqa: BLE001 - the controller gets the reason as data
        watchdog.stop()
        error = with_nccl_warnings(describe(exc), nccl_log)
        emit({"rank": rank, "ok": False, "stage": "collective", "error": error})
        os._exit(1)
    watchdog.stop()
    transport = read_transport(backend, nccl_log)
    if nccl_log:
        with contextlib.suppress(OSError):
            os.remove(nccl_log)
    emit(
        {
            "rank": rank,
            "ok": all(r["mismatches"] == 0 for r in results),
            "backend": backend,
            "world_size": world,
            "results": results,
            "transport": transport,
        }
    )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
