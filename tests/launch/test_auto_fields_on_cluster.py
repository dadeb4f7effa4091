"""Issue 50, on the simulated cluster: the shared provisioned cluster described as a user of
another tool's inventory would describe it, every host saying `compute_interface: auto` and
`gpus: auto`, provisions (the roles that use the compute interface, which find it from the
node's facts; `cluster image`, which asks the nodes for their GPUs), passes netcheck and
trains, each command saying what it found on the nodes.

Runs on the `provisioned` cluster (the `image` group, tests/conftest.py), with a copy of its
inventory beside which netcheck writes its files; the nodes are left as they were (the
roles find every task in place: eth1 is what the inventory names)."""

from __future__ import annotations

import shutil

import pytest
import yaml

from tests.ansible.conftest import recap_of
from tests.conftest import REPO_ROOT, make
from tests.helpers import run_id_in
from tests.training.conftest import TINY

pytestmark = [pytest.mark.sim, pytest.mark.timeout(1800)]


def test_a_cluster_described_with_auto_provisions_passes_netcheck_and_trains(provisioned, tmp_path):
    document = yaml.safe_load(provisioned.inventory.read_text())
    hosts = document["all"]["children"]["nodes"]["hosts"]
    for host in hosts.values():
        host.update(compute_interface="auto", gpus="auto")
    inventory = tmp_path / "inventory.yml"
    inventory.write_text(yaml.safe_dump(document, sort_keys=False))
    compute = {name: host["compute_ip"] for name, host in hosts.items()}

    check = make("check-inventory", f"INVENTORY={inventory}", timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr
    assert check.stdout.count("(auto, found at provision)  gpus auto (found at provision)") == 2

    # Provisioning: the roles that use compute_interface (static_ip, off on these nodes but
    # finding the interface all the same; nccl_config, whose file must stay as it is) and the
    # nvidia role (gpus: auto, no GPU on the PCI bus); `cluster image` asks the nodes for
    # their GPUs before it decides which image they need.
    provision = make(
        "provision",
        f"INVENTORY={inventory}",
        "ANSIBLE_ARGS=--tags static_ip,nccl_config,nvidia",
        timeout=1200,
    )
    said = provision.stdout + provision.stderr
    assert provision.returncode == 0, said[-6000:]
    for name, ip in compute.items():
        assert (
            f"found on the node (auto in the inventory): {name}: compute_interface eth1 (holds "
            f"{ip}), gpus 0 (no nvidia-smi)"
        ) in provision.stderr, said[-6000:]
        assert f"{name}: compute_interface auto is eth1, which holds {ip} (found at provision)" in (
            " ".join(provision.stdout.split())
        ), provision.stdout[-6000:]
    recap = recap_of(provision.stdout)
    assert {name: recap[name]["changed"] for name in hosts} == {"node1": 0, "node2": 0}, said

    netcheck = make("netcheck", f"INVENTORY={inventory}", timeout=600)
    assert netcheck.returncode == 0, netcheck.stdout[-6000:] + netcheck.stderr
    for name in hosts:
        assert (
            f"found on {name} (auto in the inventory): compute_interface eth1, gpus 0 "
            "(no nvidia-smi)"
        ) in netcheck.stdout
    assert "ready: 0 FAIL" in netcheck.stdout

    train = make(
        "train",
        f"INVENTORY={inventory}",
        "NNODES=2",
        "ARGS=" + " ".join([*TINY, "--steps", "2"]),
        timeout=900,
    )
    try:
        assert train.returncode == 0, train.stdout[-6000:] + train.stderr
        for name, ip in compute.items():
            assert (
                f"[launcher] found on the node (auto in the inventory): {name}: "
                f"compute_interface eth1 (holds {ip}), gpus 0 (no nvidia-smi)"
            ) in train.stdout.splitlines()
    finally:
        if "[launcher] job " in train.stdout:
            shutil.rmtree(REPO_ROOT / ".runs" / run_id_in(train.stdout), ignore_errors=True)
