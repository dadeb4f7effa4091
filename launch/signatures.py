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
    unless: tuple[str, ...] = ()  # other signatures that, when found, explain these lines better

    def line(self) -> str:
        return f"Known problem: {self.cause} (try {self.remedy})"


def _signature(
    name: str,
    pattern: str,
    cause: str,
    remedy: str,
    knock_on: bool = False,
    unless: tuple[str, ...] = (),
) -> Signature:
    return Signature(name, re.compile(pattern), cause, remedy, knock_on, unless)


# torch 2.14's TCPStore (libtorch_cpu's Utils.hpp) when the store's other end closed.
STORE_CLOSED = "Failed to recv, got 0 bytes"

# The order is the order of the summary's lines: a root cause before what follows from it.
SIGNATURES = (
    _signature(
        "cuda-out-of-memory",
        # NCCL's own allocation failing says it its way: Cuda failure 2 'out of memory'.
        r"CUDA out of memory|torch\.OutOfMemoryError|CUDA error: out of memory|"
        r"Cuda failure \d* ?'out of memory'",
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
        "gpu-driver-too-old",
        r"The NVIDIA driver on your system is too old|"
        r"CUDA driver version is insufficient for CUDA runtime version|"
        r"Error 803: system has unsupported display driver / cuda driver combination",
        "the node's NVIDIA driver is older than this torch's CUDA needs, or was upgraded "
        "without a reboot (its kernel module and its library then differ)",
        "make netcheck, which names each node's driver and the branch torch's CUDA needs; a "
        "reboot of a node whose driver was upgraded",
    ),
    _signature(
        "gpu-busy",
        r"busy or unavailable",
        "a GPU refused the job: another process holds it in EXCLUSIVE_PROCESS compute mode, or "
        "it is in a bad state",
        "nvidia-smi on that node (its processes, and its compute mode: nvidia-smi -c DEFAULT), "
        "or GPUS= naming free GPUs",
    ),
    _signature(
        "gpu-fault",
        r"an illegal memory access was encountered|uncorrectable ECC error encountered|"
        r"unspecified launch failure",
        "a GPU fault: an illegal memory access (a kernel's bug, often a custom op's) or an "
        "uncorrectable ECC error (the hardware)",
        "dmesg on that node for NVIDIA's Xid lines and nvidia-smi -q -d ECC; ENV=CUDA_LAUNCH_"
        "BLOCKING=1 names the kernel",
    ),
    _signature(
        "shared-memory",
        r"[Bb]us error|Signal 7 \(SIGBUS\)|insufficient shared memory|"
        r"unable to (?:write to|allocate) (?:file|shared)|"
        r"No space left on device.*/dev/shm|/dev/shm.*No space left on device|"
        r"shm_open|torch_shm_manager",
        "shared memory (/dev/shm) ran out: the data loader's workers pass batches through it, "
        "and NCCL its buffers between a node's ranks",
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
        # torch 2.14 retries a refused connection quietly, then says it timed out.
        r"RendezvousConnectionError|The client socket has failed to connect to|"
        r"The client socket has timed out after|Connection refused.*(?:store|rendezvous)",
        "a node could not reach the master's rendezvous store",
        "make netcheck (the firewall, the nodes' compute_ip and the rendezvous_port)",
        # The master's own port taken is wrapped in a RendezvousConnectionError too, and so is
        # a store lost mid-run.
        unless=("address-in-use", "rendezvous-store-lost"),
    ),
    _signature(
        "rendezvous-timeout",
        r"RendezvousTimeoutError",
        "not every node joined the rendezvous in time: one did not start, or could not reach "
        "the master",
        "the other nodes' own lines in this summary; make netcheck",
    ),
    _signature(
        "ib-transport-error",
        r"NET/IB ?: Got completion (?:from peer|with error)",
        "InfiniBand/RoCE failed under NCCL: a link, cable or switch port (the ranks' "
        "connection errors follow from it)",
        "ibstat and the port counters (perfquery) on both nodes; ENV=NCCL_IB_DISABLE=1 runs "
        "over TCP to confirm",
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
        r"bytes instead of|Mismatched NCCL version detected|"
        r"appears not to match (?:sizes|strides) of the same param",
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
        # Not torchrun's exit barrier ("Timed out waiting on barrier on rank"): no collective.
        r"Watchdog caught collective operation timeout|[Tt]imed out waiting(?! on barrier)|"
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
    _signature(
        "rendezvous-store-lost",
        # A node's torchrun asking the master's (which holds the store) if nodes wait to join.
        rf"{STORE_CLOSED}|Did the remote server shutdown or crash",
        "a node's torchrun lost the master's rendezvous store mid-run: the master's torchrun "
        "had ended (its ranks failed, or it was stopped) or its node went away",
        "the master node's own lines in this summary",
        knock_on=True,
    ),
)


def known_problems(lines: Iterable[str], cause_found: bool = False) -> list[Signature]:
    """The signatures found in `lines`, once each, in the table's order; a knock-on's only
    when no rank's own exception was found (the summary's Consequence lines say it then)."""
    text = list(lines)
    found = [s for s in SIGNATURES if any(s.pattern.search(line) for line in text)]
    names = {s.name for s in found}
    return [
        s for s in found if not (s.knock_on and cause_found) and not names.intersection(s.unless)
    ]
