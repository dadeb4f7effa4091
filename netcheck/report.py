"""What netcheck found: findings (one check, one node, a status, a remedy) and how they print.

Plain data in, text or JSON out: nothing here touches the network.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field


class Status(enum.StrEnum):
    PASS = "PASS"
    WARN = "WARN"
    FAIL = "FAIL"
    SKIP = "SKIP"
    """Not checked because something it needs failed first (the reason is in the detail)."""

    @property
    def rank(self) -> int:
        return {"PASS": 0, "SKIP": 1, "WARN": 2, "FAIL": 3}[self.value]


# Column order of the table; "bandwidth" only appears when it was measured.
CHECKS = ("ssh", "ping", "names", "ports", "interfaces", "software", "collective")
BANDWIDTH = "bandwidth"
SLURM = "slurm"
LIGHTHOUSE = "lighthouse"
"""--ft: every node reaches this machine on the inventory's lighthouse_port (an FT=1 job's
torchft lighthouse runs here)."""
TRANSPORT = "transport"
"""The network NCCL's collective used, against the node's RDMA hardware: only where it ran on
NCCL (gloo on CPU nodes has no choice to judge; the report says so in a line)."""


@dataclass(frozen=True)
class Finding:
    check: str
    node: str
    status: Status
    detail: str
    remedy: str | None = None
    """One line naming the node to act on, e.g. "on node2: ip link set eth1 up"."""

    def as_dict(self) -> dict:
        return {**asdict(self), "status": self.status.value}


@dataclass(frozen=True)
class Measurement:
    """One collective at one message size, with nccl-tests' bandwidth definitions."""

    op: str
    bytes: int
    seconds: float
    algbw: float
    """GB/s (1e9 bytes per second), size / time."""
    busbw: float
    """GB/s, algbw times the op's bus factor: comparable to the link's own speed."""


@dataclass(frozen=True)
class Link:
    """Raw TCP throughput measured from one node to another."""

    source: str
    target: str
    bytes: int
    seconds: float | None
    error: str | None = None

    @property
    def gbps(self) -> float | None:
        """GB/s (1e9 bytes per second), the unit of algbw and busbw."""
        if self.error or not self.seconds:
            return None
        return self.bytes / self.seconds / 1e9


