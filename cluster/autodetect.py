"""`auto` in the inventory, found on the node itself: `compute_interface: auto` is the
interface that holds the host's compute_ip (`ip -o -4 addr show`), `gpus: auto` nvidia-smi's
count of GPUs (0 on a node without nvidia-smi).

The inventory's checks cannot know them: they leave such a value None in the Host
(cluster/inventory.py, Host.auto names the fields). This module is the one that finds them,
over one SSH round trip per node, all nodes at once, and once per command, before anything
uses the values:
- the launcher (launch/cli.py), before the job's processes are counted;
- netcheck (netcheck/preflight.py), in its first stage, where a value not found becomes a
  FAIL of that node rather than an error;
- provision's Python steps: `cluster image` (whether the image is CUDA's), `cluster lock`
  (provisioning's last step, which says what was found), and `cluster hostfile`.
Ansible's roles find the interface themselves, from the node's facts
(ansible/roles/static_ip/tasks/find_interface.yml).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch_multinode.cluster.errors import UserError, printable
from torch_multinode.cluster.inventory import Host, Inventory
from torch_multinode.cluster.inventory_checks import InventoryErrors

PROBE_TIMEOUT = 30.0
MARK = "@@autodetect"
# What the outputs that only read the inventory (make check-inventory) say of an auto value.
FOUND_AT_PROVISION = "found at provision"


@dataclass(frozen=True)
class Found:
    """What one node said of the values its inventory entry leaves to it."""

    host: str
    interface: str | None = None
    gpus: int | None = None
    gpus_from: str = ""
    """Where the count comes from: 'nvidia-smi', or 'no nvidia-smi' (0)."""
    error: UserError | None = None
    """Why a value the host needs was not found (exit 1); the others may still be."""
    remedy: str = ""
    """What to do about the error, said as netcheck says its remedies ("assign ...")."""

    def apply(self, host: Host) -> Host:
        """`host` with the values found in place of its None ones."""
        return replace(
            host,
            compute_interface=host.compute_interface if self.interface is None else self.interface,
            gpus=host.gpus if self.gpus is None else self.gpus,
        )


def wanted(host: Host) -> tuple[str, ...]:
    """The fields of `host` still to be found on it."""
    return tuple(
        field
        for field, value in (("compute_interface", host.compute_interface), ("gpus", host.gpus))
        if value is None
    )


def probe_command(host: Host) -> str:
    """The shell command whose output parse() reads: only what `host` leaves to the node."""
    fields = wanted(host)
    lines = [f"echo {MARK}", 'export LC_ALL=C PATH="$PATH:/usr/sbin:/sbin"']
    if "compute_interface" in fields:
        lines.append(f'echo {MARK} addresses; ip -o -4 addr show 2>&1; echo "{MARK} ip $?"')
    if "gpus" in fields:
        lines.append(
            f"echo {MARK} gpus; if command -v nvidia-smi >/dev/null 2>&1; then "
            "nvidia-smi --query-gpu=index --format=csv,noheader 2>&1; "
            f'echo "{MARK} nvidia-smi $?"; else echo "{MARK} nvidia-smi absent"; fi'
        )
    return "; ".join(lines)


def _sections(text: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    name = None
    for line in text.splitlines():
        if line.startswith(MARK):
            words = line[len(MARK) :].split()
            if len(words) == 1:
                name = words[0]
                found[name] = []
            elif len(words) == 2:
                found[f"{words[0]} exit"] = [words[1]]
                name = None
        elif name is not None:
            found[name].append(line)
    return found


def holders(lines: list[str]) -> dict[str, list[str]]:
    """`ip -o -4 addr show`'s lines as {interface: [address, ...]}, in its order."""
    found: dict[str, list[str]] = {}
    for line in lines:
        words = line.split()
        if len(words) >= 4 and words[2] == "inet":
            name = words[1].split("@", 1)[0]  # a veth's eth1@if12
            found.setdefault(name, []).append(words[3].split("/", 1)[0])
    return found


