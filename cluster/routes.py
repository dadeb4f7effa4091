"""This machine's (the controller's) address as each node sees it: what a node connects back
to (the image registry, provision.ship; an FT=1 job's lighthouse, launch.replicated)."""

from __future__ import annotations

import json
import subprocess

from torch_multinode.cluster.errors import UserError
from torch_multinode.cluster.inventory import Host


def address_towards(host: Host) -> str:
    """The source address this machine's routes give for traffic to `host` (its SSH
    address): the one `host` reaches this machine at."""
    proc = subprocess.run(
        ["ip", "-json", "route", "get", host.ssh_address],
        capture_output=True,
        text=True,
        check=False,
    )
    try:
        return str(json.loads(proc.stdout)[0]["prefsrc"])
    except (ValueError, LookupError, TypeError):
        raise UserError(
            f"cannot tell this machine's address towards {host.name} ({host.ssh_address}): "
            f"{proc.stderr.strip() or 'ip route get gave no source address'}"
        ) from None
