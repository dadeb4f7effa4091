"""The stages of the pre-flight run that start processes on the nodes and end them again:
ports (sockprobe listens on the rendezvous port and a random one on every node, every peer
connects), raw TCP (--sweep: every node sends to the next at once, the ring; --pairwise: each
pair alone), and the collective (one torch worker per node, `worker_command`, under a wall
clock, `wall_clock`; each first reports its node's software facts). Whatever a stage leaves
running is ended by pid or label, never by name.

netcheck.preflight runs them in order, and only where they can run; what they find is judged
in netcheck.checks (reach, traffic). The node side is netcheck.sockprobe and
netcheck.collective.
"""

from __future__ import annotations

import shlex

from torch_multinode.cluster import routes, sync
from torch_multinode.cluster.execution import Context, Nodes
from torch_multinode.cluster.inventory import Host
from torch_multinode.cluster.remote import Result, on_all
from torch_multinode.netcheck import bandwidth, checks, envfile
from torch_multinode.netcheck import sockprobe as sockprobe_module
from torch_multinode.netcheck.attempts import (
    PORTS_TIMEOUT,
    Attempt,
    Options,
    attempt,
    parallel,
    sockprobe,
)
from torch_multinode.netcheck.checks import reach, traffic
from torch_multinode.netcheck.collective import IMPORT_TIMEOUT, RESULT_PREFIX
from torch_multinode.netcheck.report import Finding, Link, Report, Status

PORT_CONNECT_TIMEOUT = 2.0
LISTENER_LIFETIME = 30.0


def ports(
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
    serving = parallel(
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

        connected = parallel(up, connect)
    finally:
        parallel(
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


def lighthouse(nodes: Nodes, hosts: list[Host], up: list[Host], port: int) -> list[Finding]:
    """--ft: this machine listens on the lighthouse port (as an FT=1 job's torchft lighthouse
    will, on the address each node reaches it at), every node that answers connects."""
    addresses = {host.name: routes.address_towards(host) for host in up}
    listener, refused = sockprobe_module.listen(port)
    if listener is None:
        return [reach.lighthouse_port_taken(host, port, refused) for host in up]
    try:

        def connect(host: Host) -> Attempt:
            target = f"controller={addresses[host.name]}:{port}"
            return attempt(
                nodes,
                host,
                sockprobe("connect", "--targets", target, "--timeout", str(PORT_CONNECT_TIMEOUT)),
                PORTS_TIMEOUT,
            )

        connected = parallel(up, connect)
    finally:
        listener.close()
    return [
        reach.lighthouse_finding(host, addresses[host.name], port, connected[host.name])
        for host in up
    ]


def tcp(
    nodes: Nodes, hosts: list[Host], options: Options, token: str
) -> tuple[list[Link], list[Link]]:
    """Raw TCP: every node sends to the next at once (the ring), then each pair on its own."""
    pidfile = f"/tmp/{token}-tcp.pid"
    budget = options.stage_timeout
    pairs = (
        [(a, b) for i, a in enumerate(hosts) for b in hosts[i + 1 :]] if options.pairwise else []
    )
    lifetime = budget * (1 + len(pairs)) + 30
    serving = parallel(
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
        parallel(
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


def collective(
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
