"""ssh, ping and ports: can the controller reach each node over SSH, and the nodes each other
over ICMP and TCP (the firewall). No I/O here.

A failure between two nodes is reported on the node whose own compute interface is broken
(netcheck.checks.addressing's verdict), otherwise on the receiving side.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Set
from dataclasses import dataclass

from torch_multinode.cluster.inventory import Host
from torch_multinode.netcheck.checks import Collector
from torch_multinode.netcheck.facts import NodeFacts
from torch_multinode.netcheck.report import LIGHTHOUSE, Finding, Status

RTT_WARN_MS = 2.0
LOSS_FAIL_PERCENT = 20.0


def blame(source: str, target: str, broken: set[str]) -> str:
    """The node a failed source -> target exchange is reported on."""
    if source in broken and target not in broken:
        return source
    return target


def holders_text(holders: list[dict]) -> str:
    if not holders:
        return "a process this user cannot see"
    return ", ".join(f"{h['name'] or '?'} (pid {h['pid']}: {h['command'] or '?'})" for h in holders)


# --- 1. SSH ---------------------------------------------------------------------------------


def ssh_finding(host: Host, error: str | None, seconds: float) -> Finding:
    if error is None:
        return Finding("ssh", host.name, Status.PASS, f"batch-mode SSH answered in {seconds:.1f} s")
    where = f"{host.ssh_user + '@' if host.ssh_user else ''}{host.ssh_address}:{host.ssh_port}"
    if "known_hosts" in error:
        remedy = (
            f"on {host.name}: check its host key fingerprint, then add it to the "
            f"controller's known_hosts (ssh-keyscan -H {host.ssh_address})"
        )
    else:
        remedy = (
            f"on {host.name}: check that the node is up, sshd runs and the controller's key "
            f"is authorized (ssh -o BatchMode=yes {where.rsplit(':', 1)[0]})"
        )
    return Finding("ssh", host.name, Status.FAIL, error.removeprefix("Error: "), remedy)


# --- 2. ping --------------------------------------------------------------------------------


def ping_findings(
    hosts: list[Host],
    facts: dict[str, NodeFacts],
    broken: set[str],
    subnet: str,
    down: Set[str] = frozenset(),
) -> list[Finding]:
    """Pings from every node with facts to every other node; `down`: nodes SSH did not reach."""
    by_name = {h.name: h for h in hosts}
    out = Collector("ping")
    rtts: dict[str, list[float]] = {h.name: [] for h in hosts}
    tested: set[str] = set()
    for source, node_facts in facts.items():
        for target, ping in node_facts.pings.items():
            peer = by_name.get(target)
            if peer is None:
                continue
            tested.update((source, target))
            if ping.error:
                out.add(
                    source,
                    Status.WARN,
                    f"cannot run ping: {ping.error}",
                    f"on {source}: install ping (apt-get install iputils-ping)",
                )
                continue
            if ping.rtt_avg_ms is not None:
                rtts[source].append(ping.rtt_avg_ms)
            if ping.loss >= 100.0:
                node = blame(source, target, broken)
                iface = by_name[node].compute_interface
                if node == target:
                    detail = f"no reply from {target} ({peer.compute_ip}) to ping from {source}"
                else:
                    detail = f"{source} gets no reply from {target} ({peer.compute_ip})"
                if node in broken:
                    remedy = f"on {node}: fix {iface} first (see interfaces)"
                elif node in down:
                    detail += f" (nor does SSH reach {node})"
                    remedy = f"on {node}: check that the node is up and on the network"
                else:
                    remedy = (
                        f"on {target}: check that {iface} is up and that ICMP from "
                        f"{subnet} is allowed"
                    )
                out.add(node, Status.FAIL, detail, remedy)
            elif ping.loss > 0:
                status = Status.FAIL if ping.loss >= LOSS_FAIL_PERCENT else Status.WARN
                node = blame(source, target, broken)
                out.add(
                    node,
                    status,
                    f"{ping.loss:g}% packet loss from {source} to {target} ({peer.compute_ip})",
                    f"on {node}: check {by_name[node].compute_interface}'s cable, switch port "
                    f"and error counters (ip -s link show {by_name[node].compute_interface})",
                )
            elif ping.rtt_min_ms is not None and ping.rtt_min_ms > RTT_WARN_MS:
                # Judged on the fastest of the replies: a busy CPU at either end delays some
                # of them, a routed, wireless or congested path every one.
                out.add(
                    source,
                    Status.WARN,
                    f"rtt {ping.rtt_min_ms:.2f} ms at best (avg {ping.rtt_avg_ms:.2f} ms) from "
                    f"{source} to {target} (a LAN answers in well under {RTT_WARN_MS:g} ms)",
                    f"on {source}: look for a congested, wireless or routed path to {target}",
                )
    passed = {}
    for name in tested:
        values = rtts.get(name) or []
        passed[name] = (
            f"no loss, rtt avg {statistics.mean(values):.2f} ms to {len(values)} peer(s)"
            if values
            else "no fault found on this side"
        )
    return out.done([h.name for h in hosts], passed)


# --- 4. ports -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Listening:
    """One node's listener: the ports it bound, or why it could not."""

    node: str
    ports: list[dict]
    error: str | None = None


