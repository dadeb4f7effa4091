"""The version lock: what each node ran when netcheck last passed (its kernel, NVIDIA driver,
Docker engine, and the training image's ID and the torch, CUDA and NCCL its labels record, or
in host mode the torch, CUDA and NCCL of its training interpreter), kept beside the inventory,
so that `make train` can refuse a node that changed since (an unattended upgrade, a
hand-installed package, another image under the tag).

    {"nodes": {"node1": {"kernel": "6.1.0-18-amd64", "driver": "none", "docker": "27.3.1",
                         "image": "sha256:...", "torch": "2.14.1+cu130", "cuda": "13.0",
                         "nccl": "2.30.7"}, ...},
     "written_at": "2026-11-26T12:00:00+00:00"}

One probe per node, a shell command of cheap reads (no torch import, no GPU touched): netcheck
runs it to write the lock, the launcher runs the same one on every node, in parallel with its
other checks, to compare (launch.prepare).
"""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Callable
from pathlib import Path

from torch_multinode.cluster import files
from torch_multinode.cluster.errors import UserError
from torch_multinode.cluster.execution import Nodes
from torch_multinode.cluster.inventory import Host, Inventory
from torch_multinode.cluster.versions import STACK_LABELS

FILENAME = "versions.lock.json"
FIELDS = ("kernel", "driver", "docker", "image", "torch", "cuda", "nccl")
"""In the order a drift is told."""
STACK = tuple(STACK_LABELS)  # torch, CUDA, NCCL: in container mode the image's labels
NAMES = {
    "kernel": "kernel",
    "driver": "NVIDIA driver",
    "docker": "Docker engine",
    "image": "training image",
    "torch": "torch",
    "cuda": "CUDA",
    "nccl": "NCCL",
}

# The interpreter's torch (its version.py read as text: torch is not imported, the CUDA it
# was built for with it) and its NCCL wheel's version.
_HOST_VERSIONS = """\
import importlib.metadata as m, importlib.util as u, os, re
found = u.find_spec("torch")
text = ""
if found is not None and found.submodule_search_locations:
    with open(os.path.join(found.submodule_search_locations[0], "version.py")) as f:
        text = f.read()
def field(name):
    hit = re.search(r"^" + name + r"\\b[^=\\n]*=\\s*'([^']*)'", text, re.M)
    return hit.group(1) if hit else "none"
print("torch=" + field("__version__"))
print("cuda=" + field("cuda"))
def wheel(*names):
    for name in names:
        try:
            return m.version(name)
        except m.PackageNotFoundError:
            pass
    return "none"
print("nccl=" + wheel("nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11"))
"""


def default_path(inventory_path: str | os.PathLike) -> Path:
    """Beside the inventory file (inside an inventory directory), as netcheck's env file."""
    return files.beside_inventory(inventory_path, FILENAME)


def probe_command(host: Host, inventory: Inventory) -> str:
    """The shell command printing this node's `field=value` lines."""
    lines = [
        'echo "kernel=$(uname -r)"',
        'echo "driver=$(cat /sys/module/nvidia/version 2>/dev/null || echo none)"',
        'if command -v docker >/dev/null 2>&1; then echo "docker=$(docker version --format '
        "'{{.Server.Version}}' 2>/dev/null || echo unknown)\"; else echo docker=none; fi",
    ]
    if inventory.launch_mode == "container":
        # The image's ID, then its torch, CUDA and NCCL labels, each "unknown" where it has none.
        labels = " ".join(
            f'{{{{or (index . "{STACK_LABELS[field]}") "unknown"}}}}' for field in STACK
        )
        template = f"{{{{.Id}}}} {{{{with .Config.Labels}}}}{labels}{{{{end}}}}"
        image = shlex.quote(inventory.training_image)
        lines.append(
            f"set -- $(docker image inspect --format {shlex.quote(template)} {image} "
            '2>/dev/null || echo missing); echo "image=$1"; echo "torch=${2:-unknown}"; '
            'echo "cuda=${3:-unknown}"; echo "nccl=${4:-unknown}"'
        )
    else:
        lines.append(
            f"{shlex.quote(host.python)} -c {shlex.quote(_HOST_VERSIONS)} 2>/dev/null "
            "|| { echo torch=none; echo cuda=none; echo nccl=none; }"
        )
    return "; ".join(lines)


