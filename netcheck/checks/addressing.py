"""names and interfaces: is each node's compute address where the inventory says, and named so
everywhere. Interfaces, addresses, routes, MTU and link speed on each node, and how every node
resolves every node's name and the rendezvous address. No I/O here.

The interfaces verdict (InterfaceVerdict) also says which nodes are broken, whom the ping and
ports checks then blame, and the socket variables netcheck's env file gives each node.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from torch_multinode.cluster.inventory import Host
from torch_multinode.cluster.nccl_transport import hcas_named
from torch_multinode.netcheck import envfile
from torch_multinode.netcheck.checks import Collector, reference
from torch_multinode.netcheck.facts import FQDN, OWN, NodeFacts
from torch_multinode.netcheck.report import Finding, Status


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.IPv4Address(address).is_loopback
    except ValueError:
        return False


# --- 3. names -------------------------------------------------------------------------------


def name_findings(
    hosts: list[Host], facts: dict[str, NodeFacts], rendezvous: str, master: Host
) -> list[Finding]:
    out = Collector("names")
    by_name = {h.name: h for h in hosts}
    for node, f in facts.items():
        me = by_name[node]
        for host in hosts:
            addresses = f.resolved.get(host.name, [])
            want = str(host.compute_ip)
            line = f"'{want} {host.name}'"
            if not addresses:
                out.add(
                    node,
                    Status.FAIL,
                    f"{node} cannot resolve {host.name}",
                    f"on {node}: add {line} to /etc/hosts (provisioning does this)",
                )
            elif host.name == node and any(_is_loopback(a) for a in addresses):
                loop = next(a for a in addresses if _is_loopback(a))
                out.add(
                    node,
                    Status.FAIL,
                    f"{node} resolves its own name {node} to {loop}",
                    f"on {node}: in /etc/hosts map {node} to {want}, not {loop} "
                    f"(change or remove the {loop} line)",
                )
            elif addresses[0] != want:
                out.add(
                    node,
                    Status.FAIL,
                    f"{node} resolves {host.name} to {', '.join(addresses)}, not its compute "
                    f"IP {want}",
                    f"on {node}: make /etc/hosts say {line} (and no other address for {host.name})",
                )
        for label, name in ((OWN, f.hostname), (FQDN, f.fqdn)):
            addresses = f.resolved.get(label, [])
            loops = [a for a in addresses if _is_loopback(a)]
            if label == FQDN and name == f.hostname:
                continue  # the same name, already judged as the hostname
            if loops and name != node:  # the inventory name was reported above
                out.add(
                    node,
                    Status.FAIL,
                    f"{node}'s {label} {name!r} resolves to {loops[0]}",
                    f"on {node}: in /etc/hosts map {name} to {me.compute_ip}, not {loops[0]}",
                )
        if f.hostname and f.hostname.split(".")[0] != node:
            out.add(
                node,
                Status.WARN,
                f"{node}'s hostname is {f.hostname!r}, the inventory calls it {node}",
                f"on {node}: hostnamectl set-hostname {node}",
            )
        rdzv = f.resolved.get(rendezvous, [])
        if not rdzv:
            out.add(
                node,
                Status.FAIL,
                f"{node} cannot resolve the rendezvous address {rendezvous}",
                f"on {node}: add '{master.compute_ip} {rendezvous}' to /etc/hosts",
            )
        elif rdzv[0] != str(master.compute_ip):
            out.add(
                node,
                Status.FAIL,
                f"{node} resolves the rendezvous address {rendezvous} to {rdzv[0]}, not "
                f"{master.name}'s compute IP {master.compute_ip}",
                f"on {node}: make {rendezvous} resolve to {master.compute_ip} in /etc/hosts",
            )
    passed = {
        n: f"resolves all {len(hosts)} node name(s) to compute IPs, own name not loopback"
        for n in facts
    }
    return out.done([h.name for h in hosts], passed)


# --- 5. interfaces (before ports: their verdict decides whom to blame) ----------------------


@dataclass
class InterfaceVerdict:
    findings: list[Finding]
    broken: set[str]
    """Nodes whose own compute interface or route is wrong: traffic cannot use it."""
    env: dict[str, dict[str, str]]
    speeds: dict[str, int | None]


def socket_env(interface: str, infiniband: list[str], ib_hca: str | None = None) -> dict[str, str]:
    """What NCCL and gloo need to use exactly the compute interface on one node, and the RDMA
    devices the inventory names for training (nccl_ib_hca) where the node has any."""
    env = {"NCCL_SOCKET_IFNAME": f"={interface}", "GLOO_SOCKET_IFNAME": interface}
    if not infiniband:
        env["NCCL_IB_DISABLE"] = "1"
    elif ib_hca:
        env["NCCL_IB_HCA"] = ib_hca
    return env


def interface_findings(
    hosts: list[Host], facts: dict[str, NodeFacts], master: Host
) -> InterfaceVerdict:
    out = Collector("interfaces")
    by_name = {h.name: h for h in hosts}
    broken: set[str] = set()
    env: dict[str, dict[str, str]] = {}
    speeds: dict[str, int | None] = {}
    mtus: dict[str, int] = {}
    names: dict[str, str] = {}
    passed: dict[str, str] = {}
    for node, f in facts.items():
        me = by_name[node]
        iface, ip = me.compute_interface, str(me.compute_ip)
        assert iface is not None  # found on the node (the ssh stage) before its facts are read
        for error in f.errors:
            out.add(node, Status.FAIL, error, f"on {node}: install iproute2 (ip -j needs 4.14+)")
            broken.add(node)
        if f.errors:
            continue
        link = f.interfaces.get(iface)
        holder = next((i.name for i in f.interfaces.values() if ip in i.addresses), None)
        if link is None:
            broken.add(node)
            have = ", ".join(sorted(f.interfaces)) or "none"
            if holder:
                remedy = (
                    f"on {node}: set compute_interface: {holder} in the inventory ({ip} is there)"
                )
            else:
                remedy = f"on {node}: bring up the compute NIC, or correct compute_interface"
            out.add(node, Status.FAIL, f"{node} has no interface {iface} (it has {have})", remedy)
            continue
        env[node] = socket_env(iface, f.infiniband, me.nccl_ib_hca)
        if me.nccl_ib_hca and f.infiniband and not hcas_named(me.nccl_ib_hca, f.infiniband):
            out.add(
                node,
                Status.WARN,
                f"{node}'s nccl_ib_hca {me.nccl_ib_hca} leaves NCCL none of its RDMA devices "
                f"({', '.join(f.infiniband)}): NCCL would use TCP sockets",
                f"on {node}: nccl_ib_hca naming its training HCAs (ls /sys/class/infiniband), "
                "or no nccl_ib_hca",
            )
        speeds[node] = f.speed_mbps
        mtus[node] = link.mtu
        names[node] = iface
        if ip not in link.addresses:
            broken.add(node)
            if holder:
                out.add(
                    node,
                    Status.FAIL,
                    f"{node}'s compute IP {ip} is on {holder}, not {iface}",
                    f"on {node}: set compute_interface: {holder} in the inventory, or move "
                    f"{ip} to {iface}",
                )
            else:
                out.add(
                    node,
                    Status.FAIL,
                    f"{node} has no address {ip} (on {iface}: "
                    f"{', '.join(link.addresses) or 'none'})",
                    f"on {node}: assign {ip} to {iface} (make provision does it), "
                    "or correct compute_ip",
                )
        if not link.up:
            broken.add(node)
            out.add(
                node,
                Status.FAIL,
                f"{node}'s {iface} is down",
                f"on {node}: ip link set {iface} up (make provision makes it persistent)",
            )
        elif not link.running:
            broken.add(node)
            out.add(
                node,
                Status.FAIL,
                f"{node}'s {iface} is up but has no carrier",
                f"on {node}: check {iface}'s cable and switch port",
            )
        for host in hosts:
            if host.name == node or not (link.up and link.running):
                continue  # a link that is down has no routes: that is reported once, above
            route = f.routes.get(str(host.compute_ip))
            if route is None:
                continue
            if route.error or route.dev is None:
                broken.add(node)
                out.add(
                    node,
                    Status.FAIL,
                    f"{node} has no route to {host.name} ({host.compute_ip}): {route.error}",
                    f"on {node}: route the compute subnet through {iface}",
                )
            elif route.dev != iface:
                broken.add(node)
                out.add(
                    node,
                    Status.FAIL,
                    f"{node}'s route to {host.name} ({host.compute_ip}) leaves through "
                    f"{route.dev}, not {iface}",
                    f"on {node}: remove the route that sends {host.compute_ip} through "
                    f"{route.dev} (ip route show match {host.compute_ip}) so it goes through "
                    f"{iface}",
                )
            elif route.source and route.source != ip:
                out.add(
                    node,
                    Status.WARN,
                    f"{node} reaches {host.name} from {route.source}, not {ip}",
                    f"on {node}: make {ip} the primary address of {iface}",
                )
        shown_speed = f"{f.speed_mbps / 1000:g} Gbit/s" if f.speed_mbps else "speed unknown"
        passed[node] = f"{iface} up, mtu {link.mtu}, {shown_speed}, routes to peers through {iface}"

    if len(set(mtus.values())) > 1:
        common = reference(mtus, master.name)
        holders = ", ".join(sorted(n for n, m in mtus.items() if m == common))
        for node, mtu in mtus.items():
            if mtu != common:
                iface = names[node]
                out.add(
                    node,
                    Status.FAIL,
                    f"{node}'s {iface} MTU is {mtu}, not {common} as on {holders}",
                    f"on {node}: ip link set {iface} mtu {common} (and static_ip_mtu in the "
                    "inventory), or give every node the same MTU",
                )
    if len(set(names.values())) > 1:
        common = reference(names, master.name)
        for node, name in names.items():
            if name != common:
                out.add(
                    node,
                    Status.WARN,
                    f"{node}'s compute interface is {name}, most nodes use {common}",
                    f"on {node}: nothing to do if the launcher uses netcheck's env file (it "
                    f"sets the interface per node); a cluster-wide NCCL_SOCKET_IFNAME breaks",
                )
    known = {n: s for n, s in speeds.items() if s}
    if len(set(known.values())) > 1:
        fastest = max(known.values())
        for node, speed in known.items():
            if speed < fastest:
                out.add(
                    node,
                    Status.WARN,
                    f"{node}'s {names[node]} runs at {speed} Mb/s, others at {fastest} Mb/s",
                    f"on {node}: check the negotiated speed (ethtool {names[node]}), the "
                    f"cable and the switch port",
                )
    for node, f in facts.items():
        if f.physical and f.rated_mbps and f.speed_mbps and f.speed_mbps < f.rated_mbps:
            iface = names.get(node, "its compute interface")
            out.add(
                node,
                Status.WARN,
                f"{node}'s {iface} negotiated {f.speed_mbps} Mb/s, below the {f.rated_mbps} "
                "Mb/s it supports",
                f"on {node}: a cable rated for {f.rated_mbps} Mb/s (Cat5e or better for 1 "
                f"Gbit/s), a switch port that runs at it, and auto-negotiation on (ethtool "
                f"{iface})",
            )
    # The file keeps each node's own finding; a job (the launcher) or netcheck's collective
    # makes its nodes' network one (envfile.one_network).
    without = envfile.one_network(env)[1]
    if without:
        # Not a failure: the jobs run, on TCP sockets everywhere (the launcher says so too).
        for node in sorted(set(env) - set(without)):
            out.add(
                node,
                Status.WARN,
                f"{node} has RDMA devices, {', '.join(without)} none: NCCL uses TCP sockets "
                "on every node (one job's nodes must share one network; mixed, NCCL's set-up "
                "waits for ever)",
                f"an RDMA NIC in {', '.join(without)}, or jobs on nodes alike (GROUP=)",
            )
    return InterfaceVerdict(out.done([h.name for h in hosts], passed), broken, env, speeds)
