"""Simulated nodes that own their network, as real machines do: booted by systemd, with a network
stack from Debian's packages (netplan with systemd-networkd, netplan with NetworkManager,
NetworkManager alone, or ifupdown), and a compute NIC that no engine addresses.

The default simulated nodes get both addresses from Docker, so no stack on them could ever set
one. Here only the management interface (eth0, where the controller's SSH and Ansible reach the
node) is Docker's; the compute NIC (eth1) is one end of a veth pair whose other end joins a bridge
on this machine: a Docker network's that no container joins (so that the engine's firewall rules
let its ports talk), holding the compute subnet's first address, the controller's side of the
compute link as Docker's gateway is on the default nodes. The node's own stack gives eth1 its
address; until it does, eth1 has none.

What a real machine has and a container lacks is given here: the NIC is present before the init
starts (docker/sim-systemd/init.sh waits for it, and every start and restart plugs a new pair in,
the old one dying with the container's network namespace), a writable /sys (netplan apply runs
udevadm), and no default route on the management side, so that the compute address is the only
way back to the controller's compute address (a reply to it sent through the management gateway
would reach this machine anyway, and a wrong address would look confirmed).
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import yaml

from torch_multinode.cluster import trust
from torch_multinode.cluster.engine import docker
from torch_multinode.cluster.errors import UserError
from torch_multinode.sim import nodes
from torch_multinode.sim.node_image import NESTED_ENGINE_OPTIONS, build_images, python_mounts
from torch_multinode.sim.nodes import REPO_ROOT, SimConfig

SYSTEMD_IMAGE = "torch-multinode/sim-systemd:test"
# Each stack as Debian packages it, with the D-Bus every installed server has (hostnamectl and
# networkd's bus name need it); netplan apply also calls udevadm. "none": a node whose network
# no stack we configure manages.
STACKS = {
    "netplan": "netplan.io udev dbus",
    "networkmanager": "network-manager dbus",
    # Ubuntu Desktop's: netplan, rendering for the NetworkManager that runs beside it.
    "netplan-networkmanager": "netplan.io network-manager udev dbus",
    "ifupdown": "ifupdown dbus",
    "none": "dbus",
}
COMPUTE_NIC = "eth1"
SWITCH_MTU = 9000  # what the compute bridge's ports carry: jumbo frames where a node asks
# What a container needs for systemd as its PID 1 here (no --privileged: see ENVIRONMENT.md).
SYSTEMD_OPTIONS = [*NESTED_ENGINE_OPTIONS, "--tmpfs", "/run", "--tmpfs", "/run/lock"]


def systemd_image() -> str:
    build_images()  # the Debian base, cached after the first time
    docker("build", "--quiet", "-t", SYSTEMD_IMAGE, str(REPO_ROOT / "docker" / "sim-systemd"))
    return SYSTEMD_IMAGE


def stack_image(stack: str) -> str:
    """The systemd-booted node with `stack` installed (built once, then cached)."""
    if stack not in STACKS:
        raise UserError(f"unknown network stack {stack!r}", hint=", ".join(STACKS))
    tag = f"torch-multinode/sim-stack:{stack}"
    docker(
        "build",
        "--quiet",
        "-t",
        tag,
        "--build-arg",
        f"BASE={systemd_image()}",
        "--build-arg",
        f"PACKAGES={STACKS[stack]}",
        "-f",
        str(REPO_ROOT / "docker" / "sim-systemd" / "stack.Dockerfile"),
        str(REPO_ROOT / "docker" / "sim-systemd"),
        timeout=900,
    )
    return tag


def wait_for_boot(container: str, limit: float = 120.0) -> None:
    """Until systemd says the boot is over (its bus appears a moment after the start)."""
    deadline = time.monotonic() + limit
    state = ""
    while time.monotonic() < deadline:
        done = docker(
            "exec",
            container,
            "systemctl",
            "is-system-running",
            "--wait",
            check=False,
            timeout=limit,
        )
        state = done.stdout.strip()
        if state in ("running", "degraded"):
            return
        time.sleep(0.5)
    raise UserError(f"{container} did not finish booting (systemd: {state or 'no answer'})")


def bridge(config: SimConfig) -> str:
    return f"{config.name}-cb"


def _host_end(config: SimConfig, index: int) -> str:
    return f"{config.name}-v{index}"


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise UserError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def _nsenter(pid: str, *args: str) -> None:
    done = subprocess.run(
        ["nsenter", "-t", pid, "-n", *args], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise UserError(f"in the node's namespace, {' '.join(args)}: {done.stderr.strip()}")


def plug(config: SimConfig, index: int) -> None:
    """Give node `index`'s running container its compute NIC (eth1, a fixed MAC) on the bridge,
    and take the management side's default route away; its init waits for this before systemd
    starts. The bridge is a switch that takes jumbo frames (its ports carry SWITCH_MTU bytes);
    the node's own end keeps the default 1500 until its stack is told otherwise."""
    container = config.container(index)
    pid = docker("inspect", "-f", "{{.State.Pid}}", container).stdout.strip()
    host_end, node_end = _host_end(config, index), f"{config.name}-n{index}"
    subprocess.run(["ip", "link", "del", host_end], capture_output=True, check=False)
    _ip("link", "add", host_end, "mtu", str(SWITCH_MTU), "type", "veth", "peer", "name", node_end)
    _ip("link", "set", node_end, "mtu", "1500")
    _ip("link", "set", node_end, "netns", pid)
    _nsenter(pid, "ip", "route", "del", "default")
    mac = f"02:54:00:00:{index:02x}:01"
    _nsenter(pid, "ip", "link", "set", node_end, "name", COMPUTE_NIC, "address", mac)
    _ip("link", "set", host_end, "master", bridge(config), "up")


