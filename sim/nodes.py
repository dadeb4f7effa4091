"""The simulated cluster: node containers on a private bridge network, reached over real SSH.

Each node is a plain Debian host: sshd with key authentication, its own host keys, NET_ADMIN
for ufw and tc, the capabilities a Docker engine of its own needs, and the controller's Python
environment mounted read-only at the same paths (the way a lab shares /opt over NFS). Nothing
that provisioning does is done here: no SSH mesh, no /etc/hosts entries, no firewall.

Everything a cluster creates carries the label `torch-multinode.sim=<name>`, so `down` finds
and removes all of it even when the state directory is gone.
"""

from __future__ import annotations

import ipaddress
import json
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from torch_multinode.cluster import trust
from torch_multinode.cluster.engine import Progress, docker, require_engine
from torch_multinode.cluster.errors import UserError
from torch_multinode.cluster.inventory import Inventory
from torch_multinode.cluster.inventory_read import load
from torch_multinode.cluster.remote import Remote
from torch_multinode.cluster.sync import TOOL_ROOT
from torch_multinode.sim.node_image import (
    NESTED_ENGINE_OPTIONS,
    NODE_IMAGE,
    build_images,
    python_mounts,
)

REPO_ROOT = TOOL_ROOT
LABEL = "torch-multinode.sim"
DEFAULT_NAME = "tmn"
DEFAULT_SUBNET = "172.29.77.0/24"
DEFAULT_MGMT_SUBNET = "172.30.77.0/24"
MGMT_INTERFACE = "eth0"  # SSH from the controller, like a lab's management LAN
COMPUTE_INTERFACE = "eth1"  # training traffic, the inventory's compute_ip
SHARED_DIR = "/shared"
MAX_NODES = 4
# The user a fresh install leaves (FRESH=1): a password, sudo that asks for it, no SSH key.
FRESH_USER = "trainer"
FIRST_HOST_OFFSET = 11  # nodes get .11, .12, ... so the gateway (.1) is never confused with one
SSH_HANDSHAKE_TIMEOUT = 15.0
_LINK_RATE = re.compile(r"^\d+(\.\d+)?[kmg]?bit$")


def default_state_dir(name: str) -> Path:
    """.sim for the default cluster; .sim/NAME for any other, so clusters never share files."""
    root = REPO_ROOT / ".sim"
    return root if name == DEFAULT_NAME else root / name


@dataclass(frozen=True)
class SimConfig:
    name: str = DEFAULT_NAME
    subnet: str = DEFAULT_SUBNET
    state_dir: Path = REPO_ROOT / ".sim"
    mgmt_subnet: str = DEFAULT_MGMT_SUBNET
    # Small filesystems of their own that every node shares, as a full NFS export would be:
    # (path on the nodes, size), each a tmpfs volume that the Docker engine mounts and unmounts.
    tmpfs: tuple[tuple[str, str], ...] = ()

    @property
    def network(self) -> str:
        return f"{self.name}-net"

    @property
    def mgmt_network(self) -> str:
        return f"{self.name}-mgmt"

    def container(self, index: int) -> str:
        return f"{self.name}-node{index}"

    def volume(self, index: int) -> str:
        return f"{self.name}-node{index}-docker"

    @property
    def shared_volume(self) -> str:
        """Mounted at /shared on every node: the filesystem every rank sees (file:// init)."""
        return f"{self.name}-shared"

    def node_ip(self, index: int) -> str:
        """The node's compute address."""
        net = ipaddress.IPv4Network(self.subnet)
        return str(net.network_address + FIRST_HOST_OFFSET + index - 1)

    def mgmt_ip(self, index: int) -> str:
        """The node's management address, where the controller's SSH reaches it."""
        net = ipaddress.IPv4Network(self.mgmt_subnet)
        return str(net.network_address + FIRST_HOST_OFFSET + index - 1)

    @property
    def mgmt_gateway(self) -> str:
        """This machine's address on the management network (where its registry listens)."""
        return str(ipaddress.IPv4Network(self.mgmt_subnet).network_address + 1)

    @property
    def inventory_path(self) -> Path:
        return self.state_dir / "inventory.yml"

    @property
    def key_path(self) -> Path:
        return self.state_dir / "id_ed25519"

    @property
    def known_hosts_path(self) -> Path:
        return self.state_dir / "known_hosts"


