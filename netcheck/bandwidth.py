"""nccl-tests' bandwidth arithmetic, shared by the node workers and the controller.

algbw = size / time. busbw scales algbw by how much of the message each rank must move over its
links, so that busbw is comparable to one link's speed whatever the node count
(https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md):

  all_reduce  busbw = algbw * 2(n-1)/n
  all_gather  busbw = algbw * (n-1)/n      (size = the whole gathered buffer, n x per-rank)
  broadcast   busbw = algbw
"""

from __future__ import annotations

OPS = ("all_reduce", "all_gather", "broadcast")
GB = 1e9  # nccl-tests' GB/s are 10^9 bytes per second

# Without the sweep: enough to prove the stack works end to end, quickly.
QUICK_SIZES = (1 << 10, 1 << 20)
# The sweep: 1 KiB to 64 MiB by factors of 4; the largest shows the link's bandwidth.
SWEEP_SIZES = tuple(1 << shift for shift in range(10, 27, 2))
ELEMENT_BYTES = 4  # float32
# Iterations per size: enough traffic to time well, bounded so the sweep stays short.
TARGET_BYTES = 128 << 20
MIN_ITERATIONS, MAX_ITERATIONS = 2, 20


def bus_factor(op: str, nranks: int) -> float:
    if nranks < 1:
        raise ValueError(f"nranks must be at least 1, not {nranks}")
    if op == "all_reduce":
        return 2 * (nranks - 1) / nranks
    if op == "all_gather":
        return (nranks - 1) / nranks
    if op == "broadcast":
        return 1.0
    raise ValueError(f"unknown collective {op!r}")


def algbw(size_bytes: int, seconds: float) -> float:
    """GB/s."""
    return size_bytes / seconds / GB if seconds > 0 else 0.0


def busbw(op: str, size_bytes: int, seconds: float, nranks: int) -> float:
    """GB/s."""
    return algbw(size_bytes, seconds) * bus_factor(op, nranks)


def iterations(size_bytes: int) -> int:
    return max(MIN_ITERATIONS, min(MAX_ITERATIONS, TARGET_BYTES // max(size_bytes, 1)))


def elements(op: str, size_bytes: int, nranks: int) -> int:
    """Elements in each rank's input: all_gather's size is the gathered total, as in nccl-tests."""
    count = size_bytes // ELEMENT_BYTES
    if op == "all_gather":
        count //= nranks
    return max(count, 1)


def sizes_text(sizes: tuple[int, ...] | list[int]) -> str:
    return ",".join(str(s) for s in sizes)
