"""Issue 52: the static_ip role applies the compute address for real, on each network stack our
users' nodes run, and proves it.

Each stack gets two systemd-booted nodes that own their compute link (sim/owned_network.py):
Debian's own packages of the stack, a compute NIC (eth1) no engine addresses, on a bridge this
test creates with the controller's side of the link on it, and no route back to the controller
but that link. For each stack, in order on the same pair:

- `--check` names the stack and changes nothing (no file, no address);
- `make provision` (the static_ip role) gives node1 and node2 their compute_ips with the stack
  it names in its output; they ping each other over them; `make netcheck` passes on them; a
  2-node job trains over them (gloo on eth1);
- a second run changes nothing and does not bounce the link (eth1's carrier changes the same);
- a reboot (the container restarted, systemd shutting down and booting) keeps the address;
- an address whose prefix leaves the controller off the link is applied, never confirmed, and
  rolled back by the node itself within its timer; the play fails naming the node and the
  rollback, and the node answers again on its old address, its file as it was.

And a node with no stack the role configures is refused before anything changes.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from tests.ansible.conftest import node_sh, recap_of
from tests.conftest import REPO_ROOT, make
from tests.helpers import run_id_in
from tests.training.conftest import TINY
from torch_multinode.sim import owned_network
from torch_multinode.sim.nodes import SimConfig

pytestmark = [pytest.mark.sim, pytest.mark.timeout(1800)]

FILES = {
    "netplan": "/etc/netplan/60-torch-multinode-compute.yaml",
    "networkmanager": "/etc/NetworkManager/system-connections/torch-multinode-compute.nmconnection",
    "ifupdown": "/etc/network/interfaces.d/60-torch-multinode-compute",
}
SAID = {
    "netplan": "with netplan (rendered for systemd-networkd)",
    "networkmanager": "with NetworkManager (nmcli, profile torch-multinode-compute)",
    "ifupdown": "with ifupdown",
}
CONFIRM_TIMEOUT = 15


def addresses(container: str) -> list[str]:
    """eth1's IPv4 addresses, as ADDRESS/PREFIX."""
    shown = node_sh(container, "ip -4 -o addr show dev eth1").stdout.split()
    return [shown[i + 1] for i, word in enumerate(shown) if word == "inet"]


def pings(container: str, address: str) -> bool:
    return node_sh(container, f"ping -c 1 -W 3 -I eth1 {address}").returncode == 0


def carrier_changes(container: str) -> str:
    return node_sh(container, "cat /sys/class/net/eth1/carrier_changes").stdout.strip()


def controller_reaches(address: str) -> bool:
    """Whether SSH answers this machine on `address` (over the bridge this test made)."""
    try:
        with socket.create_connection((address, 22), timeout=5):
            return True
    except OSError:
        return False


@dataclass
class StackRun:
    stack: str
    config: SimConfig
    compute: dict[str, str]
    dry: subprocess.CompletedProcess
    dry_left: dict[str, list[str]]
    provision: subprocess.CompletedProcess
    addresses: dict[str, list[str]]
    ping_1_to_2: bool
    ping_2_to_1: bool
    netcheck: subprocess.CompletedProcess
    train: subprocess.CompletedProcess
    rerun: subprocess.CompletedProcess
    carriers_before: dict[str, str]
    carriers_after: dict[str, str]
    after_reboot: list[str]
    ping_after_reboot: bool
    file_before: str
    rollback: subprocess.CompletedProcess
    after_rollback: list[str]
    file_after_rollback: str
    node1_file_before: str
    node1_file_after_rollback: str
    controller_after_rollback: bool
    left: list[str] = field(default_factory=list)


def _provision(
    inventory: Path, tags: str = "hostname,static_ip", check: bool = False
) -> subprocess.CompletedProcess:
    """make provision with the roles a job over the compute addresses needs (netcheck asks that
    every name resolves to its compute IP); `check`: with --check."""
    args = f"--tags {tags}" + (" --check" if check else "")
    return make("provision", f"INVENTORY={inventory}", f"ANSIBLE_ARGS={args}", timeout=1200)