def parse(host: Host, text: str) -> Found:
    """The node's answer to probe_command(host)."""
    sections = _sections(text)
    fields = wanted(host)
    interface = gpus = None
    gpus_from = ""
    errors: list[str] = []
    hints: list[str] = []
    remedies: list[str] = []
    if "compute_interface" in fields:
        lines = sections.get("addresses", [])
        if sections.get("ip exit", ["?"])[0] != "0":
            said = next((line for line in reversed(lines) if line.strip()), "no output")
            errors.append(f"cannot list its addresses (ip -o -4 addr show: {printable(said)})")
            hints.append("installing iproute2 there")
            remedies.append("install iproute2")
        else:
            by_name = holders(lines)
            ip = str(host.compute_ip)
            interface = next(
                (name for name, ips in by_name.items() if ip in ips and name != "lo"), None
            )
            if interface is None:
                have = "; ".join(
                    f"{name} {', '.join(ips)}" for name, ips in by_name.items() if name != "lo"
                )
                errors.append(
                    f"compute_interface is auto, but no interface there holds its compute_ip "
                    f"{ip} (it has {printable(have) or 'no IPv4 address'})"
                )
                hints.append(f"assigning {ip} to the compute NIC, or compute_interface: NAME")
                remedies.append(
                    f"assign {ip} to the compute NIC (make provision does it), or set "
                    "compute_interface: NAME in the inventory"
                )
    if "gpus" in fields:
        lines = [line.strip() for line in sections.get("gpus", []) if line.strip()]
        status = sections.get("nvidia-smi exit", ["?"])[0]
        if status == "absent":
            gpus, gpus_from = 0, "no nvidia-smi"
        elif status == "0" and all(line.isdigit() for line in lines):
            gpus, gpus_from = len(lines), "nvidia-smi"
        else:
            said = lines[-1] if lines else f"exit {status}"
            errors.append(f"gpus is auto, but nvidia-smi fails there: {printable(said)}")
            hints.append("nvidia-smi working on the node (its driver), or gpus: N")
            remedies.append(
                "make nvidia-smi work (the NVIDIA driver), or set gpus: N in the inventory"
            )
    error = None
    if errors:
        error = UserError(
            f"host '{host.name}': {'; '.join(errors)}", hint=" and ".join(hints), exit_code=1
        )
    return Found(host.name, interface, gpus, gpus_from, error, "; ".join(remedies))


def find(nodes, hosts: list[Host] | tuple[Host, ...], timeout: float = PROBE_TIMEOUT):
    """Each of `hosts` with a value left to the node, asked at once (`nodes`: a
    cluster.execution.Nodes): {name: Found}. A node that does not answer is a Found with
    its error."""
    from torch_multinode.cluster.remote import on_all

    def ask(host: Host) -> Found:
        try:
            result = nodes.run(host, probe_command(host), timeout)
        except UserError as error:
            error = UserError(str(error), hint=error.hint, exit_code=1)
            return Found(host.name, error=error, remedy="check that the node is up")
        return parse(host, result.stdout)

    return on_all([host for host in hosts if wanted(host)], ask)


@dataclass(frozen=True)
class Resolved:
    """An inventory with its auto values found on the nodes (resolve)."""

    inventory: Inventory
    found: dict[str, Found]
    """What each node asked said."""
    spares: tuple[Host, ...] = ()
    """The spares asked too, with their values found."""
    dropped: tuple[Found, ...] = ()
    """The spares whose values were not found (their errors): left out."""

    def lines(self) -> list[str]:
        """One line per host whose entry says auto: what was found on it; one per spare left
        out, with why."""
        lines = []
        for host in (*self.inventory.hosts, *self.spares):
            if said := describe(host, self.found.get(host.name)):
                lines.append(f"found on the node (auto in the inventory): {said}")
        for answer in self.dropped:
            lines.append(f"spare {answer.host} left out: {answer.error}")
        return lines


def resolve(inventory: Inventory, nodes, spares: tuple[Host, ...] = ()) -> Resolved:
    """The inventory (and its `spares`) with every auto value found on its node, once, all
    nodes at once (`nodes`: a cluster.execution.Nodes). Raised where a host's value was not
    found (exit 1, one line per host); a spare's is left out instead."""
    found = find(nodes, (*inventory.unresolved, *(h for h in spares if wanted(h))))
    errors = [
        answer.error
        for host in inventory.hosts
        if (answer := found.get(host.name)) is not None and answer.error is not None
    ]
    if len(errors) == 1:
        raise errors[0]
    if errors:
        gathered = InventoryErrors(errors)
        gathered.exit_code = 1
        raise gathered
    dropped = tuple(
        found[h.name] for h in spares if h.name in found and found[h.name].error is not None
    )
    kept = tuple(
        found[h.name].apply(h) if h.name in found else h
        for h in spares
        if h.name not in {answer.host for answer in dropped}
    )
    hosts = tuple(found[h.name].apply(h) if h.name in found else h for h in inventory.hosts)
    return Resolved(replace(inventory, hosts=hosts), found, kept, dropped)


def describe(host: Host, found: Found | None = None) -> str:
    """How a host's auto values were found, for the output: "node1: compute_interface eth1
    (holds 10.9.0.11), gpus 0 (no nvidia-smi)"; '' where it has none."""
    parts = []
    if "compute_interface" in host.auto and host.compute_interface is not None:
        parts.append(f"compute_interface {host.compute_interface} (holds {host.compute_ip})")
    if "gpus" in host.auto and host.gpus is not None:
        source = f" ({found.gpus_from})" if found is not None and found.gpus_from else ""
        parts.append(f"gpus {host.gpus}{source}")
    return f"{host.name}: {', '.join(parts)}" if parts else ""


def shown(host: Host) -> tuple[str, str]:
    """A host's compute interface and GPUs as the outputs that never ask the node show them
    (make check-inventory): "auto, found at provision" and "auto (found at provision)" where
    the value is left to the node."""
    interface, gpus = host.compute_interface, host.gpus
    return (
        f"auto, {FOUND_AT_PROVISION}" if interface is None else interface,
        f"auto ({FOUND_AT_PROVISION})" if gpus is None else str(gpus),
    )
