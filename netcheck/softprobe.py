"""Node side of the software check: what the training interpreter sees. Prints one JSON line.

Shipped as source (`PYTHON -c SOURCE`) so that a node whose torch or netcheck is missing still
answers, saying what is missing, instead of failing to start.
"""

from __future__ import annotations

import json
import os
import platform
import re
import resource
import shutil
import subprocess
import sys


def probe() -> dict:
    found: dict[str, object] = {"python": platform.python_version(), "executable": sys.executable}
    try:
        import torch
        import torch.distributed as dist

        found["torch"] = torch.__version__
        found["cuda"] = torch.version.cuda
        found["cuda_available"] = bool(torch.cuda.is_available())
        found["gpus"] = torch.cuda.device_count() if found["cuda_available"] else 0
        try:
            found["nccl"] = ".".join(str(part) for part in torch.cuda.nccl.version())
        except Exception:  # noqa: BLE001 - CPU-only builds have no NCCL
            found["nccl"] = None
        # The GPU architectures its kernels were built for (a CUDA build's constant, no GPU
        # needed); None on a CPU build.
        arch_flags = getattr(getattr(torch, "_C", None), "_cuda_getArchFlags", None)
        found["cuda_archs"] = (arch_flags() or None) if arch_flags else None
        found["gloo"] = bool(dist.is_available() and dist.is_gloo_available())
        found["nccl_backend"] = bool(dist.is_available() and dist.is_nccl_available())
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        found["torch_error"] = f"{type(exc).__name__}: {exc}"
    try:
        import torch_multinode.netcheck  # noqa: F401 - the collective workers run as `python -m torch_multinode.netcheck...`

        found["netcheck"] = True
    except Exception:  # noqa: BLE001
        found["netcheck"] = False
    try:
        stat = os.statvfs("/dev/shm")
        found["shm_bytes"] = stat.f_frsize * stat.f_blocks
    except OSError:
        found["shm_bytes"] = None
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    found["memlock_bytes"] = -1 if soft == resource.RLIM_INFINITY else soft  # -1: unlimited
    found["nvidia_smi_gpus"] = None
    if shutil.which("nvidia-smi"):
        try:
            out = _nvidia_smi("-L")
            found["nvidia_smi_gpus"] = sum(line.startswith("GPU ") for line in out.splitlines())
            # What nvidia-smi prints when it fails ("NVIDIA-SMI has failed because...", "Failed
            # to initialize NVML: ...") is no version: only numbers are taken.
            driver = _nvidia_smi("--query-gpu=driver_version", "--format=csv,noheader").split()
            found["driver"] = driver[0] if driver and _VERSION.match(driver[0]) else None
            listed = _nvidia_smi("--query-gpu=name,compute_cap", "--format=csv,noheader")
            found["gpu_capabilities"] = [
                [part.strip() for part in line.rsplit(",", 1)]
                for line in listed.splitlines()
                if line.count(",") >= 1 and _VERSION.match(line.rsplit(",", 1)[1].strip())
            ]
        except (OSError, subprocess.SubprocessError):
            pass
    found.update(fabric())
    return found


# --- NVSwitch and fabric manager ------------------------------------------------------------
# An NVSwitch system's GPUs initialise only once NVIDIA's fabric manager (nv-fabricmanager, the
# nvidia-fabricmanager service) has set the switches up. Everything here is read without a
# driver and without privileges, and also from inside a container: /sys is there, and
# nvidia-smi reports each GPU's fabric registration. Only the process list and systemd are the
# host's alone.

PCI_DEVICES = "/sys/bus/pci/devices"
NVIDIA_VENDOR = "0x10de"
NVSWITCH_CLASS = "0x0680"  # bridge, other: "Bridge: NVIDIA Corporation GH100 [H100 NVSwitch]"
FABRICMANAGER_COMM = "nv-fabricmanag"  # /proc/PID/comm keeps 15 characters: "nv-fabricmanage"
FABRICMANAGER_SERVICE = "nvidia-fabricmanager"
FABRIC_STATES = ("Not Supported", "Not Started", "In Progress", "Completed", "N/A")


def fabric(devices: str = PCI_DEVICES, proc: str = "/proc") -> dict:
    """nvswitches: how many the PCI bus holds; fabricmanager: whether one runs (None: cannot be
    seen from here); fabric_states: nvidia-smi's [state, status] per GPU, where it says."""
    switches = nvswitch_count(devices)
    found: dict = {"nvswitches": switches, "fabricmanager": None, "fabric_states": None}
    if switches:
        found["fabricmanager"] = fabricmanager_running(proc)
        if shutil.which("nvidia-smi"):
            try:
                found["fabric_states"] = fabric_states(
                    _nvidia_smi("--query-gpu=fabric.state,fabric.status", "--format=csv,noheader")
                )
            except (OSError, subprocess.SubprocessError):
                pass
    return found


def nvswitch_count(devices: str = PCI_DEVICES) -> int:
    count = 0
    try:
        names = os.listdir(devices)
    except OSError:
        return 0
    for name in names:
        try:
            with open(os.path.join(devices, name, "vendor")) as vendor_file:
                vendor = vendor_file.read().strip().lower()
            with open(os.path.join(devices, name, "class")) as class_file:
                device_class = class_file.read().strip().lower()
        except OSError:
            continue
        count += vendor == NVIDIA_VENDOR and device_class.startswith(NVSWITCH_CLASS)
    return count


def fabricmanager_running(proc: str = "/proc") -> bool | None:
    """True when an nv-fabricmanager process is visible or systemd says the service is active;
    False when systemd (PID 1 here) says it is not; None when neither can be seen (a container
    shares neither the host's processes nor its systemd)."""
    try:
        pids = [name for name in os.listdir(proc) if name.isdigit()]
    except OSError:
        pids = []
    for pid in pids:
        try:
            with open(os.path.join(proc, pid, "comm")) as comm:
                if comm.read().strip().startswith(FABRICMANAGER_COMM):
                    return True
        except OSError:
            continue
    if os.path.isdir("/run/systemd/system") and shutil.which("systemctl"):
        try:
            state = subprocess.run(
                ["systemctl", "is-active", FABRICMANAGER_SERVICE],
                capture_output=True,
                text=True,
                timeout=10,
                check=False,
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None
        return state == "active"
    return None


def fabric_states(text: str) -> list[list[str]] | None:
    """nvidia-smi's 'STATE, STATUS' lines; None when it knows no such fields (older drivers)."""
    states = []
    for line in text.splitlines():
        parts = [part.strip().strip("[]") for part in line.split(",")]
        if len(parts) == 2 and parts[0] in FABRIC_STATES:
            states.append(parts)
    return states or None


_VERSION = re.compile(r"\d+\.\d+")


def _nvidia_smi(*args: str) -> str:
    return subprocess.run(
        ["nvidia-smi", *args], capture_output=True, text=True, timeout=20, check=False
    ).stdout


if __name__ == "__main__":
    sys.stdout.write(json.dumps(probe()) + "\n")