def _run_stack(stack: str, config: SimConfig, tmp: Path) -> StackRun:
    owned_network.up(config, stack)
    inventory = config.inventory_path
    document = yaml.safe_load(inventory.read_text())
    hosts = document["all"]["children"]["nodes"]["hosts"]
    compute = {name: host["compute_ip"] for name, host in hosts.items()}
    node1, node2 = config.container(1), config.container(2)
    names = {"node1": node1, "node2": node2}

    dry = _provision(inventory, tags="static_ip", check=True)
    dry_left = {
        name: addresses(c) + node_sh(c, f"ls {FILES[stack]}").stdout.split()
        for name, c in names.items()
    }
    provision = _provision(inventory)
    found = {name: addresses(container) for name, container in names.items()}
    ping_1_to_2 = pings(node1, compute["node2"])
    ping_2_to_1 = pings(node2, compute["node1"])
    netcheck = make("netcheck", f"INVENTORY={inventory}", timeout=600)
    train = make(
        "train",
        f"INVENTORY={inventory}",
        "NNODES=2",
        "ARGS=" + " ".join([*TINY, "--steps", "2"]),
        timeout=900,
    )
    if "[launcher] job " in train.stdout:
        shutil.rmtree(REPO_ROOT / ".runs" / run_id_in(train.stdout), ignore_errors=True)

    carriers_before = {name: carrier_changes(c) for name, c in names.items()}
    rerun = _provision(inventory)
    carriers_after = {name: carrier_changes(c) for name, c in names.items()}

    owned_network.reboot(config, 2)
    after_reboot = addresses(node2)
    ping_after_reboot = pings(node1, compute["node2"])

    # A prefix that leaves the controller's side of the link (.1) off node2's: the node takes
    # the address, but nothing it sends can reach the controller, so no confirmation comes.
    # node1 changes in the same run (its MTU), is confirmed, and must roll back all the same.
    file_before = node_sh(node2, f"cat {FILES[stack]}").stdout
    node1_file_before = node_sh(node1, f"cat {FILES[stack]}").stdout
    hosts["node2"]["static_ip_prefix_length"] = 30
    hosts["node1"]["static_ip_mtu"] = 1400
    document["all"]["vars"]["static_ip_confirm_timeout"] = CONFIRM_TIMEOUT
    wrong = tmp / "wrong-prefix.yml"
    wrong.write_text(yaml.safe_dump(document, sort_keys=False))
    rollback = _provision(wrong)
    return StackRun(
        stack,
        config,
        compute,
        dry,
        dry_left,
        provision,
        found,
        ping_1_to_2,
        ping_2_to_1,
        netcheck,
        train,
        rerun,
        carriers_before,
        carriers_after,
        after_reboot,
        ping_after_reboot,
        file_before,
        rollback,
        addresses(node2),
        node_sh(node2, f"cat {FILES[stack]}").stdout,
        node1_file_before,
        node_sh(node1, f"cat {FILES[stack]}").stdout,
        controller_reaches(compute["node2"]),
        node_sh(node2, f"ls -A {Path(FILES[stack]).parent}").stdout.split(),
    )


def _stack_param(stack: str):
    return pytest.param(stack, id=stack, marks=pytest.mark.xdist_group(f"static_ip_{stack}"))


@pytest.fixture(scope="module", params=[_stack_param(s) for s in FILES])
def stack_run(request, sim_factory, tmp_path_factory):
    config = sim_factory.config()
    try:
        yield _run_stack(request.param, config, tmp_path_factory.mktemp(request.param))
    finally:
        owned_network.down(config)


def _said(run: subprocess.CompletedProcess) -> str:
    return (run.stdout + run.stderr)[-8000:]


def test_check_mode_says_the_stack_and_changes_nothing(stack_run):
    run = stack_run.dry
    assert run.returncode == 0, _said(run)
    assert SAID[stack_run.stack] in " ".join(run.stdout.split()), _said(run)
    # Neither a file nor an address: --check only says what would change.
    assert stack_run.dry_left == {"node1": [], "node2": []}


