"""Which network transport NCCL used between nodes, read from NCCL's own INFO lines, and whether
that matches the node's hardware. One owner for the rule: netcheck's collective and `make
selftest` both ask here.

NCCL says which network it picked once per communicator, at init, when NCCL_DEBUG=INFO and the
INIT or NET subsystem is shown (NCCL's environment-variable documentation; src/init.cc prints
"Using network <name>", where <name> is "IB" for InfiniBand and RoCE through verbs, "Socket" for
TCP, or a plugin's name). Before it, each transport says what it found ("NET/IB : No device
found." or "NET/IB : Using [0]mlx5_0:1/IB ...").

A node has InfiniBand (or RoCE) hardware when the kernel lists RDMA devices in
/sys/class/infiniband; a container can use them only when it has /dev/infiniband (the launcher
passes it where the node has it) and the image has libibverbs.

Runs on the nodes: imports nothing of the project's but the standard library.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# What a process needs in its environment for NCCL to say which network it used (and little else).
NCCL_TRANSPORT_ENV = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET"}

_USING_NETWORK = re.compile(r"NCCL INFO Using network (?P<name>\S+)")
_IB_FOUND = re.compile(r"NCCL INFO NET/IB : Using \[")

RDMA_CLASS_DIR = Path("/sys/class/infiniband")
RDMA_DEVICE_DIR = Path("/dev/infiniband")


def transport_used(log: str) -> str | None:
    """The network NCCL picked ("IB", "Socket", or a plugin's name) from its INFO lines, or None
    when the log has no such line (NCCL_DEBUG was not INFO, or no inter-node communicator was
    made). Several communicators: the last one's answer (all of a job's agree in practice)."""
    found = _USING_NETWORK.findall(log)
    return found[-1] if found else None


def rdma_devices(class_dir: Path = RDMA_CLASS_DIR) -> list[str]:
    """The RDMA (InfiniBand or RoCE) devices the kernel has, e.g. ['mlx5_0', 'mlx5_1']."""
    try:
        return sorted(entry.name for entry in class_dir.iterdir())
    except OSError:
        return []


def verbs_usable(device_dir: Path = RDMA_DEVICE_DIR) -> bool:
    """Whether this process (a container, perhaps) can open the verbs devices at all."""
    return device_dir.is_dir() and any(
        os.access(p, os.R_OK | os.W_OK) for p in device_dir.iterdir()
    )


def transport_finding(
    used: str | None, hardware: list[str], verbs: bool | None = None
) -> tuple[str, str]:
    """(status, detail) for a collective that used `used` on a node with RDMA devices
    `hardware`: PASS when they agree, WARN when InfiniBand/RoCE exists but NCCL fell back to
    sockets (an order of magnitude slower), SKIP when NCCL did not say. `verbs`, when known:
    whether the process that ran NCCL could open /dev/infiniband (verbs_usable), which tells
    the missing device files apart from a missing libibverbs."""
    if used is None:
        return "SKIP", "NCCL did not say which network it used (no 'Using network' line)"
    if used == "Socket" and hardware:
        if verbs is False:
            why = (
                "this process cannot open /dev/infiniband (try a container with its devices, "
                "which the launcher gives where the node has them, or the node's permissions "
                "on /dev/infiniband)"
            )
        elif verbs:
            why = (
                "/dev/infiniband is open to it, so libibverbs or NCCL_IB_DISABLE is the likely "
                "cause (try an image with libibverbs (make image) and NCCL_IB_DISABLE unset; "
                "NCCL_DEBUG=INFO says why IB was not used)"
            )
        else:
            why = (
                "try a container with /dev/infiniband, which the launcher gives where the node "
                "has it, an image with libibverbs (make image), and NCCL_IB_DISABLE unset; "
                "NCCL_DEBUG=INFO says why IB was not used"
            )
        return "WARN", (
            f"NCCL used TCP sockets although the node has RDMA devices ({', '.join(hardware)}): "
            f"inter-node traffic is an order of magnitude slower than it could be ({why})"
        )
    if used == "Socket":
        return "PASS", "NCCL used TCP sockets (no RDMA device on this node)"
    return "PASS", f"NCCL used {used}" + (f" ({', '.join(hardware)})" if hardware else "")