@dataclass
class SimCluster:
    config: SimConfig
    nodes: list[str]
    link: str | None
    reused: bool
    seconds: float = 0.0
    inventory: Inventory | None = field(default=None, repr=False)


def _quiet(_: str) -> None:
    pass


def _labelled(kind: str, name: str) -> list[str]:
    args = ["ls", "-q"] if kind != "container" else ["ps", "-aq"]
    proc = docker(kind, *args, "--filter", f"label={LABEL}={name}")
    return [line for line in proc.stdout.split() if line]


def _existing_nodes(config: SimConfig) -> dict[int, dict]:
    """Index -> docker inspect data of this cluster's node containers."""
    ids = _labelled("container", config.name)
    if not ids:
        return {}
    data = json.loads(docker("inspect", *ids).stdout)
    nodes = {}
    for item in data:
        index = int(item["Config"]["Labels"].get(f"{LABEL}.index", "0"))
        nodes[index] = item
    return nodes


def ensure_key(config: SimConfig) -> str:
    """The controller's key pair for this cluster; returns the public key line."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    config.state_dir.mkdir(parents=True, exist_ok=True)
    public = config.key_path.with_suffix(".pub")
    if not config.key_path.exists() or not public.exists():
        key = Ed25519PrivateKey.generate()
        private_bytes = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.OpenSSH,
            serialization.NoEncryption(),
        )
        public_bytes = key.public_key().public_bytes(
            serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
        )
        config.key_path.touch(mode=0o600, exist_ok=True)
        config.key_path.chmod(0o600)
        config.key_path.write_bytes(private_bytes)
        public.write_text(public_bytes.decode() + f" torch-multinode-sim-{config.name}\n")
    return public.read_text().strip()


def _start_node(config: SimConfig, index: int, public_key: str | None) -> None:
    """Start node `index`: with `public_key`, root takes that key; without one, as a fresh
    install (FRESH_USER with a password, set afterwards, and SSH password login)."""
    container, volume = config.container(index), config.volume(index)
    if public_key is not None:
        access = ["-e", f"SIM_AUTHORIZED_KEY={public_key}"]
    else:
        access = ["-e", f"SIM_FRESH_USER={FRESH_USER}", "--label", f"{LABEL}.fresh=1"]
    for name in (volume, config.shared_volume):
        docker("volume", "create", "--label", f"{LABEL}={config.name}", name)
    mounts = [f"{config.shared_volume}:{SHARED_DIR}"]
    for number, (path, size) in enumerate(config.tmpfs, start=1):
        name = f"{config.name}-tmpfs{number}"
        docker(
            "volume",
            "create",
            "--label",
            f"{LABEL}={config.name}",
            *("--opt", "type=tmpfs", "--opt", "device=tmpfs"),
            *("--opt", f"o=size={size},mode=1777"),
            name,
        )
        mounts.append(f"{name}:{path}")
    docker(
        "run",
        "-d",
        "--name",
        container,
        "--hostname",
        f"debian-{index}",
        "--network",
        config.mgmt_network,
        "--ip",
        config.mgmt_ip(index),
        "--label",
        f"{LABEL}={config.name}",
        "--label",
        f"{LABEL}.index={index}",
        "--init",
        *NESTED_ENGINE_OPTIONS,
        "-v",
        f"{volume}:/var/lib/docker",
        *(argument for mount in mounts for argument in ("-v", mount)),
        *access,
        *python_mounts(),
        NODE_IMAGE,
    )
    # Connected after start so that it is always eth1, whatever docker's ordering of networks.
    docker("network", "connect", "--ip", config.node_ip(index), config.network, container)


def host_key(container: str, deadline: float) -> str:
    while True:
        proc = docker("exec", container, "cat", "/etc/ssh/ssh_host_ed25519_key.pub", check=False)
        if proc.returncode == 0 and proc.stdout.strip():
            kind, key = proc.stdout.split()[:2]
            return f"{kind} {key}"
        if time.monotonic() > deadline:
            raise UserError(f"node {container} made no SSH host key in time", exit_code=1)
        time.sleep(0.2)


def shape_link(container: str, link: str | None) -> None:
    """Rate-limit the node's link like a 1 GbE port, or remove the limit when link is None."""
    if link is None:
        docker(
            "exec", container, "tc", "qdisc", "del", "dev", COMPUTE_INTERFACE, "root", check=False
        )
        return
    docker(
        "exec",
        container,
        "tc",
        "qdisc",
        "replace",
        "dev",
        COMPUTE_INTERFACE,
        "root",
        "tbf",
        "rate",
        link,
        "burst",
        "128kb",
        "latency",
        "20ms",
    )


