"""Known failure signatures: the error strings users of multi-node PyTorch meet, each mapped to
its usual cause and what to do, for a failed job's summary.

A signature is matched against the last lines of the job's nodes (a rank's traceback, NCCL's
and torch's own messages). Each matched one adds a line `Known problem: CAUSE (try REMEDY)`
under the summary's cause, at most once per signature, in the table's order. A knock-on (a
peer's connection reset) is said only when no rank's own exception was found.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Signature:
    name: str
    pattern: re.Pattern[str]
    cause: str
    remedy: str
    knock_on: bool = False  # follows from another failure: said only when no cause was found

    def line(self) -> str:
        return f"Known problem: {self.cause} (try {self.remedy})"


def _signature(
    name: str, pattern: str, cause: str, remedy: str, knock_on: bool = False
) -> Signature:
    return Signature(name, re.compile(pattern), cause, remedy, knock_on)


# The order is the order of the summary's lines: a root cause before what follows from it.
SIGNATURES = (
    _signature(
        "cuda-out-of-memory",
        r"CUDA out of memory|torch\.OutOfMemoryError|CUDA error: out of memory",
        "a GPU ran out of memory",
        "a smaller --global-batch-size, --precision bf16, or MODULE=training.fsdp, which "
        "shards parameters, gradients and optimizer state",
    ),
    _signature(
        "no-kernel-image",
        r"no kernel image is available for execution on the device",
        "this torch has no code for the GPU's architecture (a build for other GPUs)",
        "make netcheck, which lists each node's compute capability and torch's CUDA; "
        "make image builds the image for the nodes' GPUs",
    ),
    _signature(
        "shared-memory",
        r"[Bb]us error|insufficient shared memory|unable to (?:write to|allocate) (?:file|shared)|"
        r"No space left on device.*/dev/shm|/dev/shm.*No space left on device|"
        r"shm_open|torch_shm_manager",
        "shared memory (/dev/shm) ran out: the data loader's workers pass batches through it",
        "--workers 0 to check, then a larger /dev/shm on the node (df -h /dev/shm; "
        "mount -o remount,size=16G /dev/shm)",
    ),
    _signature(
        "address-in-use",
        r"Address already in use|EADDRINUSE|"
        r"The server socket has failed to listen on any local network address",
        "the rendezvous port is taken on the master, often by a crashed run's process",
        "make netcheck, which names the process holding the port, or another "
        "rendezvous_port in the inventory",
    ),
    _signature(
        "rendezvous-unreachable",
        r"RendezvousConnectionError|The client socket has failed to connect to|"
        r"Connection refused.*(?:store|rendezvous)",
        "a node could not reach the master's rendezvous store",
        "make netcheck (the firewall, the nodes' compute_ip and the rendezvous_port)",
    ),
    _signature(
        "nccl-system-error",
        r"unhandled system error|ncclSystemError",
        "NCCL failed in a system call: usually the network interface it chose, /dev/shm, or "
        "locked memory for RDMA",
        "make netcheck, then DEBUG=1 for NCCL's own lines (NCCL_DEBUG=INFO)",
    ),
    _signature(
        "nodes-differ",
        r"DDP expects same model across all ranks|[Mm]essage truncated ?: receiv\w* [\d,]+ "
        r"bytes instead of",
        "the ranks disagree on what they run: a model built differently (other code, or other "
        "torch or torchvision versions on one node), or NCCL of another version or with other "
        "settings on one node",
        "jobs in the training image (launch_mode: container), which runs the same torch, "
        "torchvision and NCCL everywhere; make netcheck lists each node's torch and NCCL "
        "versions; the same NCCL_* variables on every node",
    ),
    _signature(
        "collective-mismatch",
        r"Detected mismatch between collectives|mismatch between collectives on ranks",
        "ranks called different collectives (or shapes) at the same point: one rank skipped "
        "or reordered one",
        "the same collectives in the same order on every rank, e.g. no collective under "
        "`if rank == 0`",
    ),
    _signature(
        "collective-timeout",
        r"Watchdog caught collective operation timeout|[Tt]imed out waiting|"
        r"Timed out after \d+ ms|DistBackendError.*[Tt]imeout",
        "a collective timed out: a rank stopped, or never reached it",
        "the Cause line's rank and its last lines; --collective-timeout to wait longer for "
        "slow steps",
    ),
    _signature(
        "peer-reset",
        r"Connection reset by peer|Connection closed by peer|"
        r"Broken pipe|ECONNRESET|remote process exited or there was a network error",
        "a peer's connection went away: this follows from another rank's failure or a lost "
        "node, not a cause of its own",
        "the first rank that failed, or the node that stopped answering",
        knock_on=True,
    ),
)


def known_problems(lines: Iterable[str], cause_found: bool = False) -> list[Signature]:
    """The signatures found in `lines`, once each, in the table's order; a knock-on's only
    when no rank's own exception was found (the summary's Consequence lines say it then)."""
    text = list(lines)
    return [
        s
        for s in SIGNATURES
        if not (s.knock_on and cause_found) and any(s.pattern.search(line) for line in text)
    ]