def test_provision_gives_each_node_its_compute_ip_with_the_stack_it_runs(stack_run):
    run = stack_run.provision
    assert run.returncode == 0, _said(run)
    text = " ".join(run.stdout.split())
    for name, ip in stack_run.compute.items():
        assert f"{name}: {ip}/24 on eth1 {SAID[stack_run.stack]} ({FILES[stack_run.stack]})" in (
            text
        ), _said(run)
        assert stack_run.addresses[name] == [f"{ip}/24"], stack_run.addresses
    assert recap_of(run.stdout)["node1"]["changed"] > 0
    assert stack_run.ping_1_to_2 and stack_run.ping_2_to_1


def test_netcheck_passes_and_a_two_node_job_trains_over_the_addresses(stack_run):
    assert stack_run.netcheck.returncode == 0, _said(stack_run.netcheck)
    assert "ready: 0 FAIL" in stack_run.netcheck.stdout
    train = stack_run.train
    assert train.returncode == 0, _said(train)
    # The ranks met at node1's compute address, which only the stack gave it.
    assert f"{stack_run.compute['node1']}:" in train.stdout, _said(train)
    assert "step 2/2" in train.stdout, _said(train)


def test_a_second_run_changes_nothing_and_does_not_bounce_the_link(stack_run):
    run = stack_run.rerun
    assert run.returncode == 0, _said(run)
    assert {name: counts["changed"] for name, counts in recap_of(run.stdout).items()} == {
        "localhost": 0,
        "node1": 0,
        "node2": 0,
    }, _said(run)
    assert stack_run.carriers_after == stack_run.carriers_before


def test_a_reboot_keeps_the_address(stack_run):
    assert stack_run.after_reboot == [f"{stack_run.compute['node2']}/24"]
    assert stack_run.ping_after_reboot


def test_an_address_that_cuts_the_node_off_is_rolled_back_by_the_node(stack_run):
    run = stack_run.rollback
    assert run.returncode != 0, _said(run)
    text = " ".join(run.stdout.split())
    assert (
        f"host 'node2': the new {stack_run.stack} configuration was not confirmed "
        f"({stack_run.compute['node2']} on eth1 did not answer within {CONFIRM_TIMEOUT} s), so "
        "the node rolled back to its previous configuration by itself"
    ) in text, _said(run)
    # node1 answered on its new configuration, and rolled back too: nothing is half-changed.
    assert (
        f"host 'node1': {stack_run.compute['node1']} answered on eth1, but another node's new "
        "address was not confirmed in the same run, so this node also rolled back to its "
        "previous configuration"
    ) in text, _said(run)
    assert stack_run.node1_file_after_rollback == stack_run.node1_file_before
    assert stack_run.after_rollback == [f"{stack_run.compute['node2']}/24"]
    assert stack_run.file_after_rollback == stack_run.file_before
    assert stack_run.controller_after_rollback
    # No backup or candidate left beside the file.
    assert stack_run.left == [Path(FILES[stack_run.stack]).name]


@pytest.mark.xdist_group("static_ip_ifupdown")
def test_a_node_with_no_stack_we_configure_is_refused_before_any_change(sim_factory):
    config = sim_factory.config()
    try:
        owned_network.up(config, "none", count=1)
        run = _provision(config.inventory_path, tags="static_ip")
        node = config.container(1)
        listing = node_sh(node, "ls /usr/local/sbin /etc/netplan /etc/network 2>&1").stdout
    finally:
        owned_network.down(config, count=1)
    assert run.returncode != 0, _said(run)
    assert (
        "host 'node1': no network stack this role configures was found (netplan not installed, "
        "NetworkManager not running, ifupdown not installed), so nothing was changed"
    ) in " ".join(run.stdout.split()), _said(run)
    assert recap_of(run.stdout)["node1"]["changed"] == 0
    assert "torch-multinode-static-ip-apply" not in listing
