"""An invalid inventory against real, fresh nodes: the validate play fails, naming the host
and the field, and no node is touched (the provisioning play never starts)."""

from __future__ import annotations

import pytest

from tests.ansible.conftest import (
    ansible_playbook,
    read_inventory,
    snapshot,
    write_inventory,
)

pytestmark = [pytest.mark.sim, pytest.mark.extended]


@pytest.fixture(scope="module")
def fresh(sim_factory):
    cluster = sim_factory.up(2)
    try:
        yield cluster
    finally:
        sim_factory.down(cluster)


def broken(cluster, tmp_path, change) -> str:
    document = read_inventory(cluster.config.inventory_path)
    change(document["all"])
    return str(write_inventory(document, tmp_path / "inventory.yml"))


@pytest.mark.parametrize(
    "change, message",
    [
        (
            lambda top: top["children"]["nodes"]["hosts"]["node2"].update(compute_ip="192.0.2.12"),
            "host 'node2': field 'compute_ip': 192.0.2.12 is outside compute_subnet {subnet}",
        ),
        (
            lambda top: top["children"]["nodes"]["hosts"]["node1"].pop("compute_interface"),
            "host 'node1': field 'compute_interface' is missing",
        ),
    ],
    ids=["compute-ip-outside-the-subnet", "missing-interface-on-the-first-node"],
)
def test_invalid_inventory_fails_in_validation_and_changes_nothing(
    fresh, tmp_path, change, message
):
    containers = [fresh.config.container(1), fresh.config.container(2)]
    path = broken(fresh, tmp_path, change)
    before = snapshot(containers)
    run = ansible_playbook(path)
    expected = f"inventory {path}: " + message.format(subnet=fresh.inventory.compute_subnet)
    assert run.returncode == 2, run.describe()
    assert any(f"Action failed: {expected}" in line for line in run.errors), run.describe()
    assert "PLAY [Provision every node" not in run.output, run.describe()
    # Only the controller ran anything: no task reached a node.
    assert run.changed() == {"localhost": 0}, run.describe()
    assert snapshot(containers) == before
