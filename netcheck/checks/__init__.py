"""The judgement of each check: facts and measurements in, findings out. No I/O here.

Every finding names the node it is reported on, and its remedy starts with "on NODE:", the node
to act on. A failure between two nodes is reported on the node at fault when the evidence says
which one it is: the node whose own compute interface is broken, otherwise the receiving side
(a firewall or a dead interface there is by far the common cause).

This package holds what every check shares (Collector, reference, skipped); the checks
themselves, in the order netcheck.preflight runs them:

    reach       ssh, ping and ports: can the controller and the nodes reach each other
    addressing  names and interfaces: compute IPs, /etc/hosts, routes, MTU, link speed
    software    Python, torch, CUDA, NCCL, driver, GPUs, fabric manager, /dev/shm, memlock
    traffic     real traffic between the nodes: the collective, NCCL's transport, bandwidth
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from torch_multinode.netcheck.report import Finding, Status


def reference(values: Mapping[str, object], master: str) -> object:
    """The value most nodes share; on a tie, the master's."""
    counts = Counter(values.values())
    top = max(counts.values())
    leaders = [v for v, c in counts.items() if c == top]
    if len(leaders) > 1 and master in values and values[master] in leaders:
        return values[master]
    return leaders[0]


@dataclass
class Collector:
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