@dataclass
class Report:
    inventory: str
    nodes: list[str]
    master: str
    rendezvous: str
    stack: str = ""
    """Where the training stack was checked: training_python, or the training image."""
    findings: list[Finding] = field(default_factory=list)
    env: dict[str, dict[str, str]] = field(default_factory=dict)
    env_file: str | None = None
    lock_file: str | None = None  # each node's versions, when nothing FAILed (version_lock)
    backend: str | None = None
    transport: dict[str, dict] = field(default_factory=dict)
    """Per node, what the collective's worker said of its network: `used` (NCCL's "IB",
    "Socket", a plugin's name, or None), `rdma` (the node's RDMA devices), `verbs` (whether
    the worker could open /dev/infiniband), and on gloo the `reason` nothing was judged."""
    measurements: list[Measurement] = field(default_factory=list)
    ring: list[Link] = field(default_factory=list)
    pairwise: list[Link] = field(default_factory=list)
    nic_speed_mbps: dict[str, int | None] = field(default_factory=dict)
    found: dict[str, dict] = field(default_factory=dict)
    """Per node whose inventory entry says auto, what the node said (cluster.autodetect):
    `compute_interface` (None where no interface holds compute_ip), `gpus` and `gpus_from`."""
    seconds: float = 0.0

    @property
    def checks(self) -> list[str]:
        names = list(CHECKS)
        # columns only where they were checked
        for optional in (SLURM, LIGHTHOUSE, TRANSPORT, BANDWIDTH):
            if any(f.check == optional for f in self.findings):
                names.append(optional)
        return names

    @property
    def ok(self) -> bool:
        return not any(f.status is Status.FAIL for f in self.findings)

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1

    def busbw_vs_tcp(self) -> dict | None:
        """all_reduce busbw at the largest size beside the slowest raw TCP link of the ring."""
        reduce = [m for m in self.measurements if m.op == "all_reduce"]
        speeds = [link.gbps for link in self.ring if link.gbps]
        if not reduce or not speeds:
            return None
        largest = max(reduce, key=lambda m: m.bytes)
        tcp = min(speeds)
        return {
            "bytes": largest.bytes,
            "busbw": largest.busbw,
            "tcp": tcp,
            "ratio": largest.busbw / tcp,
        }

    def cell(self, node: str, check: str) -> Status | None:
        """The worst status of one node's findings for one check (None: nothing recorded)."""
        found = [f.status for f in self.findings if f.node == node and f.check == check]
        return max(found, key=lambda s: s.rank) if found else None

    def for_node(self, node: str, check: str) -> list[Finding]:
        return [f for f in self.findings if f.node == node and f.check == check]

    def counts(self) -> dict[str, int]:
        return {s.value: sum(f.status is s for f in self.findings) for s in Status}

    def as_dict(self) -> dict:
        results: dict[str, dict[str, dict]] = {}
        for node in self.nodes:
            results[node] = {}
            for check in self.checks:
                found = self.for_node(node, check)
                status = self.cell(node, check)
                results[node][check] = {
                    "status": status.value if status else None,
                    "detail": "; ".join(f.detail for f in found),
                    "remedies": [f.remedy for f in found if f.remedy],
                }
        return {
            "ok": self.ok,
            "exit_code": self.exit_code,
            "inventory": self.inventory,
            "nodes": self.nodes,
            "master": self.master,
            "rendezvous": self.rendezvous,
            "stack": self.stack,
            "checks": self.checks,
            "results": results,
            "findings": [f.as_dict() for f in self.findings],
            "counts": self.counts(),
            "env": self.env,
            "env_file": self.env_file,
            "lock_file": self.lock_file,
            "found": self.found,
            "collective": {
                "backend": self.backend,
                "transport": self.transport,
                "measurements": [asdict(m) for m in self.measurements],
            },
            "tcp": {
                "ring": [_link_dict(link) for link in self.ring],
                "pairwise": [_link_dict(link) for link in self.pairwise],
                "nic_speed_mbps": self.nic_speed_mbps,
                "all_reduce_busbw_vs_tcp": self.busbw_vs_tcp(),
            },
            "seconds": round(self.seconds, 2),
        }


def _link_dict(link: Link) -> dict:
    return {**asdict(link), "gbps": link.gbps}


