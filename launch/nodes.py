"""Per-node decisions, made before anything starts: which GPUs and how many processes, which
backend for the whole job, what torchrun runs. The environment each node's ranks get is
launch/environment.py's."""

from __future__ import annotations

import re
from pathlib import Path

from torch_multinode.cluster.errors import UserError, printable
from torch_multinode.cluster.inventory import Host
from torch_multinode.launch.spec import (
    GPUS_PER_PROCESS,
    LEGACY_SHIM,
    JobSpec,
    job_module,
)
from torch_multinode.launch.staging import Project

_LOCAL_RANK_FLAG = re.compile(r"""["'](--local[-_]rank)["']""")


def visible_gpus(host: Host, spec: JobSpec) -> tuple[int, ...] | None:
    """The GPUs this node's job may use: the host's own selection from the inventory, else the
    job's GPUS. Checked against what the node has, before anything starts."""
    selected = host.visible_gpus if host.visible_gpus is not None else spec.gpus
    if selected is None:
        return None
    shown = ",".join(map(str, selected))
    if host.gpus == 0:
        raise UserError(
            f"GPUS={shown} but node '{host.name}' has no GPU (inventory gpus: 0)",
            hint="leaving GPUS unset on CPU nodes; NPROC= sets the process count",
        )
    missing = [index for index in selected if index >= host.gpu_count]
    if missing:
        raise UserError(
            f"GPUS={shown} asks for GPU {missing[0]}, but node '{host.name}' has {host.gpus} "
            f"GPU(s) (0-{host.gpu_count - 1})",
        )
    return selected


def gpus_per_process(spec: JobSpec) -> int:
    return GPUS_PER_PROCESS.get(spec.module, 1) if spec.script is None else 1


def nproc_for(host: Host, spec: JobSpec) -> int:
    """Processes on this node (see process_count)."""
    selected = visible_gpus(host, spec)
    gpus = len(selected) if selected is not None else host.gpu_count
    given = f"GPUS={','.join(map(str, selected))}" if selected else f"inventory gpus: {host.gpus}"
    return process_count(spec, gpus, f"node '{host.name}' has {gpus} for the job ({given})")


def process_count(spec: JobSpec, gpus: int, has: str, cpu_default: int = 1) -> int:
    """--nproc-per-node where given (checked against the `gpus` the job has there), else one
    process per GPU, or per pair for a workload that spans two (model parallel), or
    `cpu_default` without GPUs. Too few GPUs for even one process is refused: `has` says where
    and what."""
    per = gpus_per_process(spec)
    what = spec.module if spec.script is None else spec.script.name
    if spec.nproc_per_node is not None:
        if gpus and spec.nproc_per_node * per > gpus:
            raise UserError(
                f"NPROC={spec.nproc_per_node} (--nproc-per-node) of {what} needs "
                f"{spec.nproc_per_node * per} GPU(s), but {has}",
                hint=f"NPROC={max(1, gpus // per)}",
            )
        return spec.nproc_per_node
    if gpus == 0:
        return cpu_default
    if gpus < per:
        raise UserError(
            f"{what} spans {per} GPUs per process, but {has}",
            hint=f"machines with {per} GPUs, or GPUS= naming {per} of them; without GPUs "
            f"(gpus: 0) its stages run on the CPU",
        )
    return gpus // per


def job_backend(hosts: tuple[Host, ...]) -> tuple[str, str | None]:
    """One process group backend for the whole job, decided before launch: NCCL only when every
    node has GPUs, else gloo everywhere (with a note naming the nodes without). Ranks mixing
    the two would wait on each other until the timeout."""
    without = [h.name for h in hosts if h.gpus == 0]
    if not without:
        return "nccl", None
    if len(without) == len(hosts):
        return "gloo", None
    return "gloo", (
        f"note: {', '.join(without)} {'has' if len(without) == 1 else 'have'} no GPU (inventory "
        f"gpus: 0), so the whole job runs on the CPU with gloo: NCCL needs GPUs on every node"
    )


