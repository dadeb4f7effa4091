"""The judgement of each check: facts and measurements in, findings out. No I/O here.

Every finding names the node it is reported on, and its remedy starts with "on NODE:", the node
to act on. A failure between two nodes is reported on the node at fault when the evidence says
which one it is: the node whose own compute interface is broken, otherwise the receiving side
(a firewall or a dead interface there is by far the common cause).
"""

from __future__ import annotations

import ipaddress
import statistics
from collections import Counter
from dataclasses import dataclass, field

from torch_multinode.cluster.execution import Context, HostContext
from torch_multinode.cluster.inventory import Host
from torch_multinode.cluster.nccl_transport import transport_finding
from torch_multinode.cluster.versions import (
    driver_needed,
    gpu_runs,
    minimum_shown,
    oldest_capability,
    release,
    torch_meets_minimum,
)
from torch_multinode.netcheck import bandwidth
from torch_multinode.netcheck.facts import FQDN, OWN, NodeFacts
from torch_multinode.netcheck.report import TRANSPORT, Finding, Link, Measurement, Status

RTT_WARN_MS = 2.0
LOSS_FAIL_PERCENT = 20.0
SHM_MIN_CPU = 64 << 20
SHM_MIN_GPU = 1 << 30
BUSBW_WARN_RATIO = 0.5
SLOW_LINK_RATIO = 0.5
SOFTWARE_FIELDS = (("python", "Python"), ("torch", "torch"), ("cuda", "CUDA"), ("nccl", "NCCL"))


def blame(source: str, target: str, broken: set[str]) -> str:
    """The node a failed source -> target exchange is reported on."""
    if source in broken and target not in broken:
        return source
    return target


def reference(values: dict[str, object], master: str) -> object:
    """The value most nodes share; on a tie, the master's."""
    counts = Counter(values.values())
    top = max(counts.values())
    leaders = [v for v, c in counts.items() if c == top]
    if len(leaders) > 1 and master in values and values[master] in leaders:
        return values[master]
    return leaders[0]


def holders_text(holders: list[dict]) -> str:
    if not holders:
        return "a process this user cannot see"
    return ", ".join(f"{h['name'] or '?'} (pid {h['pid']}: {h['command'] or '?'})" for h in holders)


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.IPv4Address(address).is_loopback
    except ValueError:
        return False


@dataclass
class _Collector:
    """Findings per node for one check, with a PASS filled in for nodes that had no problem."""

    check: str
    findings: list[Finding] = field(default_factory=list)

    def add(self, node: str, status: Status, detail: str, remedy: str | None = None) -> None:
        self.findings.append(Finding(self.check, node, status, detail, remedy))

    def done(self, nodes: list[str], passed: dict[str, str]) -> list[Finding]:
        seen = {f.node for f in self.findings}
        extra = [
            Finding(self.check, n, Status.PASS, passed[n])
            for n in nodes
            if n not in seen and n in passed
        ]
        order = {n: i for i, n in enumerate(nodes)}
        return sorted(self.findings + extra, key=lambda f: order.get(f.node, len(order)))


