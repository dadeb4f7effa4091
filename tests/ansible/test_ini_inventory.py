"""The same simulated cluster described the way many Ansible users already describe theirs: an
INI file, the cluster's values in group_vars/all.yml beside it, the nodes in a group of the
user's own naming (GROUP=gpu_boxes) beside another group that is not ours to touch.
Provisioning, netcheck and the launcher all read it through ansible-core's loader, and see the
same values: the checkpoint root and rendezvous port set only in group_vars/ are where
provisioning made the directory, where the job writes its checkpoints, and the port netcheck and
the job use."""

from __future__ import annotations

import json
import subprocess

import pytest
import yaml

from tests.ansible.conftest import node_sh
from tests.conftest import VENV_BIN, make
from tests.training.conftest import TINY

pytestmark = pytest.mark.sim
CHECKPOINT_ROOT = "/srv/tmn-group-vars-checkpoints"
PORT = 29611
GROUP = "gpu_boxes"


def _ini_inventory(cluster, directory):
    """The sim's own YAML inventory rewritten as INI + group_vars/all.yml, the nodes in GROUP.
    Another group holds a host no tool may touch: were one to, it would meet a closed port on
    loopback and fail at once."""
    document = yaml.safe_load(cluster.config.inventory_path.read_text())
    cluster_vars = document["all"]["vars"]
    hosts = document["all"]["children"]["nodes"]["hosts"]
    lines = [f"[{GROUP}]"]
    for name, own in hosts.items():
        lines.append(f"{name} ansible_host={own['ansible_host']} compute_ip={own['compute_ip']}")
    lines += ["", f"[{GROUP}:vars]", "compute_interface=eth1", "gpus=0", ""]
    lines += ["[laptops]", "laptop ansible_host=127.0.0.1 ansible_port=1", ""]
    (directory / "group_vars").mkdir()
    (directory / "group_vars" / "all.yml").write_text(
        yaml.safe_dump(
            {**cluster_vars, "checkpoint_root": CHECKPOINT_ROOT, "rendezvous_port": PORT}
        )
    )
    path = directory / "cluster.ini"
    path.write_text("\n".join(lines))
    return path


@pytest.mark.timeout(1800)
def test_an_ini_inventory_with_group_vars_provisions_checks_and_trains(sim_factory, tmp_path):
    cluster = sim_factory.up(2)
    try:
        inventory = _ini_inventory(cluster, tmp_path)
        checked = make("check-inventory", f"INVENTORY={inventory}", f"GROUP={GROUP}", timeout=120)
        assert checked.returncode == 0, checked.stderr
        assert (
            f"2 host(s), compute subnet {cluster.inventory.compute_subnet}, rendezvous port {PORT}"
            in (checked.stdout)
        )

        provision = make("provision", f"INVENTORY={inventory}", f"GROUP={GROUP}", timeout=1500)
        assert provision.returncode == 0, provision.stdout[-4000:] + provision.stderr[-2000:]
        for index in (1, 2):
            made = node_sh(
                cluster.config.container(index), f"test -d {CHECKPOINT_ROOT} && echo made"
            )
            assert made.stdout == "made\n"

        netcheck = subprocess.run(
            [str(VENV_BIN / "netcheck"), "-i", str(inventory), "--group", GROUP, "--json"],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert netcheck.returncode == 0, netcheck.stdout[-3000:] + netcheck.stderr
        assert json.loads(netcheck.stdout)["ok"] is True

        args = " ".join(
            [*TINY, "--steps", "4", "--checkpoint-every", "2", "--checkpoint-dir", "gv"]
        )
        train = make(
            "train", f"INVENTORY={inventory}", f"GROUP={GROUP}", f"ARGS={args}", timeout=900
        )
        assert train.returncode == 0, train.stdout[-4000:] + train.stderr
        assert f":{PORT}" in train.stdout, train.stdout[-3000:]
        saved = node_sh(cluster.config.container(1), f"ls {CHECKPOINT_ROOT}/gv")
        assert saved.returncode == 0 and saved.stdout.strip(), saved.stderr
    finally:
        sim_factory.down(cluster)
