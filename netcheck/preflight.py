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

A node that does not answer is reported and left out of the later stages; a stage that needs
every node (TCP, the collective) is then skipped with the reason. Nothing here prints: the
result is a Report, and cluster.remote's UserError never escapes (it becomes a finding).
"""

from __future__ import annotations

import json
import shlex
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from torch_multinode.cluster import autodetect, sync
from torch_multinode.cluster.execution import Context, Nodes, context_for, python_command
from torch_multinode.cluster.inventory import Host, Inventory
from torch_multinode.cluster.remote import Result, on_all
from torch_multinode.netcheck import bandwidth, checks, envfile, facts, slurm
from torch_multinode.netcheck.checks import addressing, reach, software, traffic
from torch_multinode.netcheck.collective import IMPORT_TIMEOUT, RESULT_PREFIX
from torch_multinode.netcheck.report import BANDWIDTH, CHECKS, Finding, Link, Report, Status

HERE = Path(__file__).resolve().parent
SOCKPROBE = (HERE / "sockprobe.py").read_text()
SOFTPROBE = (HERE / "softprobe.py").read_text()
NODE_PYTHON = "python3"  # what Ansible needs on every node anyway; runs the stdlib probes

SSH_TIMEOUT = 10.0
FACTS_TIMEOUT = 20.0
PORT_CONNECT_TIMEOUT = 2.0
PORTS_TIMEOUT = 15.0
LISTENER_LIFETIME = 30.0
DEFAULT_TIMEOUT = 30.0
DEFAULT_SWEEP_TIMEOUT = 120.0
TCP_BYTES = 128 << 20
PAIRWISE_BYTES = 64 << 20


@dataclass(frozen=True)
class Options:
    nnodes: int | None = None
    """How many hosts, in inventory order (default: all)."""
    sweep: bool = False
    """Message sizes up to 64 MiB, and raw TCP around the ring to compare against."""
    pairwise: bool = False
    """Raw TCP between every pair of nodes, one pair at a time: finds the slow link."""
    timeout: float | None = None
    """Wall-clock seconds for each torch stage on a node (default 30, with the sweep 120)."""
    tcp_bytes: int = TCP_BYTES
    pairwise_bytes: int = PAIRWISE_BYTES

    @property
    def stage_timeout(self) -> float:
        if self.timeout is not None:
            return self.timeout
        return DEFAULT_SWEEP_TIMEOUT if self.sweep else DEFAULT_TIMEOUT


@dataclass(frozen=True)
class Attempt:
    result: Result | None
    error: str | None
    seconds: float

    @property
    def ok(self) -> bool:
        return self.error is None and self.result is not None and self.result.ok

    @property
    def stdout(self) -> str:
        """What the command printed; asked of one that ran (`ok`)."""
        assert self.result is not None, "the command did not run"
        return self.result.stdout

    def why(self) -> str:
        """Why the command did not succeed, in one line."""
        if self.error is not None:
            return self.error
        assert self.result is not None
        return f"exit {self.result.exit_code}: {self.result.last_line or 'no output'}"

    def json(self, prefix: str = "") -> dict | None:
        """The last JSON line of stdout (after `prefix`), or None."""
        found = self.json_lines(prefix)
        return found[-1] if found else None

    def json_lines(self, prefix: str = "") -> list[dict]:
        """Every JSON object line of stdout that starts with `prefix`, in order."""
        found = []
        for line in self.result.stdout.splitlines() if self.result is not None else []:
            if line.startswith(prefix) and line[len(prefix) :].lstrip().startswith("{"):
                try:
                    found.append(json.loads(line[len(prefix) :]))
                except json.JSONDecodeError:
                    continue
        return found


def attempt(nodes: Nodes, host: Host, command: str, timeout: float) -> Attempt:
    started = time.monotonic()
    try:
        result = nodes.run(host, command, timeout)
    except Exception as exc:  # noqa: BLE001 - UserError, or anything else a dead link throws
        message = str(exc) or type(exc).__name__
        return Attempt(
            None, message.removeprefix(f"host '{host.name}': "), time.monotonic() - started
        )
    return Attempt(result, None, time.monotonic() - started)


def _parallel(hosts: list[Host], work: Callable[[Host], Attempt]) -> dict[str, Attempt]:
    return on_all(hosts, work) if hosts else {}


def sockprobe(*args: str) -> str:
    return python_command(NODE_PYTHON, SOCKPROBE, *args)


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
    ssh = _parallel(
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
    gathered = _parallel(
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
        _ports(
            nodes, hosts, up, master, inventory.rendezvous_port, interfaces.broken, subnet, token
        )
    )

    # 6, 7. Raw TCP and the collective need every node, with working ports and interfaces.
    # The collective's workers also report the software facts, so that each node imports torch
    # once; where they cannot run (or did not get that far) the software probe runs alone.
    blocked = _blocked(report, down, unfound)
    measure_tcp = (options.sweep or options.pairwise) and len(hosts) > 1
    stacks: dict[str, dict | str] = {}
    if measure_tcp and blocked:
        add(checks.skipped(BANDWIDTH, names, blocked))
    elif measure_tcp:
        report.ring, report.pairwise = _tcp(nodes, hosts, options, token)
    if blocked:
        add(checks.skipped("collective", names, blocked))
    else:
        stacks = _collective(report, nodes, context, hosts, options, token)
    alone = [h for h in up if not isinstance(stacks.get(h.name), dict)]
    probed = _parallel(
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
        _parallel(up, lambda h: attempt(nodes, h, leftover, PORTS_TIMEOUT))
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


def _ports(
    nodes: Nodes,
    hosts: list[Host],
    up: list[Host],
    master: Host,
    rendezvous_port: int,
    broken: set[str],
    subnet: str,
    token: str,
) -> list[Finding]:
    pidfile = f"/tmp/{token}-ports.pid"
    serving = _parallel(
        up,
        lambda h: attempt(
            nodes,
            h,
            sockprobe(
                "serve",
                "--ports",
                f"{rendezvous_port},0",
                "--lifetime",
                str(LISTENER_LIFETIME),
                "--pidfile",
                pidfile,
                "--token",
                token,
            ),
            PORTS_TIMEOUT,
        ),
    )
    listeners: dict[str, reach.Listening] = {}
    for name, a in serving.items():
        data = a.json()
        if data is None:
            listeners[name] = reach.Listening(name, [], a.why())
        else:
            listeners[name] = reach.Listening(name, data.get("ports", []))
    try:

        def connect(host: Host) -> Attempt:
            targets = [
                f"{peer.name}={peer.compute_ip}:{port['port']}"
                for peer in up
                if peer.name != host.name and not listeners[peer.name].error
                for port in listeners[peer.name].ports
                if port.get("ok")
            ]
            if not targets:
                return Attempt(Result(host.name, "", 0, '{"results": []}', ""), None, 0.0)
            return attempt(
                nodes,
                host,
                sockprobe(
                    "connect",
                    "--targets",
                    ",".join(targets),
                    "--source",
                    str(host.compute_ip),
                    "--timeout",
                    str(PORT_CONNECT_TIMEOUT),
                ),
                PORTS_TIMEOUT,
            )

        connected = _parallel(up, connect)
    finally:
        _parallel(
            [h for h in up if not listeners[h.name].error],
            lambda h: attempt(
                nodes, h, sockprobe("stop", "--pidfile", pidfile, "--token", token), PORTS_TIMEOUT
            ),
        )
    connects: dict[str, list[dict] | str] = {}
    for name, a in connected.items():
        data = a.json()
        connects[name] = data["results"] if data is not None else a.why()
    return reach.port_findings(hosts, master, rendezvous_port, listeners, connects, broken, subnet)


def _tcp(
    nodes: Nodes, hosts: list[Host], options: Options, token: str
) -> tuple[list[Link], list[Link]]:
    """Raw TCP: every node sends to the next at once (the ring), then each pair on its own."""
    pidfile = f"/tmp/{token}-tcp.pid"
    budget = options.stage_timeout
    pairs = (
        [(a, b) for i, a in enumerate(hosts) for b in hosts[i + 1 :]] if options.pairwise else []
    )
    lifetime = budget * (1 + len(pairs)) + 30
    serving = _parallel(
        hosts,
        lambda h: attempt(
            nodes,
            h,
            sockprobe(
                "serve",
                "--ports",
                "0",
                "--lifetime",
                str(lifetime),
                "--pidfile",
                pidfile,
                "--token",
                token,
            ),
            PORTS_TIMEOUT,
        ),
    )
    ports: dict[str, int | None] = {}
    for name, a in serving.items():
        data = a.json() or {}
        bound = [p["port"] for p in data.get("ports", []) if p.get("ok")]
        ports[name] = bound[0] if bound else None

    def send(source: Host, target: Host, nbytes: int) -> Link:
        if ports[target.name] is None:
            return Link(
                source.name,
                target.name,
                nbytes,
                None,
                f"no listener on {target.name}: {serving[target.name].why()}",
            )
        a = attempt(
            nodes,
            source,
            sockprobe(
                "send",
                "--targets",
                f"{target.name}={target.compute_ip}:{ports[target.name]}",
                "--source",
                str(source.compute_ip),
                "--bytes",
                str(nbytes),
                "--timeout",
                str(budget),
            ),
            budget + 15,
        )
        data = a.json()
        if data is None or not data.get("results"):
            return Link(source.name, target.name, nbytes, None, a.why())
        r = data["results"][0]
        return Link(
            source.name,
            target.name,
            nbytes,
            r.get("seconds"),
            None if r.get("ok") else r.get("error"),
        )

    ring: list[Link] = []
    pairwise: list[Link] = []
    try:
        if options.sweep:
            after = {h.name: hosts[(i + 1) % len(hosts)] for i, h in enumerate(hosts)}
            sent = on_all(hosts, lambda h: send(h, after[h.name], options.tcp_bytes))
            ring = list(sent.values())
        for first, second in pairs:
            peer = {first.name: second, second.name: first}

            def to_peer(h: Host, peer: dict[str, Host] = peer) -> Link:
                return send(h, peer[h.name], options.pairwise_bytes)

            both = on_all([first, second], to_peer)
            pairwise += [both[first.name], both[second.name]]
    finally:
        _parallel(
            [h for h in hosts if ports[h.name]],
            lambda h: attempt(
                nodes, h, sockprobe("stop", "--pidfile", pidfile, "--token", token), PORTS_TIMEOUT
            ),
        )
    return ring, pairwise


def worker_command(
    host: Host,
    rank: int,
    hosts: list[Host],
    master_port: int,
    sizes: tuple[int, ...],
    stage_timeout: float,
    env: dict[str, str],
    python: str,
    token: str,
) -> str:
    """The torch worker for one rank, as the node's shell runs it (without the wall clock)."""
    args = [
        python,
        "-m",
        "torch_multinode.netcheck.collective",
        "--rank",
        str(rank),
        "--world-size",
        str(len(hosts)),
        "--master-addr",
        str(hosts[0].compute_ip),
        "--master-port",
        str(master_port),
        *(["--allow-nccl"] if all(h.gpu_count > 0 for h in hosts) else []),
        "--sizes",
        bandwidth.sizes_text(sizes),
        "--timeout",
        f"{stage_timeout:g}",
        "--token",
        token,
    ]
    variables = [f"{k}={shlex.quote(v)}" for k, v in sorted(env.items())]
    return " ".join(["env", *variables, *(shlex.quote(a) for a in args)])