def start(config: SimConfig, index: int, image: str, public_key: str) -> None:
    docker(
        "run",
        "-d",
        "--name",
        config.container(index),
        "--hostname",
        f"node{index}",
        "--network",
        config.mgmt_network,
        "--ip",
        config.mgmt_ip(index),
        "--label",
        f"{nodes.LABEL}={config.name}",
        "-e",
        f"SIM_AUTHORIZED_KEY={public_key}",
        "-e",
        f"SIM_LINKS={COMPUTE_NIC}",
        *SYSTEMD_OPTIONS,
        *python_mounts(),
        image,
    )
    plug(config, index)
    wait_for_boot(config.container(index))


def reboot(config: SimConfig, index: int) -> None:
    """A reboot: the container restarted (systemd shuts down cleanly), the NIC plugged in again."""
    docker("restart", "-t", "30", config.container(index), timeout=120)
    plug(config, index)
    wait_for_boot(config.container(index))


def up(config: SimConfig, stacks: Sequence[str]) -> None:
    """One node per entry of `stacks`, node N running stacks[N-1], their compute NICs on one
    bridge without addresses, and the cluster's inventory (config.inventory_path) with static_ip
    on: what provisioning starts from. The nodes boot side by side."""
    images = {stack: stack_image(stack) for stack in dict.fromkeys(stacks)}
    count = len(stacks)
    config.state_dir.mkdir(parents=True, exist_ok=True)
    public_key = nodes.ensure_key(config)
    docker(
        "network",
        "create",
        "--subnet",
        config.mgmt_subnet,
        "--label",
        f"{nodes.LABEL}={config.name}",
        config.mgmt_network,
    )
    # No container joins it: the engine addresses nothing on it but the bridge.
    docker(
        "network",
        "create",
        "--subnet",
        config.subnet,
        "-o",
        f"com.docker.network.bridge.name={bridge(config)}",
        "--label",
        f"{nodes.LABEL}={config.name}",
        config.network,
    )
    on_each(count, lambda index: start(config, index, images[stacks[index - 1]], public_key))
    deadline = time.monotonic() + 120
    known = [
        (config.mgmt_ip(i), nodes.host_key(config.container(i), deadline))
        for i in range(1, count + 1)
    ]
    trust.write_known_hosts(config.known_hosts_path, known)
    path = nodes.write_inventory(config, count)
    document = yaml.safe_load(path.read_text())
    document["all"]["vars"]["static_ip_enabled"] = True
    path.write_text(yaml.safe_dump(document, sort_keys=False))


def on_each(indices: int | Sequence[int], act: Callable[[int], object]) -> None:
    """act(index) for each node index (1 to N if a count), side by side; the first error is
    raised once every one has ended."""
    chosen = range(1, indices + 1) if isinstance(indices, int) else indices
    with ThreadPoolExecutor(max_workers=max(1, len(chosen))) as pool:
        for future in [pool.submit(act, index) for index in chosen]:
            future.result()


def down(config: SimConfig, count: int = 2) -> None:
    containers = [config.container(i) for i in range(1, count + 1)]
    docker("rm", "-f", "-v", *containers, check=False)
    docker("network", "rm", config.mgmt_network, config.network, check=False)
