"""What one SSH round trip learns about a node: names, interfaces, routes, pings to its peers.

`script()` builds one POSIX shell script of standard tools (hostname, getent, ip -j, ping,
/sys); its output is a series of `@@section` blocks that `parse()` turns into NodeFacts. Every
parser here works on text, so the unit tests feed it captured output.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field

from torch_multinode.cluster.inventory import Host

PING_COUNT = 5
PING_DEADLINE = 3  # seconds: ping stops then, answered or not
MARK = "@@"


@dataclass(frozen=True)
class Ping:
    transmitted: int
    received: int
    loss: float
    """Percent, as ping prints it."""
    rtt_avg_ms: float | None
    error: str | None = None
    rtt_min_ms: float | None = None
    """The fastest reply: the path's own latency, which a busy CPU at either end adds less to
    than to the average."""


@dataclass(frozen=True)
class Route:
    dev: str | None
    source: str | None
    error: str | None = None


@dataclass(frozen=True)
class Interface:
    name: str
    flags: tuple[str, ...]
    operstate: str
    mtu: int
    addresses: tuple[str, ...]

    @property
    def up(self) -> bool:
        return "UP" in self.flags

    @property
    def running(self) -> bool:
        return "LOWER_UP" in self.flags and "NO-CARRIER" not in self.flags


@dataclass
class NodeFacts:
    hostname: str = ""
    fqdn: str = ""
    resolved: dict[str, list[str]] = field(default_factory=dict)
    """Name (inventory names, own hostname, FQDN, rendezvous address) -> IPv4s, in order."""
    interfaces: dict[str, Interface] = field(default_factory=dict)
    routes: dict[str, Route] = field(default_factory=dict)
    """Peer compute IP -> the route the kernel picks for it."""
    pings: dict[str, Ping] = field(default_factory=dict)
    """Peer name -> ping result."""
    speed_mbps: int | None = None
    physical: bool = False
    """The compute interface is a NIC (/sys/class/net/IF/device), not a virtual one."""
    rated_mbps: int | None = None
    """The fastest link mode the NIC supports (ethtool's "Supported link modes"), where it says."""
    infiniband: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


OWN = "own hostname"
FQDN = "own FQDN"


def script(host: Host, hosts: list[Host], rendezvous: str) -> str:
    """The shell script run on `host`; `hosts` are all nodes checked (including `host`)."""
    q = shlex.quote
    peers = [h for h in hosts if h.name != host.name]
    assert host.compute_interface is not None  # found on the node (the ssh stage) before this
    iface = q(host.compute_interface)
    lines = [
        "export LC_ALL=C",
        "t=$(mktemp -d /tmp/netcheck-facts.XXXXXX) || exit 1",
        "s() { printf '\\n%s%s\\n' '" + MARK + '\' "$1"; }',
    ]
    # Pings run in the background while the rest is gathered: one round trip covers both.
    for peer in peers:
        lines.append(
            f"ping -n -q -c {PING_COUNT} -i 0.2 -W 1 -w {PING_DEADLINE} {q(str(peer.compute_ip))}"
            f' > "$t/{peer.name}" 2>&1 &'
        )
    lines += [
        "s hostname; hostname",
        "s fqdn; hostname -f 2>/dev/null",
        f's {q("resolve " + OWN)}; getent ahostsv4 "$(hostname)"',
        f's {q("resolve " + FQDN)}; getent ahostsv4 "$(hostname -f 2>/dev/null || hostname)"',
    ]
    names = [h.name for h in hosts] + (
        [rendezvous] if rendezvous not in [h.name for h in hosts] else []
    )
    for name in names:
        lines.append(f"s {q('resolve ' + name)}; getent ahostsv4 {q(name)}")
    lines.append("s links; ip -j addr show 2>&1")
    for peer in peers:
        ip = q(str(peer.compute_ip))
        lines.append(f"s {q('route ' + str(peer.compute_ip))}; ip -j route get {ip} 2>&1")
    lines += [
        f"s speed; cat /sys/class/net/{iface}/speed 2>/dev/null",
        # A NIC's own: its supported modes (ethtool, where installed; a virtual one has none).
        f"s device; [ -e /sys/class/net/{iface}/device ] && echo physical"
        f" && {{ ethtool {iface} 2>/dev/null || /sbin/ethtool {iface} 2>/dev/null; }}",
        "s infiniband; ls -1 /sys/class/infiniband 2>/dev/null",
        "wait",
    ]
    for peer in peers:
        lines.append(f's {q("ping " + peer.name)}; cat "$t/{peer.name}"')
    lines += ['rm -rf "$t"', "exit 0"]
    return "\n".join(lines) + "\n"


def sections(text: str) -> dict[str, str]:
    found: dict[str, str] = {}
    name = None
    body: list[str] = []
    for line in text.splitlines():
        if line.startswith(MARK):
            if name is not None:
                found[name] = "\n".join(body).strip()
            name, body = line[len(MARK) :].strip(), []
        elif name is not None:
            body.append(line)
    if name is not None:
        found[name] = "\n".join(body).strip()
    return found


def parse(text: str) -> NodeFacts:
    facts = NodeFacts()
    for name, body in sections(text).items():
        kind, _, arg = name.partition(" ")
        if kind == "hostname":
            facts.hostname = body.strip()
        elif kind == "fqdn":
            facts.fqdn = body.strip()
        elif kind == "resolve":
            facts.resolved[arg] = parse_getent(body)
        elif kind == "links":
            try:
                facts.interfaces = parse_links(body)
            except ValueError as exc:
                facts.errors.append(f"ip -j addr show: {exc}")
        elif kind == "route":
            facts.routes[arg] = parse_route(body)
        elif kind == "speed":
            facts.speed_mbps = parse_speed(body)
        elif kind == "device":
            facts.physical = body.startswith("physical")
            facts.rated_mbps = parse_rated(body)
        elif kind == "infiniband":
            facts.infiniband = [line for line in body.split() if line]
        elif kind == "ping":
            facts.pings[arg] = parse_ping(body)
    return facts


def parse_getent(text: str) -> list[str]:
    """`getent ahostsv4 NAME` -> unique addresses in the order the resolver returns them."""
    found: list[str] = []
    for line in text.splitlines():
        parts = line.split()
        if parts and re.fullmatch(r"\d+\.\d+\.\d+\.\d+", parts[0]) and parts[0] not in found:
            found.append(parts[0])
    return found


def parse_links(text: str) -> dict[str, Interface]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        first = text.strip().splitlines()[:1] or ["no output"]
        raise ValueError(f"not JSON: {first[0]}") from None
    interfaces = {}
    for item in data:
        name = item.get("ifname")
        if not name:
            continue
        addresses = tuple(
            a["local"]
            for a in item.get("addr_info", [])
            if a.get("family") == "inet" and "local" in a
        )
        interfaces[name] = Interface(
            name=name,
            flags=tuple(item.get("flags", [])),
            operstate=str(item.get("operstate", "UNKNOWN")),
            mtu=int(item.get("mtu", 0)),
            addresses=addresses,
        )
    return interfaces


def parse_route(text: str) -> Route:
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        first = text.strip().splitlines()[:1] or ["no output"]
        return Route(None, None, error=first[0])
    if not data:
        return Route(None, None, error="no route")
    return Route(data[0].get("dev"), data[0].get("prefsrc"))


def parse_speed(text: str) -> int | None:
    """/sys/class/net/IF/speed in Mb/s; -1 or nothing (virtual NICs, link down) is unknown."""
    try:
        value = int(text.strip())
    except ValueError:
        return None
    return value if value > 0 else None


_LINK_MODE = re.compile(r"\b(\d+)base[A-Za-z0-9]*(?:/(?:Full|Half))?")
_ETHTOOL_KEY = re.compile(r"^\s*[A-Z][A-Za-z -]*:")


def parse_rated(text: str) -> int | None:
    """The fastest of ethtool's "Supported link modes" in Mb/s (1000baseT/Full: 1000); None
    where ethtool is missing or reports none (virtual NICs: "Not reported")."""
    speeds: list[int] = []
    within = False
    for line in text.splitlines():
        if _ETHTOOL_KEY.match(line):
            within = line.strip().startswith("Supported link modes:")
            line = line.split(":", 1)[1] if within else ""
        if within:
            speeds += [int(found) for found in _LINK_MODE.findall(line)]
    return max(speeds) if speeds else None


_STATS = re.compile(
    r"(\d+) packets transmitted, (\d+) (?:packets )?received.*?([\d.]+)% packet loss"
)
_RTT = re.compile(r"= ([\d.]+)/([\d.]+)/[\d.]+")


def parse_ping(text: str) -> Ping:
    stats = _STATS.search(text)
    if not stats:
        first = text.strip().splitlines()[:1] or ["no output"]
        return Ping(0, 0, 100.0, None, error=first[0])
    rtt = _RTT.search(text)
    return Ping(
        int(stats.group(1)),
        int(stats.group(2)),
        float(stats.group(3)),
        float(rtt.group(2)) if rtt else None,
        rtt_min_ms=float(rtt.group(1)) if rtt else None,
    )