def wall_clock(command: str, seconds: float, pidfile: str) -> str:
    """Run `command` under coreutils timeout, its pid in `pidfile` so leftovers can be ended."""
    return (
        f"timeout -k 5 {seconds:g} {command} & echo $! > {shlex.quote(pidfile)}; "
        f"wait $!; rc=$?; rm -f {shlex.quote(pidfile)}; exit $rc"
    )


def _slurm(
    inventory: Inventory, nodes: Nodes, hosts: list[Host], up: list[Host], master: Host
) -> list[Finding]:
    if master not in up:
        return checks.skipped(slurm.CHECK, [h.name for h in hosts], f"{master.name} is down")
    sinfo = attempt(nodes, master, slurm.SINFO, PORTS_TIMEOUT)
    munge = _parallel(up, lambda h: attempt(nodes, h, slurm.MUNGE, PORTS_TIMEOUT))
    found = slurm.findings(
        inventory,
        up,
        master,
        (sinfo.stdout, None) if sinfo.ok else (None, sinfo.why()),
        {name: None if a.ok else a.why() for name, a in munge.items()},
    )
    down = [h.name for h in hosts if h not in up]
    return found + (checks.skipped(slurm.CHECK, down, "no SSH") if down else [])


def _collective(
    report: Report, nodes: Nodes, context: Context, hosts: list[Host], options: Options, token: str
) -> dict[str, dict | str]:
    """Run the workers; record the collective's findings. Returns what each worker reported
    of its software (the probe's facts), or why it did not."""
    master = hosts[0]
    names = [h.name for h in hosts]
    free = attempt(
        nodes, master, sockprobe("freeport", "--bind", str(master.compute_ip)), PORTS_TIMEOUT
    )
    port = (free.json() or {}).get("port")
    if not port:
        report.findings.extend(checks.skipped("collective", names[1:], "skipped: no free port"))
        report.findings.append(
            Finding(
                "collective",
                master.name,
                Status.FAIL,
                f"cannot find a free port on {master.compute_ip}: {free.why()}",
                f"on {master.name}: check that {master.compute_ip} is assigned there",
            )
        )
        return {}
    sizes = bandwidth.SWEEP_SIZES if options.sweep else bandwidth.QUICK_SIZES
    stage = options.stage_timeout
    # The watchdog inside each worker ends a hung stage; this only bounds a worker gone wrong.
    outer = IMPORT_TIMEOUT + 3 * stage
    pidfile = f"/tmp/{token}-collective.pid"
    # The worker imports netcheck from where the CLI sent it (the image holds no project code).
    code_dir = getattr(context, "code_dir", None)
    code = {"PYTHONPATH": sync.tool_import_path(code_dir)} if code_dir else {}
    network = envfile.one_network(report.env)[0]  # as a job on these nodes would run
    commands = {
        h.name: worker_command(
            h,
            rank,
            hosts,
            port,
            sizes,
            stage,
            {**network.get(h.name, {}), **code},
            context.python(h),
            token,
        )
        for rank, h in enumerate(hosts)
    }
    try:
        ran = on_all(
            hosts,
            lambda h: attempt(
                nodes,
                h,
                context.wrap(h, wall_clock(commands[h.name], outer, pidfile), token),
                outer + 15,
            ),
        )
    finally:
        # Whatever is left of a worker that did not end on its own: by pid (host) or label
        # (container), never by name.
        stop = sockprobe("stop", "--pidfile", pidfile, "--token", token)
        extra = context.cleanup(token)
        on_all(
            hosts, lambda h: attempt(nodes, h, f"{stop}; {extra}" if extra else stop, PORTS_TIMEOUT)
        )
    results: dict[str, dict | str] = {}
    stacks: dict[str, dict | str] = {}
    for name, a in ran.items():
        lines = a.json_lines(RESULT_PREFIX)
        stack = next((line["software"] for line in lines if "software" in line), None)
        stacks[name] = stack if stack is not None else a.why()
        final = next((line for line in reversed(lines) if "ok" in line), None)
        if final is not None:
            results[name] = final
        elif a.result is not None and a.result.exit_code == 124:
            results[name] = f"killed after {outer:g} s (wall clock)"
        else:
            results[name] = a.why()
    rank0 = results.get(master.name)
    report.backend = rank0.get("backend", "gloo") if isinstance(rank0, dict) else "gloo"
    report.findings.extend(
        traffic.collective_findings(hosts, results, report.backend, commands, stacks)
    )
    report.transport = {
        name: r["transport"]
        for name, r in results.items()
        if isinstance(r, dict) and isinstance(r.get("transport"), dict)
    }
    report.findings.extend(traffic.transport_findings(hosts, results, report.backend))
    if isinstance(rank0, dict) and rank0.get("results"):
        report.measurements = traffic.measurements(rank0["results"], len(hosts))
    return stacks
