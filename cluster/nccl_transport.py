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

GPUDirect RDMA (the HCA reading and writing GPU memory itself, without a copy through host
memory) is read from the same lines, their formats as NCCL 2.21 to 2.30 print them (src/graph/
topo.cc, src/transport/net.cc, src/transport/net_ib): per HCA "NET/IB : GPU Direct RDMA Enabled
for HCA 0 'mlx5_0'" (or Disabled: neither nvidia-peermem loaded nor DMA-BUF usable, NCCL's own
test), and per connection "Channel 00/0 : 0[0] -> 1[0] [send] via NET/IB/0/GDRDMA" (without
"/GDRDMA": through host memory, NCCL's choice for that GPU and HCA). Which HCAs NCCL took:
"NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/RoCE [RO]; OOB eth1:10.7.0.1<0>" (NCCL_IB_HCA
narrows it). A failure's cause: its WARN lines ("host:pid:tid [dev] file:line (func) NCCL WARN
message", src/debug.cc), and torch's error, which ends with NCCL's last one after "Last error:"
(torch 2.14.1's C10D_NCCL_CHECK).

Runs on the nodes: imports nothing of the project's but the standard library.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# What a process needs in its environment for NCCL to say which network it used (and little else).
NCCL_TRANSPORT_ENV = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET"}

_USING_NETWORK = re.compile(r"NCCL INFO Using network (?P<name>\S+)")
_IB_USING = re.compile(r"NCCL INFO NET/IB : Using(?P<devices>(?: \[\d+\]\S+)+)")
_IB_DEVICE = re.compile(r"\[\d+\](?P<name>[^:\s/]+):(?P<port>\d+)")
_HCA_GDR = re.compile(
    r"NCCL INFO NET/(?P<network>\S+) : GPU Direct RDMA (?P<state>Enabled|Disabled) for HCA \d+ "
    r"'(?P<name>[^']*)'"
)
_CHANNEL_NET = re.compile(
    r"NCCL INFO Channel \S+ : .*\[(?:send|receive)\] via NET/[^/\s]+/\d+(?:\(\d+\))?"
    r"(?P<gdr>/GDRDMA)?"
)
_DMA_BUF = re.compile(r"NCCL INFO DMA-BUF is available on GPU device")
WARN_MARK = " NCCL WARN "
PEERMEM_MODULE = Path("/sys/module/nvidia_peermem")  # what NCCL's net_ib/gdr.cc looks for
# How the HCAs reach GPU memory: nvidia-peermem (shipped with the driver, loaded by hand), or
# DMA-BUF (the open kernel modules, Linux 5.12 or newer, and an rdma-core with
# ibv_reg_dmabuf_mr, which NCCL tries first).
GDR_REMEDY = (
    "modprobe nvidia-peermem on the node, and nvidia-peermem in /etc/modules-load.d/ to keep it "
    "after a reboot; or DMA-BUF: the driver's open kernel modules on Linux 5.12 or newer"
)

RDMA_CLASS_DIR = Path("/sys/class/infiniband")
RDMA_DEVICE_DIR = Path("/dev/infiniband")


def transport_used(log: str) -> str | None:
    """The network NCCL picked ("IB", "Socket", or a plugin's name) from its INFO lines, or None
    when the log has no such line (NCCL_DEBUG was not INFO, or no inter-node communicator was
    made). Several communicators: the last one's answer (all of a job's agree in practice)."""
    found = _USING_NETWORK.findall(log)
    return found[-1] if found else None


def hcas_used(log: str) -> list[str]:
    """The HCA ports NCCL's IB transport took ("mlx5_0:1"), from its last "NET/IB : Using" line;
    [] where it took none or did not say."""
    found = list(_IB_USING.finditer(log))
    if not found:
        return []
    return [f"{m['name']}:{m['port']}" for m in _IB_DEVICE.finditer(found[-1]["devices"])]


def gpudirect(log: str, network: str | None) -> dict:
    """What NCCL's lines say of GPUDirect RDMA over `network` (the one it used): "used", True
    where a connection over the network reads and writes GPU memory itself ("/GDRDMA"), False
    where every one goes through host memory, None where none went over the network (one node,
    or the lines not shown); "off" (the HCAs NCCL found unable to: neither nvidia-peermem loaded
    nor DMA-BUF usable); "dmabuf" (NCCL found DMA-BUF on the GPU)."""
    channels = [m["gdr"] for m in _CHANNEL_NET.finditer(log)]
    off = sorted(
        {
            m["name"]
            for m in _HCA_GDR.finditer(log)
            if m["state"] == "Disabled" and m["network"] == network
        }
    )
    return {
        "used": any(channels) if channels else None,
        "off": off,
        "dmabuf": bool(_DMA_BUF.search(log)),
    }


def peermem_loaded(module: Path = PEERMEM_MODULE) -> bool:
    """Whether the node's kernel has nvidia-peermem loaded (visible in a container too)."""
    return module.is_dir()


def hcas_named(spec: str, devices: list[str]) -> list[str]:
    """The devices among `devices` that NCCL_IB_HCA=`spec` leaves to NCCL, by NCCL's own rule
    (2.30.7's net_ib/init.cc and misc/utils.cc): a leading "^" excludes the entries, a "=" after
    it matches names exactly, otherwise each name is a prefix ("mlx5" takes mlx5_0 and
    mlx5_1); a ":port" suffix does not change which devices."""
    exclude = spec.startswith("^")
    spec = spec[1:] if exclude else spec
    exact = spec.startswith("=")
    spec = spec[1:] if exact else spec
    names = [entry.split(":")[0] for entry in spec.split(",") if entry.split(":")[0]]
    if not names:
        return list(devices)

    def named(device: str) -> bool:
        return any(device == name if exact else device.startswith(name) for name in names)

    return [device for device in devices if named(device) != exclude]


def nccl_warnings(log: str) -> list[str]:
    """NCCL's WARN messages in `log`, oldest first, without NCCL's prefix (host, pid, source)."""
    return [line.split(WARN_MARK, 1)[1].strip() for line in log.splitlines() if WARN_MARK in line]


def last_error(message: str) -> str | None:
    """NCCL's last WARN as torch's NCCL error carries it after "Last error:", or None."""
    _, found, after = message.partition("Last error:")
    lines = [line.strip() for line in after.splitlines() if line.strip()]
    if not found or not lines or lines[0] == "Unknown NCCL Error":
        return None
    return lines[0]


def with_nccl_words(error: str, said: list[str], most: int = 2) -> str:
    """`error` followed by NCCL's own last `most` WARN messages: the cause that the first line
    of torch's NCCL error leaves out ("unhandled system error (run with NCCL_DEBUG=INFO for
    details)" above "socketStartConnect: Connect to 10.7.0.2<40123> failed : Connection
    refused")."""
    if not said:
        return error
    return f"{error} (NCCL: {'; '.join(said[-most:])[:400]})"


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
    used: str | None,
    hardware: list[str],
    verbs: bool | None = None,
    hcas: list[str] | None = None,
    gdr: dict | None = None,
    peermem: bool | None = None,
) -> tuple[str, str]:
    """(status, detail) for a collective that used `used` on a node with RDMA devices
    `hardware`: PASS when they agree, WARN when InfiniBand/RoCE exists but NCCL fell back to
    sockets (an order of magnitude slower), SKIP when NCCL did not say. `verbs`, when known:
    whether the process that ran NCCL could open /dev/infiniband (verbs_usable), which tells
    the missing device files apart from a missing libibverbs. Over RDMA, `hcas` (hcas_used)
    names the ports NCCL took, and `gdr` (gpudirect) whether it reached GPU memory directly:
    WARN where its HCAs could but for nvidia-peermem or DMA-BUF (`peermem`: whether the module
    is loaded, peermem_loaded), since every transfer then goes through host memory."""
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
    said = f"NCCL used {used}"
    if hcas:
        said += f" on {', '.join(hcas)}"
    elif hardware:
        said += f" ({', '.join(hardware)})"
    if gdr is None or gdr.get("used") is None:
        return "PASS", said
    if gdr["used"]:
        return "PASS", f"{said}, with GPUDirect RDMA"
    if gdr.get("off"):
        missing = []
        if peermem is False:
            missing.append("nvidia-peermem is not loaded")
        if not gdr.get("dmabuf"):
            missing.append("NCCL found no DMA-BUF on the GPU")
        why = f" ({'; '.join(missing)})" if missing else ""
        return "WARN", (
            f"{said} without GPUDirect RDMA: NCCL found {', '.join(gdr['off'])} unable to reach "
            f"GPU memory{why}, so every transfer is copied through host memory, slower and "
            f"with more CPU (try {GDR_REMEDY})"
        )
    return "PASS", (
        f"{said}, without GPUDirect RDMA: NCCL's choice for this GPU and HCA (their distance on "
        "PCIe, NCCL_NET_GDR_LEVEL; or a GPU without it)"
    )
