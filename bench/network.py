"""The bench sections of the network and the nodes' setup: 6. provisioning (make provision
on fresh nodes, then again), 5. netcheck (4 nodes against 2) and 1. bus bandwidth against
raw TCP (netcheck --sweep, the link shaped and not)."""

from __future__ import annotations

import json
import statistics
import subprocess
import time
from pathlib import Path

from torch_multinode.bench.measure import (
    BIN,
    REPO_ROOT,
    Progress,
    Series,
    pin_cores,
    ratio_series,
    run,
    shape,
)
from torch_multinode.cluster.errors import UserError
from torch_multinode.sim import nodes as sim

# -- 6. provisioning -------------------------------------------------------------------------


def provision_seconds(inventory: Path) -> float:
    started = time.monotonic()
    run(
        ["make", "--no-print-directory", "provision", f"INVENTORY={inventory}"],
        timeout=1800,
        what="make provision",
    )
    return time.monotonic() - started


def measure_provision(inventory: Path, reps: int, progress: Progress) -> dict:
    progress("provision: first run on fresh nodes...")
    first = provision_seconds(inventory)
    progress(f"provision: first run {first:.0f} s; second (idempotent) runs...")
    second = Series([provision_seconds(inventory) for _ in range(reps)])
    return {
        "first_seconds": first,
        "second_seconds": second.as_dict(),
        "ratio": Series([s / first for s in second.values]).as_dict(),
    }


# -- 5. netcheck -----------------------------------------------------------------------------


def netcheck_report(inventory: Path, nnodes: int, *extra: str, timeout: float = 600) -> dict:
    proc = subprocess.run(
        [
            str(BIN / "netcheck"),
            "-i",
            str(inventory),
            "-n",
            str(nnodes),
            "--json",
            *extra,
            "--env-file",
            str(inventory.parent / "netcheck-env.json"),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError:
        raise UserError(f"netcheck printed no report: {proc.stderr.strip()[-300:]}") from None
    if not report.get("ok"):
        failed = [f["detail"] for f in report.get("findings", []) if f["status"] == "FAIL"]
        raise UserError(f"netcheck on {nnodes} nodes failed: {'; '.join(failed[:3])}")
    return report


def measure_netcheck(inventory: Path, config: sim.SimConfig, reps: int, progress: Progress) -> dict:
    """netcheck on 4 nodes against 2, each node with the same share of a core in both: this
    machine's 2 cores give 4 nodes half a core each, so the 2 nodes share one core. Real nodes
    do not lose CPU when others join; with 2 nodes on a core each, the 4-node run would mostly
    measure the torch import of twice the nodes on the same 2 cores (also reported)."""
    times: dict[str, list[float]] = {"two": [], "four": [], "two_own_cores": []}
    runs = (("two", 2, [0, 0]), ("four", 4, [0, 1, 0, 1]), ("two_own_cores", 2, [0, 1]))
    try:
        for rep in range(reps):
            for name, nnodes, cores in runs:  # interleaved: drift hits all alike
                pin_cores(config, nnodes, cores)
                started = time.monotonic()
                netcheck_report(inventory, nnodes)
                times[name].append(time.monotonic() - started)
            progress(
                f"netcheck: rep {rep + 1}/{reps}: half a core per node: 2 nodes "
                f"{times['two'][-1]:.1f} s, 4 nodes {times['four'][-1]:.1f} s; 2 nodes on "
                f"a core each {times['two_own_cores'][-1]:.1f} s"
            )
    finally:
        pin_cores(config, 4, [0, 1, 0, 1])
    return {
        "two_nodes_seconds": Series(times["two"]).as_dict(),
        "four_nodes_seconds": Series(times["four"]).as_dict(),
        "ratio": ratio_series(times["four"], times["two"]).as_dict(),
        "two_nodes_own_cores_seconds": Series(times["two_own_cores"]).as_dict(),
        "ratio_own_cores": ratio_series(times["four"], times["two_own_cores"]).as_dict(),
    }


# -- 1. bus bandwidth against raw TCP --------------------------------------------------------


def sweep(inventory: Path) -> dict:
    """One netcheck --sweep: all_reduce busbw per size, raw TCP of the same link."""
    report = netcheck_report(inventory, 2, "--sweep")
    busbw = {
        m["bytes"]: m["busbw"]
        for m in report["collective"]["measurements"]
        if m["op"] == "all_reduce"
    }
    ring = [link["gbps"] for link in report["tcp"]["ring"] if link.get("gbps")]
    return {"busbw": busbw, "tcp": statistics.mean(ring)}


def measure_bandwidth(
    inventory: Path, config: sim.SimConfig, link: str, reps: int, progress: Progress
) -> dict:
    result = {}
    for name, rate in (("shaped", link), ("unshaped", None)):
        shape(config, 2, rate)
        runs = [sweep(inventory) for _ in range(reps)]
        sizes = sorted(runs[0]["busbw"])
        largest = sizes[-1]
        result[name] = {
            "link": rate or "unshaped veth",
            "busbw_by_size": {
                str(size): Series([r["busbw"][size] for r in runs]).as_dict() for size in sizes
            },
            "tcp_gbytes_per_s": Series([r["tcp"] for r in runs]).as_dict(),
            "largest_bytes": largest,
            "busbw_over_tcp": ratio_series(
                [r["busbw"][largest] for r in runs], [r["tcp"] for r in runs]
            ).as_dict(),
        }
        progress(
            f"bandwidth ({name}): busbw at {largest >> 20} MiB "
            f"{result[name]['busbw_by_size'][str(largest)]['median']:.3f} GB/s, raw TCP "
            f"{result[name]['tcp_gbytes_per_s']['median']:.3f} GB/s"
        )
    shape(config, 2, link)
    return result
