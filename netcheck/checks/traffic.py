"""Real traffic between the nodes, as the workers measured it: the collective's results (exact
values on every node), the network NCCL used against the node's RDMA hardware, and raw TCP
bandwidth against the collective's bus bandwidth and the other links. No I/O here.
"""

from __future__ import annotations

import statistics
from typing import cast

from torch_multinode.cluster.inventory import Host
from torch_multinode.cluster.nccl_transport import GDR_REMEDY, transport_finding
from torch_multinode.netcheck import bandwidth
from torch_multinode.netcheck.checks import Collector
from torch_multinode.netcheck.report import TRANSPORT, Finding, Link, Measurement, Status

BUSBW_WARN_RATIO = 0.5
SLOW_LINK_RATIO = 0.5
# A NIC whose raw TCP reaches less than this share of the speed it negotiated (with its peer's,
# the slower of the two) is said; above SINGLE_STREAM_MBPS one TCP stream is bound by a CPU
# core rather than the link, so faster NICs are not judged this way.
NEGOTIATED_WARN_RATIO = 0.25
SINGLE_STREAM_MBPS = 10_000


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
    out = Collector("collective")
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
    sockets, or used it without GPUDirect RDMA where its HCAs lacked nvidia-peermem or DMA-BUF.
    Only on NCCL: gloo (CPU nodes) uses sockets whatever the hardware, and the report says so in
    a line of its own (Report.transport) instead of a column."""
    if backend != "nccl":
        return []
    out = Collector(TRANSPORT)
    for host in hosts:
        node = host.name
        result = results.get(node)
        seen = result.get("transport") if isinstance(result, dict) else None
        if not isinstance(seen, dict):
            out.add(node, Status.SKIP, f"not checked: the collective did not finish on {node}")
            continue
        hardware = list(seen.get("rdma") or [])
        gdr = seen.get("gdr") if isinstance(seen.get("gdr"), dict) else None
        status, detail = transport_finding(
            seen.get("used"),
            hardware,
            seen.get("verbs"),
            list(seen.get("hcas") or []),
            gdr,
            seen.get("peermem"),
        )
        remedy = None
        if status == "WARN" and seen.get("used") != "Socket":  # RDMA without GPUDirect RDMA
            remedy = f"on {node}: {GDR_REMEDY}; then make netcheck again"
        elif status == "WARN":
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
    negotiated: dict[str, int] | None = None,
) -> list[Finding]:
    """`negotiated`: the speed each node's compute NIC negotiated, in Mb/s, for the nodes whose
    compute interface is a NIC (a virtual one's speed is nominal)."""
    out = Collector("bandwidth")
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
    good = [link for link in pairwise if link.gbps]  # measured: their gbps is a float
    if len(good) >= 2:
        median = statistics.median(cast(float, link.gbps) for link in good)
        slow = {
            (link.source, link.target)
            for link in good
            if cast(float, link.gbps) < SLOW_LINK_RATIO * median
        }
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
    # A NIC that sends far below what it negotiated, each link judged against its slower end.
    negotiated = negotiated or {}
    for host in hosts:
        speed = negotiated.get(host.name)
        if not speed or speed > SINGLE_STREAM_MBPS:
            continue
        shares = [
            link.gbps * 8000 / min(speed, negotiated.get(link.target) or speed)
            for link in ring + pairwise
            if link.source == host.name and link.gbps
        ]
        if shares and max(shares) < NEGOTIATED_WARN_RATIO:
            iface = host.compute_interface
            out.add(
                host.name,
                Status.WARN,
                f"{host.name} sends raw TCP over {iface} at {max(shares):.0%} at best of the "
                f"speed its links negotiated ({speed / 1000:g} Gbit/s here)",
                f"on {host.name}: errors and drops (ip -s link show {iface}), the duplex "
                f"(ethtool {iface}), shaping (tc qdisc show dev {iface}) and CPU load",
            )
    passed = {}
    for host in hosts:
        mine = [link for link in ring + pairwise if link.source == host.name and link.gbps]
        speed = speeds.get(host.name)
        nominal = f", NIC {speed / 1000:g} Gbit/s nominal" if speed else ""
        if mine:
            best = max(cast(float, link.gbps) for link in mine)  # measured ones only
            passed[host.name] = f"raw TCP out up to {best:.3f} GB/s{nominal}"
        else:
            passed[host.name] = f"not measured from {host.name}{nominal}"
    return out.done([h.name for h in hosts], passed)