def skipped(check: str, nodes: list[str], reason: str) -> list[Finding]:
    return [Finding(check, n, Status.SKIP, reason) for n in nodes]


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
    down: set[str] = frozenset(),
) -> list[Finding]:
    """Pings from every node with facts to every other node; `down`: nodes SSH did not reach."""
    by_name = {h.name: h for h in hosts}
    out = _Collector("ping")
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
            elif ping.rtt_avg_ms is not None and ping.rtt_avg_ms > RTT_WARN_MS:
                out.add(
                    source,
                    Status.WARN,
                    f"rtt {ping.rtt_avg_ms:.2f} ms from {source} to {target} (a LAN answers "
                    f"in well under {RTT_WARN_MS:g} ms)",
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


# --- 3. names -------------------------------------------------------------------------------


def name_findings(
    hosts: list[Host], facts: dict[str, NodeFacts], rendezvous: str, master: Host
) -> list[Finding]:
    out = _Collector("names")
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


def socket_env(interface: str, infiniband: list[str]) -> dict[str, str]:
    """What NCCL and gloo need to use exactly the compute interface on one node."""
    env = {"NCCL_SOCKET_IFNAME": f"={interface}", "GLOO_SOCKET_IFNAME": interface}
    if not infiniband:
        env["NCCL_IB_DISABLE"] = "1"
    return env


def interface_findings(
    hosts: list[Host], facts: dict[str, NodeFacts], master: Host
) -> InterfaceVerdict:
    out = _Collector("interfaces")
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
        env[node] = socket_env(iface, f.infiniband)
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
                    f"on {node}: assign {ip} to {iface} (netplan), or correct compute_ip",
                )
        if not link.up:
            broken.add(node)
            out.add(
                node,
                Status.FAIL,
                f"{node}'s {iface} is down",
                f"on {node}: ip link set {iface} up (and make it persistent in netplan)",
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
        speed = f"{f.speed_mbps / 1000:g} Gbit/s" if f.speed_mbps else "speed unknown"
        passed[node] = f"{iface} up, mtu {link.mtu}, {speed}, routes to peers through {iface}"

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
                    f"on {node}: ip link set {iface} mtu {common} (and in netplan), or give "
                    f"every node the same MTU",
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
    return InterfaceVerdict(out.done([h.name for h in hosts], passed), broken, env, speeds)


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
    out = _Collector("ports")
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


# --- 6. software ----------------------------------------------------------------------------


def software_findings(
    hosts: list[Host], probes: dict[str, dict | str], master: Host, context: Context | None = None
) -> list[Finding]:
    """`probes`: node -> the software probe's JSON, or the error that stopped it."""
    context = context or HostContext()
    container = context.name == "container"
    out = _Collector("software")
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
            out.add(
                node,
                Status.FAIL,
                f"NVIDIA driver {driver} on {node} is older than torch's CUDA "
                f"{probe.get('cuda')} needs (branch {needed} or newer)",
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
        want = by_name[node].gpus
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
    smi = probe.get("nvidia_smi_gpus")
    if probe.get("fabricmanager") is False:
        why = "no fabric manager runs (nv-fabricmanager; systemd: nvidia-fabricmanager inactive)"
    elif waiting:
        why = f"the GPUs' fabric registration is not complete ({', '.join(waiting)})"
    elif probe.get("fabricmanager") is None and smi and not probe.get("gpus"):
        why = f"torch sees none of the {smi} GPU(s) nvidia-smi lists (is nvidia-fabricmanager running?)"
    else:
        return None
    driver = probe.get("driver") or ""
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


# --- 7. collective and bandwidth ------------------------------------------------------------


def measurements(rows: list[dict], nranks: int) -> list[Measurement]:
    return [
        Measurement(
            op=r["op"],
            bytes=r["bytes"],
            seconds=r["seconds"],
            algbw=bandwidth.algbw(r["bytes"], r["seconds"]),
            busbw=bandwidth.busbw(r["op"], r["bytes"], r["seconds"], nranks),
        )
        for r in rows
    ]


def collective_findings(
    hosts: list[Host],
    results: dict[str, dict | str],
    backend: str,
    rerun: dict[str, str],
    stacks: dict[str, dict | str] | None = None,
) -> list[Finding]:
    """`results`: node -> the worker's final JSON, or the error that stopped it.

    `rerun`: node -> the command that runs that node's worker by hand, for the remedy.
    `stacks`: node -> the software facts the worker reported, or why it reported none.
    """
    stacks = stacks or {}
    out = _Collector("collective")
    failed_here = {
        n
        for n, r in results.items()
        if isinstance(r, str)
        or (not r.get("ok") and "did not finish" not in str(r.get("error", "")))
    }
    passed = {}
    for node, result in results.items():
        stack = stacks.get(node)
        if isinstance(stack, dict) and "torch_error" in stack:
            out.add(
                node,
                Status.FAIL,
                f"the worker cannot import torch: {stack['torch_error']}",
                f"on {node}: fix the software FAIL first",
            )
            continue
        if isinstance(result, str):
            out.add(
                node,
                Status.FAIL,
                f"the worker failed: {result}",
                f"on {node}: run it by hand to see the whole error: {rerun[node]}",
            )
            continue
        if result.get("ok"):
            largest = {}
            for r in result.get("results", []):
                largest[r["op"]] = r
            text = ", ".join(f"{op} ok" for op in largest)
            passed[node] = f"{backend}: {text}, results exact"
            continue
        mismatched = [r for r in result.get("results", []) if r.get("mismatches")]
        if mismatched:
            worst = mismatched[0]
            out.add(
                node,
                Status.FAIL,
                f"{worst['op']} of {worst['bytes']} bytes gave {worst['mismatches']} wrong "
                f"value(s) on {node}",
                f"on {node}: suspect the NIC, its driver or memory; rerun, then swap the node out",
            )
            continue
        error = str(result.get("error"))
        others = sorted(failed_here - {node})
        if "did not finish" in error and others:
            detail = f"{error} (waiting for {', '.join(others)}, which failed)"
            remedy = f"on {others[0]}: fix the failure reported there"
        elif "did not finish" in error:
            detail = error
            remedy = (
                f"on {node}: check the ports and interfaces findings; run it by hand: {rerun[node]}"
            )
        else:
            detail = error
            remedy = f"on {node}: run it by hand to see the whole error: {rerun[node]}"
        out.add(node, Status.FAIL, detail, remedy)
    return out.done([h.name for h in hosts], passed)


def transport_findings(
    hosts: list[Host], results: dict[str, dict | str], backend: str
) -> list[Finding]:
    """The network NCCL's collective used on each node against the node's RDMA hardware
    (cluster.nccl_transport's rule): WARN where InfiniBand/RoCE exists but NCCL fell back to TCP
    sockets. Only on NCCL: gloo (CPU nodes) uses sockets whatever the hardware, and the report
    says so in a line of its own (Report.transport) instead of a column."""
    if backend != "nccl":
        return []
    out = _Collector(TRANSPORT)
    for host in hosts:
        node = host.name
        result = results.get(node)
        seen = result.get("transport") if isinstance(result, dict) else None
        if not isinstance(seen, dict):
            out.add(node, Status.SKIP, f"not checked: the collective did not finish on {node}")
            continue
        hardware = list(seen.get("rdma") or [])
        status, detail = transport_finding(seen.get("used"), hardware, seen.get("verbs"))
        remedy = None
        if status == "WARN":
            remedy = (
                f"on {node}: give NCCL the RDMA devices ({', '.join(hardware)}): "
                + (
                    "/dev/infiniband, which the training containers get where the node has it "
                    "(where it is missing: modprobe ib_uverbs rdma_ucm)"
                    if not seen.get("verbs")
                    else "libibverbs in the image (make image) and NCCL_IB_DISABLE unset"
                )
                + "; then make netcheck again"
            )
        out.add(node, Status(status), detail, remedy)
    return out.done([h.name for h in hosts], {})


def bandwidth_findings(
    hosts: list[Host],
    master: Host,
    measured: list[Measurement],
    ring: list[Link],
    pairwise: list[Link],
    speeds: dict[str, int | None],
) -> list[Finding]:
    out = _Collector("bandwidth")
    by_name = {h.name: h for h in hosts}
    for link in ring + pairwise:
        if link.error:
            out.add(
                link.target,
                Status.FAIL,
                f"raw TCP from {link.source} to {link.target} failed: {link.error}",
                f"on {link.target}: see the ports check",
            )
    speeds_ok = [link.gbps for link in ring if link.gbps]
    reduce = [m for m in measured if m.op == "all_reduce"]
    if reduce and speeds_ok and len(hosts) > 1:
        big = max(reduce, key=lambda m: m.bytes)
        tcp = min(speeds_ok)
        if big.busbw < BUSBW_WARN_RATIO * tcp:
            out.add(
                master.name,
                Status.WARN,
                f"all_reduce busbw {big.busbw:.3f} GB/s at {big.bytes >> 20} MiB is "
                f"{big.busbw / tcp:.0%} of raw TCP {tcp:.3f} GB/s",
                f"on {master.name}: check CPU load and that the socket interface variables "
                f"name the compute NIC on every node",
            )
    good = [link for link in pairwise if link.gbps]
    if len(good) >= 2:
        median = statistics.median(link.gbps for link in good)
        slow = {(link.source, link.target) for link in good if link.gbps < SLOW_LINK_RATIO * median}
        outgoing: dict[str, list[Link]] = {}
        incoming: dict[str, list[Link]] = {}
        for link in good:
            outgoing.setdefault(link.source, []).append(link)
            incoming.setdefault(link.target, []).append(link)
        for link in good:
            if (link.source, link.target) not in slow:
                continue
            if all((x.source, x.target) in slow for x in outgoing[link.source]):
                node, how = link.source, "sending"
            elif all((x.source, x.target) in slow for x in incoming[link.target]):
                node, how = link.target, "receiving"
            else:
                node, how = link.source, "sending"
            iface = by_name[node].compute_interface
            out.add(
                node,
                Status.WARN,
                f"slow link {link.source} -> {link.target}: {link.gbps:.3f} GB/s, median "
                f"{median:.3f} GB/s ({node} is slow {how})",
                f"on {node}: check {iface}'s negotiated speed and errors (ethtool {iface}; ip "
                f"-s link show {iface}), its cable and switch port, and shaping (tc qdisc "
                f"show dev {iface})",
            )
    passed = {}
    for host in hosts:
        mine = [link for link in ring + pairwise if link.source == host.name and link.gbps]
        speed = speeds.get(host.name)
        nominal = f", NIC {speed / 1000:g} Gbit/s nominal" if speed else ""
        if mine:
            best = max(link.gbps for link in mine)
            passed[host.name] = f"raw TCP out up to {best:.3f} GB/s{nominal}"
        else:
            passed[host.name] = f"not measured from {host.name}{nominal}"
    return out.done([h.name for h in hosts], passed)
