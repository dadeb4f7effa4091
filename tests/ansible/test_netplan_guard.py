"""The netplan role's guard, on a simulated node with a stand-in for netplan.

The simulated nodes do not own their network (docker assigns their addresses), so a real
`netplan apply` cannot run there. The stand-in records every call and rejects any
configuration containing INVALID; everything else is the role as it runs on Ubuntu: the
candidate validated before it replaces the file, the apply detached with its rollback timer,
the confirmation from the controller, and the rollback when the address never answers.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tests.ansible.conftest import (
    PlaybookRun,
    ansible_playbook,
    node_sh,
    read_inventory,
    write_inventory,
)

pytestmark = pytest.mark.sim
FAKE_NETPLAN = "/usr/local/sbin/netplan-stand-in"
CALLS = "/var/log/netplan-stand-in.calls"
CONFIG = "/etc/netplan/60-torch-multinode-compute.yaml"
FAKE_NETPLAN_SCRIPT = rf"""#!/bin/sh
# Records each call; 'generate' rejects a configuration that contains INVALID.
root=/
[ "${{2:-}}" = --root-dir ] && root=$3
echo "$1 $(cat "$root"/etc/netplan/*.yaml 2>/dev/null | md5sum | cut -c1-8)" >> {CALLS}
if [ "$1" = generate ] && grep -rqs INVALID "$root/etc/netplan"; then
    echo "Error in network definition: INVALID is not an address" >&2
    exit 1
fi
"""


@dataclass
class Guarded:
    container: str
    compute_ip: str
    good: PlaybookRun
    good_config: str
    good_calls: list[str]
    rerun: PlaybookRun
    rerun_calls: list[str]
    invalid: PlaybookRun
    invalid_calls: list[str]
    invalid_config: str
    unanswered: PlaybookRun
    unanswered_calls: list[str]
    unanswered_config: str
    netplan_dir: str


def calls(container: str) -> list[str]:
    return node_sh(container, f"cat {CALLS} 2>/dev/null").stdout.splitlines()


@pytest.fixture(scope="module")
def guarded(sim_factory, tmp_path_factory):
    cluster = sim_factory.up(1)
    try:
        container = cluster.config.container(1)
        install = node_sh(
            container,
            f"mkdir -p /etc/netplan && cat > {FAKE_NETPLAN} <<'EOF'\n"
            f"{FAKE_NETPLAN_SCRIPT}EOF\nchmod 755 {FAKE_NETPLAN}",
        )
        assert install.returncode == 0, install.stderr
        document = read_inventory(cluster.config.inventory_path)
        # A generous window where the change is confirmed, a short one where it cannot be.
        document["all"]["vars"].update(
            netplan_enabled=True, netplan_command=FAKE_NETPLAN, netplan_confirm_timeout=90
        )
        directory = tmp_path_factory.mktemp("netplan")
        inventory = write_inventory(document, directory / "inventory.yml")
        node = document["all"]["children"]["nodes"]["hosts"]["node1"]

        def run(path=inventory, *args):
            return ansible_playbook(path, "--tags", "netplan", *args)

        good = run()
        good_config = node_sh(container, f"cat {CONFIG}").stdout
        good_calls = calls(container)
        rerun = run()
        rerun_calls = calls(container)
        invalid = run(inventory, "-e", '{"netplan_nameservers": ["INVALID"]}')
        invalid_calls = calls(container)
        invalid_config = node_sh(container, f"cat {CONFIG}").stdout
        # An address the interface never gets: the node cannot confirm it and must roll back.
        node["compute_ip"] = str(cluster.inventory.compute_subnet.network_address + 99)
        document["all"]["vars"]["netplan_confirm_timeout"] = 10
        unanswered = run(write_inventory(document, directory / "unanswered.yml"))
        yield Guarded(
            container,
            str(cluster.inventory.hosts[0].compute_ip),
            good,
            good_config,
            good_calls,
            rerun,
            rerun_calls,
            invalid,
            invalid_calls,
            invalid_config,
            unanswered,
            calls(container),
            node_sh(container, f"cat {CONFIG}").stdout,
            node_sh(container, "ls -A /etc/netplan").stdout,
        )
    finally:
        sim_factory.down(cluster)


def test_a_valid_configuration_is_validated_then_applied_and_confirmed(guarded):
    assert guarded.good.returncode == 0, guarded.good.describe()
    assert guarded.good.changed()["node1"] > 0
    assert f"- {guarded.compute_ip}/24" in guarded.good_config
    # Validated in a scratch root before it replaced the file, then applied once.
    assert [call.split()[0] for call in guarded.good_calls] == ["generate", "apply"]


def test_an_unchanged_configuration_is_neither_rewritten_nor_reapplied(guarded):
    assert guarded.rerun.returncode == 0, guarded.rerun.describe()
    assert guarded.rerun.changed()["node1"] == 0, guarded.rerun.describe()
    assert guarded.rerun_calls == guarded.good_calls


def test_an_invalid_configuration_never_replaces_the_file(guarded):
    run = guarded.invalid
    assert run.returncode == 2, run.describe()
    assert any(
        "netplan rejected the configuration for eth1" in line and "failed to validate" in line
        for line in run.errors
    ), run.describe()
    assert guarded.invalid_config == guarded.good_config
    new_calls = guarded.invalid_calls[len(guarded.good_calls) :]
    assert [call.split()[0] for call in new_calls] == ["generate"]  # and no apply


def test_an_address_that_never_answers_is_rolled_back(guarded):
    run = guarded.unanswered
    assert run.returncode == 2, run.describe()
    assert any("the new netplan configuration was not confirmed" in line for line in run.errors), (
        run.describe()
    )
    # Applied, not confirmed, and the previous file brought back and applied again.
    new_calls = guarded.unanswered_calls[len(guarded.invalid_calls) :]
    assert [call.split()[0] for call in new_calls] == ["generate", "apply", "apply"]
    assert guarded.unanswered_config == guarded.good_config
    assert guarded.netplan_dir.split() == ["60-torch-multinode-compute.yaml"]  # no backup left