def write_inventory(config: SimConfig, count: int, fresh: bool = False) -> Path:
    hosts = {
        f"node{i}": {
            "ansible_host": config.mgmt_ip(i),
            "compute_ip": config.node_ip(i),
            "compute_interface": COMPUTE_INTERFACE,
            "gpus": 0,
            "sim_container": config.container(i),
        }
        for i in range(1, count + 1)
    }
    document = {
        "all": {
            "vars": {
                "compute_subnet": config.subnet,
                "rendezvous_port": 29500,
                # A fresh install's user logs in with the key `make bootstrap` installs.
                "ansible_user": FRESH_USER if fresh else "root",
                "ansible_ssh_private_key_file": str(config.key_path.resolve()),
                "ssh_known_hosts_file": str(config.known_hosts_path.resolve()),
                "ansible_ssh_common_args": trust.ansible_ssh_args(
                    config.known_hosts_path.resolve()
                ),
                "ansible_python_interpreter": "/usr/bin/python3",
                # Jobs run with the controller's venv, mounted read-only at the same path on
                # every node (the training image is for nodes that run Docker).
                "launch_mode": "host",
                # Nothing in this sandbox may raise RLIMIT_MEMLOCK (no CAP_SYS_RESOURCE), so a
                # training container keeps the nodes' 8 MiB; real clusters use 'unlimited'.
                "container_memlock": 8388608,
                # That venv's interpreter:
                "training_python": str(Path(sys.prefix) / "bin" / "python"),
                # The nodes do not own their network: docker assigns their addresses.
                "static_ip_enabled": False,
                "sim_cluster": config.name,
            },
            "children": {"nodes": {"hosts": hosts}},
        }
    }
    header = (
        f"# Simulated cluster '{config.name}', written by 'make sim-up'. Regenerated on every\n"
        "# sim-up: edit a copy, not this file.\n"
    )
    if fresh:
        header += (
            f"# Nodes as a fresh install leaves them ({FRESH_USER} with a password, no key, host\n"
            f"# keys unknown): make bootstrap INVENTORY={config.inventory_path} first.\n"
        )
    config.inventory_path.write_text(header + yaml.safe_dump(document, sort_keys=False))
    return config.inventory_path