def gpu_problem(host: Host, spec: JobSpec, answer: str, ok: bool) -> str | None:
    """Why this node's GPUs cannot take an NCCL job (from GPU_PROBE's answer), or None."""
    selected = visible_gpus(host, spec)
    needed = (max(selected) + 1) if selected else host.gpu_count
    indices = [line.strip() for line in answer.splitlines() if line.strip().isdigit()]
    if ok and len(indices) >= needed:
        return None
    said = answer.strip().splitlines()[-1:] if answer.strip() else []
    reason = (
        f"nvidia-smi lists {len(indices)} GPU(s), the job needs {needed}"
        if ok
        else f"nvidia-smi failed: {printable(said[0]) if said else 'no output'}"
    )
    return (
        f"on {host.name}: its GPUs do not answer ({reason}); an NCCL job cannot start there "
        f"(try nvidia-smi on {host.name}: load or reinstall the NVIDIA driver (a reboot after a "
        f"kernel update), or set gpus: 0 for it in the inventory)"
    )


def legacy_flag(script: Path) -> str | None:
    """The --local_rank / --local-rank flag a torch.distributed.launch-era script parses, if
    any (the dashed spelling wins when both are declared, as the old launcher passed it)."""
    try:
        found = set(_LOCAL_RANK_FLAG.findall(script.read_text(errors="replace")))
    except OSError:
        return None
    if not found:
        return None
    return "--local-rank" if "--local-rank" in found else "--local_rank"


def entry_point(spec: JobSpec, where: Project | str) -> list[str]:
    """What torchrun runs: the module, or the script where it is on the node (in its project,
    or, without one, in directory `where`)."""
    if spec.script is None:
        return ["-m", job_module(spec)]
    script = where.script if isinstance(where, Project) else f"{where}/{spec.script.name}"
    assert script is not None  # a project planned for a script has its path (staging.plan)
    if spec.local_rank_flag:
        return ["-m", LEGACY_SHIM, f"--flag={spec.local_rank_flag}", script]
    return [script]


def rank_order_warning(hosts: tuple[Host, ...]) -> str | None:
    """c10d numbers nodes by the sorted string of their address: say so when that is not the
    inventory's order, rather than let the user think rank 0 runs on the first host."""
    by_address = sorted(hosts, key=lambda h: str(h.compute_ip))
    if [h.name for h in by_address] == [h.name for h in hosts]:
        return None
    order = ", ".join(f"{h.name} ({h.compute_ip})" for h in by_address)
    return (
        f"note: c10d numbers nodes by compute IP, so node ranks follow {order}; the rendezvous "
        f"store stays on {hosts[0].name}"
    )


def local_gpu_count(root: Path = Path("/")) -> int:
    """torch's count of this machine's GPUs; 0 at once, without torch's import (seconds of
    CPU), where this machine shows no sign of an NVIDIA GPU, as most machines running a local
    job do."""
    if not signs_of_an_nvidia_gpu(root):
        return 0
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # a broken CUDA setup means: run on the CPU
        return 0


def signs_of_an_nvidia_gpu(root: Path) -> bool:
    """NVIDIA's device files or driver (WSL's /dev/dxg included), or an NVIDIA display or 3D
    controller on the PCI bus (vendor 0x10de, class 0x03...). The bus counts because on a
    machine without X the device files appear only when a first CUDA program creates them
    (nvidia-modprobe), which the count itself may be."""
    dev = root / "dev"
    if any(dev.glob("nvidia[0-9]*")) or (dev / "dxg").exists():
        return True
    if (root / "proc/driver/nvidia").exists():
        return True
    for device in (root / "sys/bus/pci/devices").glob("*"):
        try:
            vendor = (device / "vendor").read_text().strip()
            kind = (device / "class").read_text().strip()
        except OSError:
            continue
        if vendor == "0x10de" and kind.startswith("0x03"):
            return True
    return False