def port_findings(
    hosts: list[Host],
    master: Host,
    rendezvous_port: int,
    listeners: dict[str, Listening],
    connects: dict[str, list[dict] | str],
    broken: set[str],
    subnet: str,
) -> list[Finding]:
    """`connects`: source node -> its connection results, or the error that stopped it."""
    out = Collector("ports")
    by_name = {h.name: h for h in hosts}
    ok_count: Counter[str] = Counter()
    for node, listening in listeners.items():
        if listening.error:
            out.add(
                node,
                Status.FAIL,
                f"cannot start the port listener: {listening.error}",
                f"on {node}: check that python3 runs there",
            )
            continue
        for port in listening.ports:
            if port.get("ok") or port.get("requested") != rendezvous_port:
                if not port.get("ok"):
                    out.add(
                        node,
                        Status.FAIL,
                        f"cannot listen on a high port: {port.get('error')}",
                        f"on {node}: check the local port range and SELinux/AppArmor",
                    )
                continue
            why = (
                f"used by {holders_text(port.get('holders', []))}"
                if port.get("in_use")
                else str(port.get("error"))
            )
            pids = " ".join(str(h["pid"]) for h in port.get("holders", []))
            stop = (
                f"stop it (kill {pids})"
                if pids
                else f"stop it (ss -ltnp 'sport = :{rendezvous_port}')"
            )
            if node == master.name:
                out.add(
                    node,
                    Status.FAIL,
                    f"rendezvous port {rendezvous_port} on the master {node} is in use: {why}",
                    f"on {node}: {stop}, or set rendezvous_port to a free port in the inventory",
                )
            else:
                out.add(
                    node,
                    Status.WARN,
                    f"rendezvous port {rendezvous_port} is in use: {why}",
                    f"on {node}: {stop} if it is a leftover (only the master needs the port)",
                )
    for source, results in connects.items():
        if isinstance(results, str):
            out.add(
                source,
                Status.FAIL,
                f"cannot run the connection test: {results}",
                f"on {source}: check that python3 runs there",
            )
            continue
        failed: dict[str, list[dict]] = {}
        for result in results:
            if result.get("ok"):
                ok_count[result["name"]] += 1
            else:
                failed.setdefault(result["name"], []).append(result)
        for target, bad in failed.items():
            node = blame(source, target, broken)
            ports = " and ".join(
                f":{r['port']} ({'rendezvous port' if r['port'] == rendezvous_port else 'random high port'}"
                f", {r.get('error')})"
                for r in bad
            )
            detail = f"{source} cannot connect to {target}{ports}"
            if node in broken:
                remedy = f"on {node}: fix {by_name[node].compute_interface} first (see interfaces)"
            elif all(r["port"] == rendezvous_port for r in bad):
                remedy = (
                    f"on {target}: allow TCP port {rendezvous_port} from {subnet} in the "
                    f"firewall (e.g. ufw allow from {subnet} to any port {rendezvous_port})"
                )
            else:
                remedy = (
                    f"on {target}: allow TCP on all ports from {subnet} in the firewall (e.g. "
                    f"ufw allow from {subnet}); NCCL and gloo use random high ports"
                )
            out.add(node, Status.FAIL, detail, remedy)
    passed = {}
    for node, listening in listeners.items():
        bound = [str(p["port"]) for p in listening.ports if p.get("ok")]
        passed[node] = (
            f"listens on {' and '.join(bound)}, reached by "
            f"{ok_count[node] // max(len(bound), 1)} peer(s)"
        )
    return out.done([h.name for h in hosts], passed)


# --- FT=1: the lighthouse's port on this machine (--ft) ------------------------------------


def lighthouse_port_taken(host: Host, port: int, refused: dict) -> Finding:
    """This machine could not listen on the lighthouse port (sockprobe's bind result)."""
    held = refused.get("in_use")
    return Finding(
        LIGHTHOUSE,
        host.name,
        Status.FAIL,
        f"this machine cannot listen on lighthouse port {port}: "
        + (f"in use by {holders_text(refused.get('holders', []))}" if held else refused["error"]),
        f"stopping what holds port {port} here, or another lighthouse_port in the inventory",
    )


def lighthouse_finding(host: Host, address: str, port: int, connected) -> Finding:
    """Whether `host` reached this machine's `address`:`port` (its sockprobe connect's
    Attempt), as an FT=1 job's replica groups reach the lighthouse there."""
    data = connected.json()
    results = data.get("results", []) if data is not None else []
    if results and results[0].get("ok"):
        return Finding(
            LIGHTHOUSE,
            host.name,
            Status.PASS,
            f"reaches the lighthouse port on this machine ({address}:{port})",
        )
    why = results[0].get("error", "no answer") if results else connected.why()
    return Finding(
        LIGHTHOUSE,
        host.name,
        Status.FAIL,
        f"cannot reach this machine's lighthouse port {address}:{port}: {why}",
        f"let {host.name} reach TCP port {port} here: this machine's firewall "
        f"(sudo ufw allow from {host.ssh_address} to any port {port} proto tcp; make "
        "provision opens it where this machine is one of the nodes) and "
        f"{host.name}'s own outgoing rules (sudo iptables -S OUTPUT on it); or a "
        "lighthouse_port both let through",
    )