def up(
    nnodes: int,
    link: str | None = None,
    config: SimConfig | None = None,
    progress: Progress = _quiet,
    ssh_timeout: float = 120.0,
    fresh: bool = False,
    fresh_password: str | None = None,
) -> SimCluster:
    """Start (or reuse) an `nnodes`-node cluster; returns once every node answers over SSH.

    With `fresh`, nodes as a fresh install leaves them: FRESH_USER with `fresh_password`
    (given to chpasswd on its standard input; running nodes keep theirs), sudo asking for it,
    SSH password login, no authorized key, and an inventory whose known_hosts file holds no
    key: `make bootstrap`."""
    if fresh_password is not None and (
        not fresh_password or "\n" in fresh_password or ":" in fresh_password
    ):
        raise UserError("the fresh nodes' password must be one line, not empty, without ':'")
    config = config or SimConfig()
    started = time.monotonic()
    if isinstance(nnodes, bool) or not isinstance(nnodes, int) or not 1 <= nnodes <= MAX_NODES:
        raise UserError(
            f"the simulated cluster takes 1 to {MAX_NODES} nodes, not {nnodes!r}",
            hint="NNODES=2",
        )
    if link is not None and not _LINK_RATE.match(link):
        raise UserError(f"LINK={link!r} is not a rate tc understands", hint="LINK=1gbit")
    nets = []
    for subnet in (config.subnet, config.mgmt_subnet):
        try:
            nets.append(ipaddress.IPv4Network(subnet))
        except ValueError:
            raise UserError(f"simulator subnet {subnet!r} is not an IPv4 network") from None
        if nets[-1].num_addresses < FIRST_HOST_OFFSET + MAX_NODES + 1:
            raise UserError(f"simulator subnet {subnet} is too small", hint="a /24")
    if nets[0].overlaps(nets[1]):
        raise UserError(f"simulator subnets {config.subnet} and {config.mgmt_subnet} overlap")
    require_engine()

    existing = _existing_nodes(config)
    if existing and sorted(existing) != list(range(1, nnodes + 1)):
        raise UserError(
            f"simulated cluster '{config.name}' already has {len(existing)} node(s)",
            hint=f"'make sim-down' first, or NNODES={len(existing)}",
        )
    were_fresh = {
        item["Config"]["Labels"].get(f"{LABEL}.fresh") == "1" for item in existing.values()
    }
    if existing and were_fresh != {fresh}:
        running = "as fresh installs (FRESH=1)" if fresh is False else "without FRESH=1"
        raise UserError(
            f"simulated cluster '{config.name}' is already running {running}",
            hint="'make sim-down' first",
        )
    build_images(progress)
    config.state_dir.mkdir(parents=True, exist_ok=True)
    public_key = None if fresh else ensure_key(config)
    reused = bool(existing)
    if fresh and not reused and fresh_password is None:
        raise UserError("new fresh nodes need their user's password", hint="make sim-up FRESH=1")
    if not reused:
        existing_networks = set(
            docker(
                "network", "ls", "--format", "{{.Name}}", "--filter", f"label={LABEL}={config.name}"
            ).stdout.split()
        )
        for network, subnet in (
            (config.mgmt_network, config.mgmt_subnet),
            (config.network, config.subnet),
        ):
            if network not in existing_networks:
                docker(
                    "network",
                    "create",
                    "--driver",
                    "bridge",
                    "--subnet",
                    subnet,
                    "--label",
                    f"{LABEL}={config.name}",
                    network,
                )
        for index in range(1, nnodes + 1):
            progress(
                f"Starting {config.container(index)}: ssh {config.mgmt_ip(index)}, "
                f"compute {config.node_ip(index)} ({COMPUTE_INTERFACE})..."
            )
            _start_node(config, index, public_key)
            if fresh:
                assert fresh_password is not None  # new fresh nodes need one (refused above)
                _set_password(config.container(index), fresh_password, ssh_timeout)
    else:
        progress(f"Reusing the {nnodes} running node(s) of '{config.name}'.")
        for index, item in existing.items():
            if not item["State"]["Running"]:
                docker("start", config.container(index))

    deadline = time.monotonic() + ssh_timeout
    known = [
        (config.mgmt_ip(i), host_key(config.container(i), deadline)) for i in range(1, nnodes + 1)
    ]
    if not fresh:
        trust.write_known_hosts(config.known_hosts_path, known)
    elif not reused:
        trust.write_known_hosts(config.known_hosts_path, [])  # bootstrap confirms and adds each
    for index in range(1, nnodes + 1):
        shape_link(config.container(index), link)
    inventory = load(write_inventory(config, nnodes, fresh))
    for index, host in enumerate(inventory.hosts, start=1):
        if fresh:
            _wait_for_sshd(host, config.container(index), deadline)
            continue
        # A generous handshake timeout: under load a fresh node's sshd can take seconds to
        # answer, and an attempt given up mid-handshake only adds to that load.
        remote = Remote.for_inventory(inventory, host, connect_timeout=SSH_HANDSHAKE_TIMEOUT)
        _wait_for_ssh(remote, config.container(index), deadline)
    return SimCluster(
        config,
        [h.name for h in inventory.hosts],
        link,
        reused,
        time.monotonic() - started,
        inventory,
    )


def _wait_for_ssh(remote: Remote, container: str, deadline: float) -> None:
    """Until the node takes the key and runs a command."""

    def probe() -> None:
        try:
            remote.run("true", timeout=10, check=True)
        finally:
            remote.close()

    _retry(probe, f"node {remote.host.name} did not answer over SSH in time", container, deadline)


def _wait_for_sshd(host, container: str, deadline: float) -> None:
    """Until the node's sshd completes a key exchange (nothing can log in yet: FRESH=1)."""
    from torch_multinode.provision.keys import NodeFailed, fetch_host_key

    def probe() -> None:
        try:
            fetch_host_key(host, timeout=10)
        except NodeFailed as exc:
            raise UserError(str(exc)) from None

    _retry(probe, f"node {host.name}'s sshd did not answer in time", container, deadline)


