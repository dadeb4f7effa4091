"""The pre-flight run: every stage on all nodes in parallel, each under a wall-clock limit.

    1. ssh        batch mode, 5 s to connect; where the inventory says `auto`
                  (compute_interface, gpus), the same round trip finds the values on the node
                  (cluster.autodetect), before any later stage uses them
    2. facts      one round trip: names, interfaces, routes, pings to every peer
    3. ports      listen on the rendezvous port and a random one, every peer connects
    4. raw TCP    (--sweep: around the ring; --pairwise: each pair alone)
    5. collective all_reduce, all_gather, broadcast across every node; each worker first
                  reports the software facts, so a node imports torch once per run
    6. software   from the workers, or, where they did not run, from the probe alone

Here: the order of the stages and which of them can run, the ssh, facts, Slurm and software
stages, and the SKIP of every check not reached. The stages that start listeners and workers on
the nodes (ports, raw TCP, the collective) are netcheck.stages'; the run's Options and the one
way a command runs on a node (attempt, parallel) are netcheck.attempts'.

A node that does not answer is reported and left out of the later stages; a stage that needs
every node (TCP, the collective) is then skipped with the reason. Nothing here prints: the
result is a Report, and cluster.remote's UserError never escapes (it becomes a finding).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import replace

from torch_multinode.cluster import autodetect
from torch_multinode.cluster.execution import Context, Nodes, context_for, python_command
from torch_multinode.cluster.inventory import Host, Inventory
from torch_multinode.netcheck import checks, facts, slurm, stages
from torch_multinode.netcheck.attempts import (
    PORTS_TIMEOUT,
    SOFTPROBE,
    Attempt,
    Options,
    attempt,
    parallel,
)
from torch_multinode.netcheck.checks import addressing, reach, software, traffic
from torch_multinode.netcheck.collective import IMPORT_TIMEOUT
from torch_multinode.netcheck.report import BANDWIDTH, CHECKS, Finding, Report, Status

SSH_TIMEOUT = 10.0
FACTS_TIMEOUT = 20.0


def preflight(
    inventory: Inventory, options: Options, nodes: Nodes, context: Context | None = None
) -> Report:
    started = time.monotonic()
    inventory = inventory.first(options.nnodes)  # the checked nodes, once
    hosts = list(inventory.hosts)
    context = context or context_for(inventory, nodes.ship_code(hosts))
    names = [h.name for h in hosts]
    master = inventory.master
    rendezvous = str(master.compute_ip)
    subnet = str(inventory.compute_subnet)
    token = f"netcheck-{uuid.uuid4().hex[:12]}"
    report = Report(
        str(inventory.path),
        names,
        master.name,
        f"{rendezvous}:{inventory.rendezvous_port}",
        context.where(master),
    )
    add = report.findings.extend

    # 1. SSH, in batch mode with a short connect timeout; on a node whose inventory entry
    # says auto, the same round trip finds those values (a node where one is not found is a
    # FAIL, and is left out of the later stages like a node that does not answer).
    ssh = parallel(
        hosts,
        lambda h: attempt(
            nodes, h, autodetect.probe_command(h) if autodetect.wanted(h) else "true", SSH_TIMEOUT
        ),
    )
    for host in hosts:
        a = ssh[host.name]
        add([reach.ssh_finding(host, None if a.ok else a.why(), a.seconds)])
    down = [h.name for h in hosts if not ssh[h.name].ok]
    found, unfound = _found_on_nodes(report, hosts, ssh)
    if found:
        hosts = [found[h.name].apply(h) if h.name in found else h for h in hosts]
        inventory = replace(inventory, hosts=tuple(hosts))
        master = inventory.master
    up = [h for h in hosts if ssh[h.name].ok and h.name not in unfound]

    # 2, 3, 5. One round trip per node for names, interfaces, routes and pings.
    gathered = parallel(
        up, lambda h: attempt(nodes, h, facts.script(h, hosts, rendezvous), FACTS_TIMEOUT)
    )
    node_facts: dict[str, facts.NodeFacts] = {}
    for name, a in gathered.items():
        if a.ok:
            node_facts[name] = facts.parse(a.stdout)
        else:
            for check in ("ping", "names", "interfaces"):
                add(
                    [
                        Finding(
                            check,
                            name,
                            Status.FAIL,
                            f"could not gather facts: {a.why()}",
                            f"on {name}: check that a POSIX shell, iproute2 and getent are "
                            f"installed",
                        )
                    ]
                )
    interfaces = addressing.interface_findings(hosts, node_facts, master)
    add(reach.ping_findings(hosts, node_facts, interfaces.broken, subnet, set(down)))
    add(addressing.name_findings(hosts, node_facts, rendezvous, master))
    add(interfaces.findings)
    report.env = interfaces.env
    report.nic_speed_mbps = interfaces.speeds

    # Slurm, on a Slurm inventory: the controller knows every node, ready; munge works.
    if inventory.scheduler == "slurm":
        add(_slurm(inventory, nodes, hosts, up, master))

    # 4. Ports, for real: listen on the rendezvous port and a random one, connect from peers.
    add(
        stages.ports(
            nodes, hosts, up, master, inventory.rendezvous_port, interfaces.broken, subnet, token
        )
    )

    # FT=1 jobs: every node reaches the lighthouse's port on this machine.
    if options.ft:
        add(stages.lighthouse(nodes, hosts, up, inventory.lighthouse_port))

    # 6, 7. Raw TCP and the collective need every node, with working ports and interfaces.
    # The collective's workers also report the software facts, so that each node imports torch
    # once; where they cannot run (or did not get that far) the software probe runs alone.
    blocked = _blocked(report, down, unfound)
    measure_tcp = (options.sweep or options.pairwise) and len(hosts) > 1
    stacks: dict[str, dict | str] = {}
    if measure_tcp and blocked:
        add(checks.skipped(BANDWIDTH, names, blocked))
    elif measure_tcp:
        report.ring, report.pairwise = stages.tcp(nodes, hosts, options, token)
    if blocked:
        add(checks.skipped("collective", names, blocked))
    else:
        stacks = stages.collective(report, nodes, context, hosts, options, token)
    alone = [h for h in up if not isinstance(stacks.get(h.name), dict)]
    probed = parallel(
        alone,
        lambda h: attempt(
            nodes,
            h,
            context.wrap(h, python_command(context.python(h), SOFTPROBE), token),
            IMPORT_TIMEOUT + 10,
        ),
    )
    leftover = context.cleanup(token)
    if leftover and any(not a.ok for a in probed.values()):
        parallel(up, lambda h: attempt(nodes, h, leftover, PORTS_TIMEOUT))
    for name, a in probed.items():
        stacks[name] = a.json() or a.why()
    for name, stack in stacks.items():
        if isinstance(stack, dict):
            stack["infiniband"] = node_facts[name].infiniband if name in node_facts else []
    add(software.software_findings(hosts, {h.name: stacks[h.name] for h in up}, master, context))
    if measure_tcp and not blocked:
        add(
            traffic.bandwidth_findings(
                hosts,
                master,
                report.measurements,
                report.ring,
                report.pairwise,
                report.nic_speed_mbps,
                {
                    name: f.speed_mbps
                    for name, f in node_facts.items()
                    if f.physical and f.speed_mbps
                },
            )
        )

    for name in names:
        for check in CHECKS:
            if report.cell(name, check) is None:
                if name in down:
                    reason = f"not checked: {name} does not answer over SSH"
                elif name in unfound:
                    reason = f"not checked: {unfound[name]}"
                elif len(names) == 1:
                    reason = "not checked: a single node has no peer"
                else:
                    reason = "not checked"
                add([Finding(check, name, Status.SKIP, reason)])
    report.seconds = time.monotonic() - started
    return report


def _found_on_nodes(
    report: Report, hosts: list[Host], ssh: dict[str, Attempt]
) -> tuple[dict[str, autodetect.Found], dict[str, str]]:
    """The auto values each answering node said in the ssh stage (cluster.autodetect), and
    the nodes where one was not found, with why (for the later stages' SKIPs). What was found
    goes into the report; a value not found is a FAIL of that node (interfaces for
    compute_interface, software for gpus)."""
    found: dict[str, autodetect.Found] = {}
    unfound: dict[str, str] = {}
    for host in hosts:
        wanted = autodetect.wanted(host)
        if not wanted or not ssh[host.name].ok:
            continue
        answer = found[host.name] = autodetect.parse(host, ssh[host.name].stdout)
        report.found[host.name] = {
            **({"compute_interface": answer.interface} if "compute_interface" in wanted else {}),
            **({"gpus": answer.gpus, "gpus_from": answer.gpus_from} if "gpus" in wanted else {}),
        }
        if answer.error is None:
            continue
        lost = "compute_interface" in wanted and answer.interface is None
        check = "interfaces" if lost else "software"
        report.findings.append(
            Finding(
                check,
                host.name,
                Status.FAIL,
                str(answer.error).removeprefix(f"host '{host.name}': "),
                f"on {host.name}: {answer.remedy}",
            )
        )
        unfound[host.name] = f"an auto value of {host.name} was not found (see {check})"
    return found, unfound


def _blocked(report: Report, down: list[str], unfound: dict[str, str] | None = None) -> str | None:
    """Why the stages that need every node cannot run, or None."""
    if down:
        return f"needs every node; {', '.join(down)} does not answer over SSH"
    if unfound:
        return f"needs every node; {', '.join(unfound)}: auto values not found"
    failing = sorted(
        {
            f.node
            for f in report.findings
            if f.check in ("ports", "interfaces") and f.status is Status.FAIL
        },
        key=report.nodes.index,
    )
    if failing:
        return f"skipped until the ports/interfaces FAILs on {', '.join(failing)} are fixed"
    return None


def _slurm(
    inventory: Inventory, nodes: Nodes, hosts: list[Host], up: list[Host], master: Host
) -> list[Finding]:
    if master not in up:
        return checks.skipped(slurm.CHECK, [h.name for h in hosts], f"{master.name} is down")
    sinfo = attempt(nodes, master, slurm.SINFO, PORTS_TIMEOUT)
    munge = parallel(up, lambda h: attempt(nodes, h, slurm.MUNGE, PORTS_TIMEOUT))
    found = slurm.findings(
        inventory,
        up,
        master,
        (sinfo.stdout, None) if sinfo.ok else (None, sinfo.why()),
        {name: None if a.ok else a.why() for name, a in munge.items()},
    )
    down = [h.name for h in hosts if h not in up]
    return found + (checks.skipped(slurm.CHECK, down, "no SSH") if down else [])
