"""`make provision` on nodes that are not ready for it (issue 28, finding 9): it stops before
the image and the playbook, one line per node naming what the node lacks, with make bootstrap
as the remedy, instead of Ansible's recap of unreachable hosts. The nodes are fresh installs
(what `make sim-up FRESH=1` starts), brought one step closer to ready at a time; none is
provisioned."""

from __future__ import annotations

import secrets
import subprocess

import pytest
import yaml

from tests.conftest import make, run_cli
from torch_multinode.provision import keys
from torch_multinode.sim import nodes as sim


@pytest.fixture(scope="module")
def fresh_nodes(sim_factory, tmp_path_factory):
    config = sim_factory.config()
    sim_factory.started.append(config)
    sim.up(2, None, config, fresh=True, fresh_password=secrets.token_urlsafe(12))
    # host mode: were the check to let it through, provisioning would build no image
    document = yaml.safe_load(config.inventory_path.read_text())
    document["all"]["vars"]["launch_mode"] = "host"
    inventory = tmp_path_factory.mktemp("fresh") / "inventory.yml"
    inventory.write_text(yaml.safe_dump(document, sort_keys=False))
    yield config, inventory
    sim_factory.down(sim.SimCluster(config, [config.container(i) for i in (1, 2)], None, False))


def _errors(done) -> list[str]:
    return [line for line in done.stderr.splitlines() if line.startswith("Error:")]


def _expected(config, inventory, what: str) -> list[str]:
    return [
        f"Error: host 'node{i}' ({config.mgmt_ip(i)}) is not ready for provisioning: "
        f"{what} (try make bootstrap INVENTORY={inventory})"
        for i in (1, 2)
    ]


@pytest.mark.sim
@pytest.mark.timeout(900)
def test_provision_on_nodes_not_bootstrapped_names_what_each_lacks(fresh_nodes):
    config, inventory = fresh_nodes
    known_hosts = config.known_hosts_path.resolve()
    key = config.key_path.resolve()

    # 1. As a fresh install leaves them: no host key known.
    done = make("provision", f"INVENTORY={inventory}", timeout=300)
    assert done.returncode != 0, done.stdout + done.stderr
    assert _errors(done) == _expected(
        config, inventory, f"its SSH host key is not in {known_hosts}"
    ), done.stderr
    assert "PLAY RECAP" not in done.stdout and "ansible-playbook" not in done.stdout

    # 2. Host keys known, but no key of ours is authorized there.
    public_key, _ = keys.ensure_key(key)
    entries = subprocess.run(
        ["ssh-keyscan", "-t", "ed25519", config.mgmt_ip(1), config.mgmt_ip(2)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    known_hosts.write_text(entries)
    done = run_cli("cluster", "ready", "-i", str(inventory))
    assert done.returncode == 1
    assert _errors(done) == _expected(
        config, inventory, f"it refuses key login as {sim.FRESH_USER} with {key}"
    ), done.stderr

    # 3. Key login works; sudo still asks for the password.
    home = f"/home/{sim.FRESH_USER}"
    for index in (1, 2):
        sim.docker(
            "exec",
            "-i",
            config.container(index),
            "sh",
            "-c",
            f"mkdir -p {home}/.ssh && cat >> {home}/.ssh/authorized_keys && "
            f"chown -R {sim.FRESH_USER}: {home}/.ssh && chmod 700 {home}/.ssh && "
            f"chmod 600 {home}/.ssh/authorized_keys",
            stdin=public_key + "\n",
        )
    done = make("provision", f"INVENTORY={inventory}", timeout=300)
    assert done.returncode != 0
    assert _errors(done) == _expected(
        config, inventory, f"sudo asks {sim.FRESH_USER} for a password (sudo -n true fails)"
    ), done.stderr
    assert "PLAY RECAP" not in done.stdout

    # A playbook given sudo's password (ANSIBLE_ARGS=-K) needs no passwordless sudo.
    done = run_cli("cluster", "ready", "-i", str(inventory), "--ask-become-pass")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "2 node(s) ready for provisioning: key login."