def human_bytes(count: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= size and count % size == 0:
            return f"{count // size} {unit}"
    return f"{count} B"


def transport_line(report: Report) -> str:
    """Which network the collective used, per node, in one line ('' when no worker said): the
    HCA ports NCCL took (NCCL_IB_HCA narrows them) and GPUDirect RDMA, where NCCL said."""
    if not report.transport:
        return ""
    if report.backend != "nccl":
        reasons = {reason for t in report.transport.values() if (reason := t.get("reason"))}
        rdma = sorted({d for t in report.transport.values() for d in t.get("rdma") or []})
        rdma_note = f"; RDMA devices here ({', '.join(rdma)}) are for NCCL on GPUs" if rdma else ""
        return f"transport: not checked ({'; '.join(sorted(reasons)) or report.backend}){rdma_note}"
    parts = []
    for node in report.nodes:
        seen = report.transport.get(node)
        if seen is None:
            continue
        used = seen.get("used") or "not said"
        rdma, hcas = seen.get("rdma") or [], seen.get("hcas") or []
        gdr = (seen.get("gdr") or {}).get("used") if isinstance(seen.get("gdr"), dict) else None
        where = f" on {', '.join(hcas)}" if hcas else (f" ({', '.join(rdma)})" if rdma else "")
        said: dict[object, str] = {True: " with GPUDirect RDMA", False: " without GPUDirect RDMA"}
        direct = said.get(gdr, "")
        parts.append(f"{node} {used}{where}{direct}")
    return "NCCL transport: " + ", ".join(parts)


def found_lines(report: Report) -> list[str]:
    """What each node said of the values its inventory entry leaves to it (auto)."""
    lines = []
    for node, found in report.found.items():
        parts = []
        if "compute_interface" in found:
            parts.append(f"compute_interface {found['compute_interface'] or 'not found'}")
        if "gpus" in found:
            gpus = found["gpus"]
            parts.append(
                f"gpus {gpus} ({found['gpus_from']})" if gpus is not None else "gpus not found"
            )
        lines.append(f"found on {node} (auto in the inventory): {', '.join(parts)}")
    return lines


def render(report: Report) -> str:
    """The report for people: a node-by-check table, the measurements, then what to fix."""
    lines = [
        f"netcheck: {len(report.nodes)} node(s) from {report.inventory}, master {report.master}, "
        f"rendezvous {report.rendezvous}",
        f"training stack checked in {report.stack}" if report.stack else "",
        *found_lines(report),
        "",
    ]
    checks = report.checks
    widths = [max(4, *(len(n) for n in report.nodes))] + [max(4, len(c)) for c in checks]
    header = ["node", *checks]
    lines.append("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip())
    for node in report.nodes:
        cells = [node] + [(report.cell(node, c) or Status.SKIP).value for c in checks]
        lines.append("  ".join(v.ljust(w) for v, w in zip(cells, widths, strict=True)).rstrip())

    transport = transport_line(report)
    if report.measurements or transport:
        lines += ["", f"collective ({report.backend}, {len(report.nodes)} node(s))"]
    if transport:
        lines.append(f"  {transport}")
    if report.measurements:
        lines.append(f"  {'op':<11} {'size':>9} {'time':>10} {'algbw':>11} {'busbw':>11}")
        for m in report.measurements:
            lines.append(
                f"  {m.op:<11} {human_bytes(m.bytes):>9} {m.seconds * 1e3:>7.2f} ms "
                f"{m.algbw:>6.3f} GB/s {m.busbw:>6.3f} GB/s"
            )
    for title, links in (("raw TCP, ring", report.ring), ("raw TCP, pairwise", report.pairwise)):
        if links:
            lines += ["", title]
            for link in links:
                value = (
                    f"{link.gbps:.3f} GB/s" if link.gbps is not None else f"failed: {link.error}"
                )
                lines.append(f"  {link.source} -> {link.target}: {value}")
    compared = report.busbw_vs_tcp()
    if compared:
        lines.append(
            f"  all_reduce busbw at {human_bytes(compared['bytes'])}: {compared['busbw']:.3f} GB/s, "
            f"{compared['ratio']:.0%} of the slowest raw TCP link ({compared['tcp']:.3f} GB/s)"
        )
    speeds = {n: s for n, s in report.nic_speed_mbps.items() if s}
    if speeds and (report.ring or report.pairwise):
        known = ", ".join(
            f"{n} {s / 1000:g} Gbit/s ({s / 8000:.3f} GB/s)" for n, s in speeds.items()
        )
        lines.append(f"  NIC nominal speed: {known}")

    problems = [f for f in report.findings if f.status in (Status.FAIL, Status.WARN)]
    problems.sort(key=lambda f: (-f.status.rank, report.nodes.index(f.node), checks.index(f.check)))
    if problems:
        lines += ["", "Problems:"]
        for f in problems:
            lines.append(f"  {f.status.value} {f.check} {f.node}: {f.detail}")
            if f.remedy:
                lines.append(f"       try {f.remedy}")
    skips: dict[tuple[str, str], list[str]] = {}
    for f in report.findings:
        if f.status is Status.SKIP:
            skips.setdefault((f.check, f.detail), []).append(f.node)
    if skips:
        lines += ["", "Skipped:"]
        for (check, detail), nodes in skips.items():
            lines.append(f"  {check} on {', '.join(nodes)}: {detail}")
    if report.env_file:
        lines += ["", f"Environment for the launcher written to {report.env_file}"]
    if report.lock_file:
        lines.append(f"Each node's versions locked in {report.lock_file} (make train checks them)")
    counts = report.counts()
    verdict = "ready" if report.ok else "NOT ready"
    lines += [
        "",
        f"{verdict}: {counts['FAIL']} FAIL, {counts['WARN']} WARN, {counts['SKIP']} SKIP "
        f"in {report.seconds:.1f} s",
    ]
    return "\n".join(lines)
