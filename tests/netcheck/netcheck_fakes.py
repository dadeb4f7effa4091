"""A fake cluster for netcheck's unit tests: answers each command netcheck sends as a healthy
node would, with knobs to break one thing. No network, no SSH.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from tests import helpers
from tests.fakes import FakeNodes, autodetect_answer, is_autodetect_probe
from tests.helpers import node
from torch_multinode.cluster.containers import NCCL_CONF_GUARD
from torch_multinode.cluster.inventory import Host
from torch_multinode.cluster.inventory_read import parse
from torch_multinode.cluster.remote import Result
from torch_multinode.netcheck import attempts, slurm

REPO_ROOT = Path(__file__).resolve().parents[2]
NETCHECK = Path(sys.executable).parent / "netcheck"


def run_netcheck(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """The installed console script, as the Makefile runs it."""
    return subprocess.run(
        [str(NETCHECK), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO_ROOT,
        check=False,
    )


def inventory_text(launch_mode="host"):
    """Three nodes: SSH on 10.8.0.1N, compute on 10.9.0.1N over eth1."""
    hosts = {
        f"node{n}": node(n, ansible_host=f"10.8.0.1{n}", compute_ip=f"10.9.0.1{n}")
        for n in (1, 2, 3)
    }
    return helpers.inventory_text(
        hosts,
        compute_subnet="10.9.0.0/24",
        rendezvous_port=29500,
        launch_mode=launch_mode,
        training_python="/opt/venv/bin/python",
    )


INVENTORY = inventory_text()


def inventory(path="/nonexistent/inventory.yml", launch_mode="host"):
    return parse(inventory_text(launch_mode), path)


def link(name, ip=None, mtu=1500, flags=("BROADCAST", "MULTICAST", "UP", "LOWER_UP")):
    item = {"ifname": name, "flags": list(flags), "mtu": mtu, "operstate": "UP"}
    item["addr_info"] = [{"family": "inet", "local": ip, "prefixlen": 24}] if ip else []
    return item


def ping_ok(ip, rtt=0.1, best=None):
    """Five replies averaging `rtt` ms, the fastest `best` (by default four fifths of it)."""
    best = round(rtt * 0.8, 3) if best is None else best
    return (
        f"PING {ip} ({ip}) 56(84) bytes of data.\n\n--- {ip} ping statistics ---\n"
        f"5 packets transmitted, 5 received, 0% packet loss, time 818ms\n"
        f"rtt min/avg/max/mdev = {best}/{rtt}/{max(rtt, best) * 1.5:g}/0.014 ms\n"
    )


def ping_lost(ip):
    return (
        f"PING {ip} ({ip}) 56(84) bytes of data.\n\n--- {ip} ping statistics ---\n"
        f"7 packets transmitted, 0 received, 100% packet loss, time 1888ms\n"
    )


def getent(ip, name):
    return f"{ip}   STREAM {name}\n{ip}   DGRAM  \n{ip}   RAW    \n"


def facts_text(hostname, resolved, links, routes, pings, speed="10000", infiniband="", device=""):
    parts = [f"@@hostname\n{hostname}", f"@@fqdn\n{hostname}"]
    for name, ips in resolved.items():
        parts.append(f"@@resolve {name}\n" + "".join(getent(ip, name) for ip in ips))
    parts.append("@@links\n" + json.dumps(links))
    for ip, route in routes.items():
        body = route if isinstance(route, str) else json.dumps([route])
        parts.append(f"@@route {ip}\n{body}")
    parts += [f"@@speed\n{speed}", f"@@device\n{device}", f"@@infiniband\n{infiniband}"]
    for name, text in pings.items():
        parts.append(f"@@ping {name}\n{text}")
    return "\n".join(parts) + "\n"


@dataclass
class FakeCluster(FakeNodes):
    """Healthy unless told otherwise (`down`: FakeNodes'); `calls` records (node, kind) in
    order."""

    held_port: dict[str, dict] = field(default_factory=dict)
    firewalled: set[str] = field(default_factory=set)
    """Nodes that drop new TCP connections to high ports from peers."""
    loopback_name: set[str] = field(default_factory=set)
    mtu: dict[str, int] = field(default_factory=dict)
    torch: dict[str, str] = field(default_factory=dict)
    slurm_state: dict[str, str] = field(default_factory=dict)
    """Per node, sinfo's 'STATE|REASON' (default idle|none)."""
    slurm_unknown: set[str] = field(default_factory=set)
    munge_broken: set[str] = field(default_factory=set)
    broken_worker: set[str] = field(default_factory=set)
    """Nodes where `python -m netcheck.collective` does not start."""
    nccl_transport: dict[str, dict] = field(default_factory=dict)
    """Per node, the `transport` its worker reports (see fake_transport); when set, the
    collective ran on NCCL. A node missing from it reports no transport."""
    infiniband: dict[str, str] = field(default_factory=dict)
    """Per node, the RDMA devices /sys/class/infiniband lists (default none)."""
    addresses: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    """Per node, its interfaces' IPv4 addresses as cluster.autodetect's probe finds them
    (default: lo, eth0 at the SSH address, eth1 at compute_ip)."""
    nvidia_smi: dict[str, int | str] = field(default_factory=dict)
    """Per node, nvidia-smi's GPU count for that probe, or what it says failing (default: no
    nvidia-smi)."""
    calls: list[tuple[str, str]] = field(default_factory=list)
    surprises: list[str] = field(default_factory=list)
    """Commands the fake did not recognise: netcheck swallows errors, so tests check this."""

    def __post_init__(self):
        super().__post_init__()
        self.by_name = {h.name: h for h in self.hosts}
        self.by_ip = {str(h.compute_ip): h for h in self.hosts}

    def respond(self, host: Host, command: str) -> Result | str:
        guarded = f"{NCCL_CONF_GUARD} && docker run "
        if command.startswith(guarded):
            # The training container (after its check for NCCL's file): answer for what runs
            # inside it.
            self.calls.append((host.name, "docker run"))
            command = shlex.split(command.removeprefix(f"{NCCL_CONF_GUARD} && "))[-1]
        if host.name not in self.by_name:
            self.surprises.append(f"{host.name} is not in this fake cluster")
        try:
            kind = self.kind(command)
        except (AssertionError, IndexError, ValueError):
            self.surprises.append(command[:200])
            raise
        self.calls.append((host.name, kind))
        if host.name in self.down:
            return ""  # FakeNodes.run raises: the node does not answer
        return getattr(self, "on_" + kind)(host, command)

    @staticmethod
    def kind(command: str) -> str:
        if command == "true":
            return "true"
        if is_autodetect_probe(command):
            return "autodetect"
        if command.startswith('echo "kernel='):
            return "versions"
        if command.startswith("docker ps"):
            return "docker cleanup"
        if command.startswith("export LC_ALL=C"):
            return "facts"
        if "netcheck.collective" in command:
            return "collective"
        if command == slurm.SINFO:
            return "sinfo"
        if command == slurm.MUNGE:
            return "munge"
        argv = shlex.split(command.rsplit("; docker ps", 1)[0])
        if argv[2] == attempts.SOFTPROBE:
            return "software"
        assert argv[2] == attempts.SOCKPROBE, command[:80]
        return argv[3]

    def on_true(self, host, command):
        return ""

    def on_autodetect(self, host, command):
        return autodetect_answer(
            host, command, self.addresses.get(host.name), self.nvidia_smi.get(host.name)
        )

    def on_versions(self, host, command):
        """cluster.version_lock's probe: a CPU node in host mode."""
        return "kernel=6.1.0-fake\ndriver=none\ndocker=27.3.1\ntorch=2.14.1+cpu\nnccl=none\n"

    def on_sinfo(self, host, command):
        return "".join(
            f"{h.name}|{self.slurm_state.get(h.name, 'idle|none')}\n"
            for h in self.hosts
            if h.name not in self.slurm_unknown
        )

    def on_munge(self, host, command):
        if host.name in self.munge_broken:
            return Result(host.name, command, 1, "", "unmunge: Error: Socket communication error")
        return ""

    def on_facts(self, host, command):
        me = str(host.compute_ip)
        resolved = {"own hostname": [me], "own FQDN": [me]}
        for h in self.hosts:
            resolved[h.name] = [str(h.compute_ip)]
        if host.name in self.loopback_name:
            resolved["own hostname"] = ["127.0.1.1", me]
            resolved["own FQDN"] = ["127.0.1.1", me]
            resolved[host.name] = ["127.0.1.1", me]
        resolved[str(self.hosts[0].compute_ip)] = [str(self.hosts[0].compute_ip)]
        links = [
            link("lo", "127.0.0.1", 65536),
            link("eth0", host.ssh_address),
            link("eth1", me, self.mtu.get(host.name, 1500)),
        ]
        routes, pings = {}, {}
        for peer in self.hosts:
            if peer.name == host.name:
                continue
            ip = str(peer.compute_ip)
            routes[ip] = {"dst": ip, "dev": "eth1", "prefsrc": me}
            pings[peer.name] = ping_lost(ip) if peer.name in self.down else ping_ok(ip)
        infiniband = self.infiniband.get(host.name, "")
        return facts_text(host.name, resolved, links, routes, pings, infiniband=infiniband)

    def on_serve(self, host, command):
        argv = shlex.split(command)
        ports = [int(p) for p in argv[argv.index("--ports") + 1].split(",")]
        results = []
        for i, port in enumerate(ports):
            held = self.held_port.get(host.name)
            if held and port == held["port"]:
                results.append(
                    {
                        "requested": port,
                        "ok": False,
                        "error": "Address already in use",
                        "in_use": True,
                        "holders": held["holders"],
                    }
                )
            else:
                results.append({"requested": port, "ok": True, "port": port or 40000 + i})
        return json.dumps({"pid": 4242, "ports": results}) + "\n"

    def on_connect(self, host, command):
        argv = shlex.split(command)
        results = []
        for item in argv[argv.index("--targets") + 1].split(","):
            name, address = item.split("=")
            ip, port = address.rsplit(":", 1)
            result = {"name": name, "ip": ip, "port": int(port), "ok": True, "bytes": 0}
            if name in self.firewalled and int(port) >= 32768:
                result.update(ok=False, error="timed out")
            results.append(result)
        return json.dumps({"results": results}) + "\n"

    def on_send(self, host, command):
        argv = shlex.split(command)
        name = argv[argv.index("--targets") + 1].split("=")[0]
        nbytes = int(argv[argv.index("--bytes") + 1])
        return (
            json.dumps(
                {"results": [{"name": name, "ok": True, "bytes": nbytes, "seconds": nbytes / 1e9}]}
            )
            + "\n"
        )

    def on_docker_cleanup(self, host, command):
        return ""

    def on_stop(self, host, command):
        return '{"stopped": true, "pid": 4242}\n'

    def on_freeport(self, host, command):
        return '{"port": 45555}\n'

    def on_software(self, host, command):
        return json.dumps(self.stack(host)) + "\n"

    def stack(self, host):
        return {
            "python": "3.11.2",
            "executable": host.python,
            "torch": self.torch.get(host.name, "2.14.1+cu130"),
            "cuda": "13.0",
            "cuda_available": False,
            "gpus": 0,
            "nccl": "2.30.7",
            "gloo": True,
            "nccl_backend": True,
            "netcheck": True,
            "shm_bytes": 64 << 20,
            "memlock_bytes": 8 << 20,
            "nvidia_smi_gpus": None,
        }

    def on_collective(self, host, command):
        if host.name in self.broken_worker:
            return Result(
                host.name, command, 1, "", f"{host.python}: No module named netcheck.collective\n"
            )
        if self.broken_worker:
            return (
                "NETCHECK "
                + json.dumps({"rank": 0, "software": self.stack(host)})
                + (
                    "\nNETCHECK "
                    + json.dumps(
                        {
                            "rank": 0,
                            "ok": False,
                            "stage": "init_process_group",
                            "error": "init_process_group did not finish within 30 s",
                        }
                    )
                    + "\n"
                )
            )
        argv = shlex.split(command.split(" & ")[0])
        rank = int(argv[argv.index("--rank") + 1])
        sizes = [int(s) for s in argv[argv.index("--sizes") + 1].split(",")]
        results = [
            {"op": op, "bytes": size, "seconds": size / 1e9 + 1e-6, "mismatches": 0}
            for op in ("all_reduce", "all_gather", "broadcast")
            for size in sizes
        ]
        software = "NETCHECK " + json.dumps({"rank": rank, "software": self.stack(host)})
        return (
            software
            + "\nNETCHECK "
            + json.dumps(
                {
                    "rank": rank,
                    "ok": True,
                    "backend": "nccl" if self.nccl_transport else "gloo",
                    "world_size": len(self.hosts),
                    "results": results,
                    **(
                        {"transport": self.nccl_transport[host.name]}
                        if host.name in self.nccl_transport
                        else {}
                    ),
                }
            )
            + "\n"
        )


def nccl_log(network: str | None, ib_devices: tuple[str, ...] = ()) -> str:
    """What NCCL 2.2x writes with NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET at communicator
    init (its format: host:pid:tid [cuda device] NCCL INFO ...), choosing `network`."""
    lines = ["node1:4242:4242 [0] NCCL INFO Bootstrap : Using eth1:10.9.0.11<0>"]
    if ib_devices:
        found = " ".join(f"[{i}]{d}:1/IB" for i, d in enumerate(ib_devices))
        lines.append(
            f"node1:4242:4242 [0] NCCL INFO NET/IB : Using {found} ; OOB eth1:10.9.0.11<0>"
        )
    else:
        lines.append("node1:4242:4242 [0] NCCL INFO NET/IB : No device found.")
        lines.append("node1:4242:4242 [0] NCCL INFO NET/Socket : Using [0]eth1:10.9.0.11<0>")
    if network:
        lines.append(f"node1:4242:4242 [0] NCCL INFO Using network {network}")
    lines.append("node1:4242:4290 [0] NCCL INFO comm 0x5555 rank 0 nranks 2 - Init COMPLETE")
    return "\n".join(lines) + "\n"


def fake_transport(used: str | None, rdma: tuple[str, ...] = (), verbs: bool = False) -> dict:
    """A worker's `transport` report (netcheck.collective.read_transport's shape)."""
    return {"rdma": list(rdma), "verbs": verbs, "used": used}
