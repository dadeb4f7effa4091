"""14. The version lock's cost: what `make train` adds to check every node against the versions
netcheck locked (cluster.version_lock), at 4 nodes, against a budget of 1 s.

The launcher runs the lock's probe on each node's open session, all nodes at once, and compares
the answers with the lock it read: that is what is timed here, over sessions already open as
the launcher's are when it prepares the nodes. A bare round trip (`true`) on the same sessions
is timed beside it, alternating, so the figure can be read against the link's own cost."""

from __future__ import annotations

import datetime
import time
from pathlib import Path

from torch_multinode.bench.measure import Progress, Series
from torch_multinode.cluster import version_lock
from torch_multinode.cluster.execution import SshNodes
from torch_multinode.cluster.inventory_read import load
from torch_multinode.cluster.remote import on_all

LOCK_NODES = 4
LOCK_BUDGET = 1.0  # seconds


def measure_lock(inventory: Path, reps: int, progress: Progress) -> dict:
    """On `inventory`'s first LOCK_NODES nodes: the seconds the lock's check takes (read the
    lock, probe every node at once, compare), and a bare round trip's, `reps` times each."""
    cluster = load(str(inventory)).first(str(LOCK_NODES))
    hosts = list(cluster.hosts)
    path = version_lock.default_path(cluster.path)
    kept = path.read_bytes() if path.exists() else None
    nodes = SshNodes(cluster)

    def probe(host) -> dict[str, str]:
        command = version_lock.probe_command(host, cluster)
        return version_lock.parse(nodes.run(host, command, 60).stdout)

    try:
        on_all(hosts, lambda host: nodes.run(host, "true", 30))  # the sessions open
        version_lock.write(path, on_all(hosts, probe))  # as netcheck leaves it
        check, bare = [], []
        for rep in range(reps):
            started = time.monotonic()
            on_all(hosts, lambda host: nodes.run(host, "true", 30))
            bare.append(time.monotonic() - started)
            started = time.monotonic()
            locked = version_lock.load(path) or {}
            found = on_all(hosts, probe)
            drifted = [n for n in found if version_lock.drift(locked.get(n, {}), found[n])]
            check.append(time.monotonic() - started)
            if drifted:
                raise RuntimeError(f"lock: {', '.join(drifted)} drifted while measured")
            progress(
                f"lock: rep {rep + 1}/{reps}: the check {check[-1]:.2f} s at {len(hosts)} nodes, "
                f"a bare round trip {bare[-1]:.2f} s"
            )
    finally:
        nodes.close()
        if kept is None:
            path.unlink(missing_ok=True)
        else:
            path.write_bytes(kept)
    return {
        "date": datetime.datetime.now().isoformat(timespec="minutes"),
        "nodes": len(hosts),
        "launch_mode": cluster.launch_mode,
        "budget": LOCK_BUDGET,
        "check_seconds": Series(check).as_dict(),
        "bare_seconds": Series(bare).as_dict(),
        "ratio": Series([s / LOCK_BUDGET for s in check]).as_dict(),
    }