def _retry(probe: Callable[[], None], failure: str, container: str, deadline: float) -> None:
    """`probe` every half second until it passes; past `deadline`, `failure` with its last
    error and what the node's container says."""
    while True:
        try:
            probe()
            return
        except UserError as exc:
            if time.monotonic() > deadline:
                raise UserError(
                    f"{failure}: {exc}; {_node_state(container)}", exit_code=1
                ) from None
            time.sleep(0.5)


def _set_password(container: str, password: str, timeout: float) -> None:
    """FRESH_USER's password, on chpasswd's standard input (never on a command line); the
    node's init makes the user first."""
    deadline = time.monotonic() + timeout
    while docker("exec", container, "id", FRESH_USER, check=False).returncode != 0:
        if time.monotonic() > deadline:
            raise UserError(f"node {container} made no user {FRESH_USER} in time", exit_code=1)
        time.sleep(0.2)
    docker("exec", "-i", container, "chpasswd", stdin=f"{FRESH_USER}:{password}\n")


def _node_state(container: str) -> str:
    """What the container's engine and its sshd (which logs to the container's output) say."""
    state = docker("inspect", "--format", "{{.State.Status}}", container, check=False)
    logs = docker("logs", "--tail", "5", container, check=False)
    lines = " | ".join((logs.stdout + logs.stderr).strip().splitlines()[-5:]) or "none"
    return f"container {container} is {state.stdout.strip() or 'gone'}, its last log lines: {lines}"


def wait_for_engine(config: SimConfig, index: int, limit: float = 180.0) -> None:
    """Until node `index`'s Docker engine answers: a node started again after a kill starts
    its engine (when provisioning installed one) after its sshd, so SSH alone says too early
    that the node can run jobs in containers."""
    container, deadline = config.container(index), time.monotonic() + limit
    while docker("exec", container, "docker", "info", check=False).returncode != 0:
        if time.monotonic() > deadline:
            log = docker("exec", container, "tail", "-n", "20", "/var/log/dockerd.log", check=False)
            raise UserError(
                f"node{index}'s Docker engine did not answer within {limit:.0f} s; its log ends:"
                f" {' | '.join(log.stdout.strip().splitlines()[-5:]) or 'nothing'}",
                exit_code=1,
            )
        time.sleep(1)


@dataclass
class Removed:
    containers: int
    networks: int
    volumes: int


def down(config: SimConfig | None = None, progress: Progress = _quiet) -> Removed:
    """Remove every container, network and volume of the cluster, and its generated files."""
    config = config or SimConfig()
    require_engine()
    containers = _labelled("container", config.name)
    if containers:
        progress(f"Removing {len(containers)} node container(s)...")
        docker("rm", "-f", "-v", *containers)
    networks = _labelled("network", config.name)
    if networks:
        docker("network", "rm", *networks)
    volumes = _labelled("volume", config.name)
    if volumes:
        docker("volume", "rm", "-f", *volumes)
    for path in (config.inventory_path, config.known_hosts_path):
        path.unlink(missing_ok=True)
    _stop_registries(config.mgmt_gateway)
    return Removed(len(containers), len(networks), len(volumes))


def _stop_registries(address: str) -> None:
    """Stop the image registry instances provisioning started on this cluster's management
    address (ansible/roles/image_registry, without an init system: a pid file in /run), which
    would otherwise outlive the network they listen on, and remove their settings and keys: a
    later cluster given the same address has no registry until its own provisioning sets one
    up (else shipping to it finds one set up that does not answer). What they stored stays."""
    from torch_multinode.provision.ship import REGISTRY_DIR, instance_name

    instances = instance_name(address, "*")
    for pidfile in Path("/run").glob(f"{instances}.pid"):
        subprocess.run(
            [
                "start-stop-daemon",
                "--stop",
                "--pidfile",
                str(pidfile),
                "--retry",
                "5",
                "--remove-pidfile",
            ],
            capture_output=True,
            check=False,
        )
    for pattern in (f"{instances}.yml", f"{instances}.crt", f"server/{instances}.key"):
        for path in REGISTRY_DIR.glob(pattern):
            path.unlink(missing_ok=True)


def status(config: SimConfig | None = None) -> list[tuple[str, str, bool]]:
    """(container, ip, running) for each node of the cluster."""
    config = config or SimConfig()
    require_engine()
    return [
        (config.container(i), config.mgmt_ip(i), bool(item["State"]["Running"]))
        for i, item in sorted(_existing_nodes(config).items())
    ]
