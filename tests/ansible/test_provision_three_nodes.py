"""A fresh 3-node simulated cluster: --check first (it succeeds and changes nothing), then
provisioning, a rerun that changes nothing, and a firewall run that removes a foreign rule."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass

import pytest

from tests.ansible.conftest import (
    PlaybookRun,
    ansible_playbook,
    image_id,
    node_sh,
    ship_image,
    snapshot,
    ufw_status_lines,
)

pytestmark = pytest.mark.sim
NODES = ["node1", "node2", "node3"]


@dataclass
class Provisioned:
    cluster: object
    containers: list[str]
    before: dict[str, str]
    check: PlaybookRun
    after_check: dict[str, str]
    first: PlaybookRun
    second: PlaybookRun
    firewall: PlaybookRun
    shipped: subprocess.CompletedProcess


@pytest.fixture(scope="module")
def provisioned(sim_factory, tiny_image, tmp_path_factory):
    cluster = sim_factory.up(3)
    try:
        inventory = cluster.config.inventory_path
        containers = [cluster.config.container(i) for i in (1, 2, 3)]
        before = snapshot(containers)
        check = ansible_playbook(inventory, "--check")
        after_check = snapshot(containers)
        first = ansible_playbook(inventory)
        shipped = ship_image(inventory, tiny_image)
        second = ansible_playbook(inventory)
        # A rule someone added by hand: the firewall role must take it out again.
        node_sh(containers[2], "ufw allow 8080/tcp")
        firewall = ansible_playbook(inventory, "--tags", "firewall")
        yield Provisioned(
            cluster, containers, before, check, after_check, first, second, firewall, shipped
        )
    finally:
        sim_factory.down(cluster)


def test_check_mode_on_fresh_nodes_succeeds_and_changes_nothing(provisioned):
    run = provisioned.check
    assert run.returncode == 0, run.describe()
    assert all(run.changed()[node] > 0 for node in NODES), run.describe()  # it does predict
    assert provisioned.after_check == provisioned.before
    assert all("debian-" in state.splitlines()[0] for state in provisioned.before.values())


def test_provisioning_succeeds_and_a_rerun_changes_nothing(provisioned):
    assert provisioned.first.returncode == 0, provisioned.first.describe()
    assert all(provisioned.first.changed()[node] > 0 for node in NODES)
    assert provisioned.second.returncode == 0, provisioned.second.describe()
    assert provisioned.second.changed() == dict.fromkeys(["localhost", *NODES], 0), (
        provisioned.second.describe()
    )


def test_every_node_reaches_every_node_by_name(provisioned):
    hosts = provisioned.cluster.inventory.hosts
    for container, host in zip(provisioned.containers, hosts, strict=True):
        assert node_sh(container, "hostname").stdout.strip() == host.name
        for peer in hosts:
            resolved = node_sh(container, f"getent hosts {peer.name}").stdout.split()
            assert resolved == [str(peer.compute_ip), peer.name]
            ssh = node_sh(
                container, f"ssh -o BatchMode=yes -o StrictHostKeyChecking=yes {peer.name} true"
            )
            assert ssh.returncode == 0, (host.name, peer.name, ssh.stderr)


def test_firewall_run_removes_a_foreign_rule_and_touches_nothing_else(provisioned):
    run = provisioned.firewall
    assert run.returncode == 0, run.describe()
    assert run.changed() == {"localhost": 0, "node1": 0, "node2": 0, "node3": 1}, run.describe()
    assert "ufw allow 8080/tcp" in run.output
    subnet = str(provisioned.cluster.inventory.compute_subnet)
    for container in provisioned.containers:
        status = node_sh(container, "ufw status").stdout
        assert [line.rstrip() for line in status.strip().splitlines()] == ufw_status_lines(subnet)


def test_every_node_holds_the_same_image_and_runs_docker(provisioned, tiny_image):
    assert provisioned.shipped.returncode == 0, provisioned.shipped.stderr
    ids = {image_id(tiny_image, container) for container in provisioned.containers}
    assert ids == {image_id(tiny_image)}
    for container in provisioned.containers:
        assert node_sh(container, "docker info --format '{{.ServerVersion}}'").returncode == 0
