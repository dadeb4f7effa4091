"""software: the training stack on each node, from the software probe (netcheck.softprobe, or
the collective's workers). Python, torch, CUDA and NCCL alike on every node; torch new enough,
the NVIDIA driver new enough for its CUDA, its kernels able to run on the GPUs, the fabric
manager on NVSwitch nodes, the GPU count, /dev/shm and memlock. No I/O here.
"""

from __future__ import annotations

from torch_multinode.cluster.execution import Context, HostContext
from torch_multinode.cluster.inventory import Host
from torch_multinode.cluster.versions import (
    driver_needed,
    gpu_runs,
    minimum_shown,
    oldest_capability,
    release,
    torch_meets_minimum,
)
from torch_multinode.netcheck.checks import Collector, reference
from torch_multinode.netcheck.report import Finding, Status

SHM_MIN_CPU = 64 << 20
SHM_MIN_GPU = 1 << 30
SOFTWARE_FIELDS = (("python", "Python"), ("torch", "torch"), ("cuda", "CUDA"), ("nccl", "NCCL"))


# --- 6. software ----------------------------------------------------------------------------


def software_findings(
    hosts: list[Host], probes: dict[str, dict | str], master: Host, context: Context | None = None
) -> list[Finding]:
    """`probes`: node -> the software probe's JSON, or the error that stopped it."""
    context = context or HostContext()
    container = context.name == "container"
    out = Collector("software")
    by_name = {h.name: h for h in hosts}
    good: dict[str, dict] = {}
    for node, probe in probes.items():
        where = context.where(by_name[node])
        if container:
            install = f"on {node}: rebuild or reload {where} there (make provision)"
        else:
            install = f"on {node}: install it for {where} (make provision)"
        if isinstance(probe, str):
            if container:
                remedy = f"on {node}: check that docker runs {where} there (docker image ls)"
            else:
                remedy = f"on {node}: check training_python ({where}) in the inventory"
            out.add(node, Status.FAIL, f"{where} did not answer: {probe}", remedy)
            continue
        if "torch_error" in probe:
            out.add(
                node,
                Status.FAIL,
                f"torch does not import in {where}: {probe['torch_error']}",
                install,
            )
            continue
        good[node] = probe
        torch = probe.get("torch") or "none"
        if not torch_meets_minimum(torch):
            fix = (
                f"on {node}: make image (it installs the pinned torch), then make provision"
                if container
                else f"on {node}: install the pinned torch for {where} (make provision)"
            )
            out.add(
                node,
                Status.FAIL,
                f"torch {torch} in {where} on {node} is older than the {minimum_shown()} this "
                f"project needs",
                fix,
            )
        needed, driver = driver_needed(probe.get("cuda")), probe.get("driver")
        if needed and driver and release(driver) and release(driver)[0] < needed:
            # Where torch still answers, CUDA's forward-compatibility libraries carry it (NGC's
            # images bring them for data-center GPUs): jobs run, so a warning.
            works = bool(probe.get("cuda_available"))
            out.add(
                node,
                Status.WARN if works else Status.FAIL,
                f"NVIDIA driver {driver} on {node} is older than torch's CUDA "
                f"{probe.get('cuda')} needs (branch {needed} or newer)"
                + (" (CUDA answers, through forward-compatibility libraries)" if works else ""),
                f"on {node}: install driver branch {needed} or newer (nvidia_driver_install: "
                f'true, nvidia_driver_branch: "{needed}" in the inventory; make provision; '
                f"reboot)",
            )
        fabric = fabric_manager_problem(node, probe)
        if fabric:
            out.add(node, Status.FAIL, *fabric)
        archs = probe.get("cuda_archs")
        unable = [
            f"GPU {index} ({name}, compute capability {capability})"
            for index, (name, capability) in enumerate(probe.get("gpu_capabilities") or [])
            if archs and not gpu_runs(archs, capability)
        ]
        if unable:
            assert archs  # a GPU is unable only against the architectures torch lists
            oldest = oldest_capability(archs)
            out.add(
                node,
                Status.FAIL,
                f"{', '.join(unable)} on {node} cannot run torch {torch} in {where}: its "
                f"kernels are built for compute capability {oldest} and newer ({archs})",
                f"on {node}: GPUs of compute capability {oldest} or newer (CUDA 13 builds of "
                f"torch dropped Volta, Pascal and Maxwell), or gpus: 0 for that node in the "
                f"inventory (it then trains on its CPU, and so does the whole job)",
            )
        if not probe.get("netcheck"):
            out.add(node, Status.FAIL, f"netcheck is not importable in {where}", install)
        if not probe.get("gloo"):
            out.add(node, Status.FAIL, f"torch in {where} has no gloo backend", install)
        want = by_name[node].gpu_count
        seen = probe.get("gpus", 0)
        smi = probe.get("nvidia_smi_gpus")
        if seen != want:
            extra = f", nvidia-smi lists {smi}" if smi is not None else ""
            out.add(
                node,
                Status.FAIL,
                f"torch sees {seen} GPU(s) on {node}{extra}, the inventory says {want}",
                f"on {node}: check the NVIDIA driver (nvidia-smi) and CUDA_VISIBLE_DEVICES, or "
                f"set gpus: {seen} in the inventory",
            )
        shm = probe.get("shm_bytes")
        need = SHM_MIN_GPU if want else SHM_MIN_CPU
        if shm is not None and shm < need:
            status = Status.FAIL if want >= 2 else Status.WARN
            out.add(
                node,
                status,
                f"/dev/shm is {shm >> 20} MiB ({context.name} mode), below {need >> 20} MiB",
                f"on {node}: enlarge /dev/shm (mount -o remount,size=1G /dev/shm; jobs share "
                f"the host's through --ipc host)",
            )
        memlock = probe.get("memlock_bytes")
        if probe.get("infiniband") and memlock not in (-1, None):
            out.add(
                node,
                Status.FAIL,
                f"memlock limit is {memlock >> 10} KiB ({context.name} mode); InfiniBand "
                f"needs unlimited",
                f"on {node}: set memlock unlimited (ulimit -l unlimited in "
                f"/etc/security/limits.d, docker run --ulimit memlock=-1)",
            )
    for key, label in SOFTWARE_FIELDS:
        values = {n: p.get(key) for n, p in good.items()}
        if len(set(values.values())) <= 1:
            continue
        common = reference(values, master.name)
        holders = ", ".join(sorted(n for n, v in values.items() if v == common))
        for node, value in values.items():
            if value != common:
                out.add(
                    node,
                    Status.FAIL,
                    f"{label} {value or 'none'} on {node}, {common or 'none'} on {holders}",
                    f"on {node}: install {label} {common} in {context.where(by_name[node])} "
                    f"(as on {holders})",
                )
    passed = {}
    for node, p in good.items():
        memlock = (
            "unlimited"
            if p.get("memlock_bytes") == -1
            else f"{(p.get('memlock_bytes') or 0) >> 10} KiB"
        )
        driver = f", driver {p['driver']}" if p.get("driver") else ""
        passed[node] = (
            f"Python {p.get('python')}, torch {p.get('torch')}, CUDA {p.get('cuda')}, "
            f"NCCL {p.get('nccl')}, {p.get('gpus', 0)} GPU(s){driver}, /dev/shm "
            f"{(p.get('shm_bytes') or 0) >> 20} MiB, memlock {memlock}"
        )
    return out.done([h.name for h in hosts], passed)