def parse(text: str) -> dict[str, str]:
    """The probe's answer as {field: value}; lines that are no `field=value` of ours ignored."""
    found = {}
    for line in text.splitlines():
        name, eq, value = line.strip().partition("=")
        if eq and name in FIELDS:
            found[name] = value.strip() or "unknown"
    return found


def write(path: str | os.PathLike, nodes: dict[str, dict[str, str]]) -> Path:
    """These nodes' versions into the lock, replacing theirs and keeping other nodes' (a check
    of NNODES=2 of 3 leaves the third as it was), atomically."""
    return files.write_nodes(
        path,
        {**(load(path) or {}), **nodes},
        "version lock",
        hint="making the inventory's directory writable",
    )


def lock_nodes(inventory: Inventory, nodes: Nodes) -> Path:
    """Each node of the (narrowed) inventory probed, all at once, and its versions written into
    the lock beside the inventory: what netcheck does once it passes, and make provision last;
    the lock's path."""
    from torch_multinode.cluster.remote import on_all

    def probe(host: Host) -> dict[str, str]:
        return parse(nodes.run(host, probe_command(host, inventory), 60).stdout)

    return write(default_path(inventory.path), on_all(list(inventory.hosts), probe))


def load(path: str | os.PathLike) -> dict[str, dict[str, str]] | None:
    """Each node's locked versions; None when there is no lock (netcheck never passed here) or
    it cannot be read as one."""
    try:
        document = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    nodes = document.get("nodes") if isinstance(document, dict) else None
    if not isinstance(nodes, dict):
        return None
    return {
        name: {k: v for k, v in fields.items() if k in FIELDS and isinstance(v, str)}
        for name, fields in nodes.items()
        if isinstance(name, str) and isinstance(fields, dict)
    }


def image_shipped(
    inventory_path: str | os.PathLike,
    names: list[str],
    image_id: str,
    stack: Callable[[], dict[str, str]],
) -> None:
    """`make ship` brought the training image `image_id` to these nodes: the lock (if netcheck
    wrote one) expects it there from now on, with the torch, CUDA and NCCL its labels record
    (`stack()`, asked only when there is a lock). Nodes the lock does not hold stay out of it:
    netcheck locks a node whole."""
    path = default_path(inventory_path)
    nodes = load(path)
    if not nodes:
        return
    names = [n for n in names if n in nodes]
    if names:
        labels = {field: value for field, value in stack().items() if field in STACK}
        shipped = {n: {**nodes[n], "image": image_id, **labels} for n in names}
        write(path, shipped)


def _shown(field: str, value: str) -> str:
    return value[7:19] if field == "image" and value.startswith("sha256:") else value


def drift(locked: dict[str, str], found: dict[str, str]) -> list[str]:
    """What changed on one node since the lock, as `what from X to Y` (empty: nothing)."""
    return [
        f"{NAMES[f]} from {_shown(f, locked[f])} to {_shown(f, found.get(f, 'unknown'))}"
        for f in FIELDS
        if f in locked and found.get(f, "unknown") != locked[f]
    ]


def refusal(host: Host, inventory: Inventory, changes: list[str]) -> UserError:
    """The error for a node that drifted: which node, what changed from what to what, and the
    two ways out."""
    return UserError(
        f"{host.name} changed since netcheck passed: {'; '.join(changes)} "
        f"(locked in {default_path(inventory.path)})",
        hint=f"make netcheck INVENTORY={inventory.path} to accept its new state, or make "
        f"provision INVENTORY={inventory.path} to put it back; ALLOW_DRIFT=1 runs this job anyway",
        exit_code=1,
    )
