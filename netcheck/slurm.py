"""The Slurm check, on an inventory with scheduler: slurm: every node is known to the
controller and ready for jobs (not down, drained or failing, with the reason Slurm gives), and
munge, which authenticates everything Slurm does, works on every node.

A node whose munge key differs from the controller's cannot register its slurmd: Slurm shows
it "not responding" or down, which the first half names. Plain functions over the commands'
output; preflight runs the commands.
"""

from __future__ import annotations

from torch_multinode.cluster.inventory import Host, Inventory
from torch_multinode.netcheck.report import SLURM, Finding, Status

CHECK = SLURM
# One line per node: name|state|reason. States may carry a flag suffix: '*' not responding,
# '~' powered off, '#' powering up, '!' pending power down, '%' powering down, '$' reserved.
SINFO = "sinfo --Node --noheader --format '%N|%T|%E'"
# A credential made and decoded on the node itself, through a pipe: nothing on a command line.
MUNGE = "munge --no-input | unmunge >/dev/null"
READY = ("idle", "mixed", "allocated", "completing", "planned")


def node_states(sinfo_out: str) -> dict[str, tuple[str, str]]:
    """sinfo's lines as {node: (state, reason)}; a node listed in several partitions once."""
    states: dict[str, tuple[str, str]] = {}
    for line in sinfo_out.splitlines():
        parts = line.strip().split("|", 2)
        if len(parts) == 3 and parts[0] not in states:
            reason = parts[2].strip()
            states[parts[0]] = (parts[1].strip(), "" if reason == "none" else reason)
    return states


def findings(
    inventory: Inventory,
    hosts: list[Host],
    master: Host,
    sinfo: tuple[str | None, str | None],
    munge: dict[str, str | None],
) -> list[Finding]:
    """One finding per node. `sinfo`: (its output, or None and why it failed) from the
    master; `munge`: per node, None when munge works there, else why not."""
    out, failed = sinfo
    provision = f"make provision INVENTORY={inventory.path}"
    if out is None:
        return [
            Finding(
                CHECK,
                host.name,
                Status.FAIL,
                f"Slurm's controller on {master.name} does not answer sinfo: {failed}",
                f"on {master.name}: check slurmctld (its log is /var/log/slurm/slurmctld.log); "
                f"{provision} starts it",
            )
            for host in hosts
        ]
    states = node_states(out)
    result = []
    for host in hosts:
        name = host.name
        if munge.get(name) is not None:
            result.append(
                Finding(
                    CHECK,
                    name,
                    Status.FAIL,
                    f"munge does not work on {name}: {munge[name]}",
                    f"on {name}: check munged (its log is /var/log/munge/munged.log); "
                    f"{provision} starts it",
                )
            )
        elif name not in states:
            result.append(
                Finding(
                    CHECK,
                    name,
                    Status.FAIL,
                    f"{name} is not a node of Slurm's controller on {master.name}",
                    f"{provision} (slurm.conf lists every node of the inventory)",
                )
            )
        else:
            state, reason = states[name]
            base = state.rstrip("*~#!%$").lower()
            if base in READY and not state.endswith("*"):
                result.append(Finding(CHECK, name, Status.PASS, f"Slurm has {name} {state}"))
                continue
            why = f" ({reason})" if reason else ""
            if base.startswith("drain"):
                remedy = (
                    f"on {master.name}: once that is dealt with, scontrol update "
                    f"nodename={name} state=resume"
                )
            else:
                remedy = (
                    f"on {name}: check slurmd and munge (logs in /var/log/slurm, "
                    f"/var/log/munge; a munge key unlike the controller's keeps it out); "
                    f"{provision} restarts them"
                )
            result.append(
                Finding(CHECK, name, Status.FAIL, f"Slurm has {name} {state}{why}", remedy)
            )
    return result