FABRIC_WAITING = ("Not Started", "In Progress")


def fabric_manager_problem(node: str, probe: dict) -> tuple[str, str] | None:
    """(detail, remedy) for an NVSwitch node whose fabric manager is not running, or None.

    The probe's `nvswitches` (PCI bus), `fabricmanager` (process or systemd; None where the
    probe cannot see them, as in a container) and `fabric_states` (nvidia-smi's per-GPU fabric
    registration) decide; without a running fabric manager those GPUs never initialise."""
    switches = probe.get("nvswitches") or 0
    if not switches:
        return None
    states = probe.get("fabric_states") or []
    waiting = [f"GPU {i} {state}" for i, (state, _) in enumerate(states) if state in FABRIC_WAITING]
    # NVML: the status means something once the state is Completed; anything but Success (or
    # N/A) there is a registration that failed ("Insufficient Resources" on H100s).
    failed = [
        f"GPU {i} {status}"
        for i, (state, status) in enumerate(states)
        if state == "Completed" and status not in ("Success", "N/A", "")
    ]
    # Every GPU registered: a fabric manager ran, whatever the probe saw of its process.
    registered = bool(states) and not waiting and not failed
    smi = probe.get("nvidia_smi_gpus")
    driver = probe.get("driver") or ""
    if failed:
        return (
            f"{node} has {switches} NVSwitch(es) but the GPUs' fabric registration failed "
            f"({', '.join(failed)}): NCCL cannot use NVLink across them",
            f"on {node}: journalctl -u nvidia-fabricmanager says why (a fabric manager of "
            f"another version than the driver{f' ({driver})' if driver else ''}, or an NVLink "
            "fault); then systemctl restart nvidia-fabricmanager, or reboot",
        )
    if probe.get("fabricmanager") is False and not registered:
        why = "no fabric manager runs (nv-fabricmanager; systemd: nvidia-fabricmanager inactive)"
    elif waiting:
        why = f"the GPUs' fabric registration is not complete ({', '.join(waiting)})"
    elif probe.get("fabricmanager") is None and smi and not probe.get("gpus"):
        why = f"torch sees none of the {smi} GPU(s) nvidia-smi lists (is nvidia-fabricmanager running?)"
    else:
        return None
    branch = release(driver)[0] if release(driver) else None
    package = f"nvidia-fabricmanager-{branch}" if branch else "nvidia-fabricmanager"
    return (
        f"{node} has {switches} NVSwitch(es) but {why}: its GPUs stay uninitialised (CUDA "
        f"error 802, system not yet initialized)",
        f"on {node}: make provision with nvidia_driver_install: true (it installs and starts the "
        f"fabric manager of the driver's branch), or install {package} of the driver's exact "
        f"version{f' ({driver})' if driver else ''} and start it (systemctl enable --now "
        f"nvidia-fabricmanager)",
    )
