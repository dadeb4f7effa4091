"""The image registry as a systemd unit: the path a real controller takes.

CI's controller and the simulated nodes have no init system, so provisioning starts the
registry there with start-stop-daemon (proven by every provisioning test). Here the role's
controller half runs against a container booted by systemd (docker/sim-controller), on a
network this test creates, with two node addresses on it that nothing is sent to (the role
only asks `ip route get` which address reaches them).
"""

from __future__ import annotations

import shlex
import subprocess
import time

import pytest
import yaml

from cluster import sim
from tests.ansible.conftest import PLAYBOOKS, ansible_playbook
from tests.conftest import REPO_ROOT

pytestmark = [pytest.mark.sim, pytest.mark.timeout(900)]

IMAGE = "torch-multinode/sim-controller:test"
CERTS = "/etc/torch-multinode/registry"
# What a container needs for systemd as its PID 1 here (no --privileged: see ENVIRONMENT.md).
SYSTEMD_OPTIONS = [
    "--cap-add", "ALL", "--cap-drop", "SYS_RESOURCE",
    "--security-opt", "seccomp=unconfined", "--security-opt", "apparmor=unconfined",
    "--cgroupns", "private", "--tmpfs", "/run", "--tmpfs", "/run/lock",
]  # fmt: skip


def sh(container: str, script: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["docker", "exec", container, "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def wait_for_boot(container: str) -> None:
    """Until systemd says the boot is over (its bus appears a moment after the start)."""
    deadline = time.monotonic() + 120
    while True:
        done = sh(container, "systemctl is-system-running --wait", timeout=120)
        if done.stdout.strip() in ("running", "degraded") or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert done.stdout.strip() in ("running", "degraded"), done.stdout + done.stderr


@pytest.fixture(scope="module")
def controller(sim_factory, tmp_path_factory):
    """A controller container booted by systemd, alone on this test's own network."""
    sim.build_images()  # the base, cached after the first time
    sim.docker("build", "--quiet", "-t", IMAGE, str(REPO_ROOT / "docker" / "sim-controller"))
    config = sim_factory.config()
    name, network = f"{config.name}-controller", f"{config.name}-ctlnet"
    address = config.node_ip(1)
    sim.docker("network", "create", "--subnet", config.subnet, network)
    try:
        sim.docker(
            "run", "-d", "--name", name, "--hostname", "controller", "--network", network,
            "--ip", address, *SYSTEMD_OPTIONS, IMAGE,
        )  # fmt: skip
        wait_for_boot(name)
        inventory = tmp_path_factory.mktemp("registry-systemd") / "inventory.yml"
        inventory.write_text(
            yaml.safe_dump(
                {
                    "all": {
                        "hosts": {
                            "controller": {
                                "ansible_connection": "community.docker.docker",
                                "ansible_host": name,
                                "ansible_python_interpreter": "/usr/bin/python3",
                            }
                        },
                        "children": {
                            "nodes": {
                                "hosts": {
                                    "node1": {"ansible_host": config.node_ip(2)},
                                    "node2": {"ansible_host": config.node_ip(3)},
                                }
                            }
                        },
                    }
                }
            )
        )
        yield name, address, inventory
    finally:
        sim.docker("rm", "-f", name, check=False)
        sim.docker("network", "rm", network, check=False)


def registry_answers(container: str, address: str, with_client_key: bool) -> str:
    """The HTTP status of GET /v2/ over TLS, trusting only the role's CA ("000": no answer, the
    handshake failed)."""
    client = (
        f"--cert {CERTS}/client.crt --key {CERTS}/private/client.key" if with_client_key else ""
    )
    done = sh(
        container,
        f"curl -sS -o /dev/null -w '%{{http_code}}' --cacert {CERTS}/ca.crt {client} "
        f"https://{address}:5000/v2/",
    )
    return done.stdout.strip()


def test_the_registry_runs_as_an_enabled_systemd_unit_bound_to_its_address(controller):
    name, address, inventory = controller
    unit = f"torch-multinode-registry-{address.replace('.', '-')}-5000"
    playbook = PLAYBOOKS / "registry_controller.yml"

    first = ansible_playbook(inventory, playbook=playbook, timeout=600)
    assert first.returncode == 0, first.describe()
    assert "TASK [image_registry : Ensure the instance runs and starts at boot]" in first.output

    # Its own unit, enabled, as the registry's user; the package's plain-HTTP instance is off.
    state = sh(
        name,
        f"systemctl is-active {unit}; systemctl is-enabled {unit}; "
        "systemctl is-active docker-registry; systemctl is-enabled docker-registry; "
        f"systemctl show -p User --value {unit}",
    )
    assert state.stdout.split() == ["active", "enabled", "inactive", "disabled", "docker-registry"]
    assert sh(name, "pgrep -c -x docker-registry").stdout.strip() == "1"  # systemd's, alone
    # Bound to the management address only, TLS with a client certificate required.
    listening = sh(name, "ss -Hltn 'sport = :5000' | awk '{print $4}'")
    assert listening.stdout.split() == [f"{address}:5000"], listening.stdout
    assert registry_answers(name, address, with_client_key=True) == "200"
    assert registry_answers(name, address, with_client_key=False) == "000"

    # The unit's sandbox (ProtectSystem=full) still lets it store what is pushed.
    blob = "hello from the systemd test\n"
    auth = f"--cacert {CERTS}/ca.crt --cert {CERTS}/client.crt --key {CERTS}/private/client.key"
    stored = sh(
        name,
        f"set -e; base=https://{address}:5000/v2/probe/blobs; "
        f"digest=sha256:$(printf %s {shlex.quote(blob)} | sha256sum | cut -d' ' -f1); "
        f"upload=$(curl -sS -D - -o /dev/null -X POST {auth} $base/uploads/ "
        "| awk 'tolower($1)==\"location:\" {print $2}' | tr -d '\\r'); "
        f"printf %s {shlex.quote(blob)} | curl -sS -f -X PUT {auth} "
        "-H 'Content-Type: application/octet-stream' --data-binary @- \"$upload&digest=$digest\"; "
        f"curl -sS -f {auth} $base/$digest",
    )
    assert stored.returncode == 0 and stored.stdout == blob, stored.stdout + stored.stderr

    # A second run changes nothing.
    again = ansible_playbook(inventory, playbook=playbook, timeout=600)
    assert again.returncode == 0, again.describe()
    assert again.changed() == {"controller": 0}, again.describe()

    # After a reboot the unit is back by itself, serving what it stored.
    sim.docker("restart", name, timeout=120)
    wait_for_boot(name)
    assert sh(name, f"systemctl is-active {unit}").stdout.strip() == "active"
    assert registry_answers(name, address, with_client_key=True) == "200"
