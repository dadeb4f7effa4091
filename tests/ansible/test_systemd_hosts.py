"""Provisioning on hosts booted by systemd: the path real controllers and nodes take.

CI's controller and the simulated nodes have no init system, so provisioning takes its "no
init system" branches there (start-stop-daemon; proven by every provisioning test). Here the
playbooks run against containers booted by systemd (docker/sim-systemd), each on a network
this test creates, reached through the Docker engine (Ansible's community.docker connection):

- the image registry's controller half: its own unit, enabled, bound to the management
  address with client certificates required, back after a reboot; and on a controller where
  it cannot run (no package), the reason said and the play going on, nothing half set up;
- the whole of site.yml on a node with `scheduler: slurm`: Docker, SSH, munge, slurmctld and
  slurmd run as enabled units, a second run changes nothing, and after a reboot every one is
  back and Slurm runs a job;
- `cluster bootstrap --disable-password-login` on a fresh node: sshd reloaded through its
  unit, password login off, and still off after a reboot.
"""

from __future__ import annotations

import secrets
import shlex
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from tests.ansible.conftest import PLAYBOOKS, ansible_playbook, node_sh
from tests.conftest import REPO_ROOT
from tests.helpers import bootstrap_unattended, password_login
from torch_multinode.cluster.inventory_read import load
from torch_multinode.provision import bootstrap
from torch_multinode.sim import nodes as sim
from torch_multinode.sim import owned_network
from torch_multinode.sim.owned_network import SYSTEMD_OPTIONS, wait_for_boot

pytestmark = [pytest.mark.sim, pytest.mark.timeout(900)]

CERTS = "/etc/torch-multinode/registry"
# The units a provisioned node runs (ufw's is a one-shot that loads the rules at boot).
NODE_UNITS = ["ssh", "docker", "munge", "slurmctld", "slurmd"]


def reboot(container: str) -> None:
    sim.docker("restart", "-t", "30", container, timeout=120)
    wait_for_boot(container)


@pytest.fixture(scope="module")
def systemd_image() -> str:
    return owned_network.systemd_image()


@contextmanager
def booted(sim_factory, image: str, hostname: str, docker_volume: bool = False) -> Iterator:
    """A container booted by systemd, alone on a network of its own: (its SimConfig, which
    names the network and subnet, the container's name, its address)."""
    config = sim_factory.config()
    name, network = f"{config.name}-{hostname}", f"{config.name}-sd"
    volume = f"{config.name}-{hostname}-docker"
    address = config.node_ip(1)
    # A Docker engine inside keeps its images on a volume (overlayfs on overlayfs fails).
    mounts = ["-v", f"{volume}:/var/lib/docker"] if docker_volume else []
    sim.docker("network", "create", "--subnet", config.subnet, network)
    try:
        sim.docker(
            "run",
            "-d",
            "--name",
            name,
            "--hostname",
            hostname,
            "--network",
            network,
            "--ip",
            address,
            *SYSTEMD_OPTIONS,
            *mounts,
            image,
        )
        wait_for_boot(name)
        yield config, name, address
    finally:
        sim.docker("rm", "-f", "-v", name, check=False)
        sim.docker("network", "rm", network, check=False)
        if docker_volume:
            sim.docker("volume", "rm", volume, check=False)


def registry_answers(container: str, address: str, with_client_key: bool) -> str:
    """The HTTP status of GET /v2/ over TLS, trusting only the role's CA ("000": no answer, the
    handshake failed)."""
    client = (
        f"--cert {CERTS}/client.crt --key {CERTS}/private/client.key" if with_client_key else ""
    )
    done = node_sh(
        container,
        f"curl -sS -o /dev/null -w '%{{http_code}}' --cacert {CERTS}/ca.crt {client} "
        f"https://{address}:5000/v2/",
    )
    return done.stdout.strip()


def test_the_registry_runs_as_an_enabled_systemd_unit_bound_to_its_address(
    sim_factory, systemd_image, tmp_path
):
    with booted(sim_factory, systemd_image, "controller") as (config, name, address):
        _registry_on_a_systemd_controller(config, name, address, tmp_path)


def test_a_controller_that_cannot_run_the_registry_says_why_and_provisioning_goes_on(
    sim_factory, systemd_image, tmp_path
):
    with booted(sim_factory, systemd_image, "controller") as (config, name, address):
        # The distribution offers no registry package here (apt pins it away).
        node_sh(
            name,
            "printf 'Package: docker-registry\\nPin: release *\\nPin-Priority: -1\\n' "
            "> /etc/apt/preferences.d/no-registry",
        )
        inventory = _controller_inventory(config, name, tmp_path)
        run = ansible_playbook(
            inventory, "-e", "expect_registry=false", playbook=PLAYBOOKS / "registry_controller.yml"
        )
        assert run.returncode == 0, run.describe()  # the play went on to its end
        # What the role said, as Ansible's YAML output shows it (folded over lines).
        task = run.output.split("TASK [image_registry : Say that images will be streamed]")[1]
        said = yaml.safe_load(textwrap.dedent(task.split("\nTASK [")[0].split("=>", 1)[1]))
        assert said["msg"] == (
            "No image registry on the controller (Ensure the distribution's registry package is "
            "installed: no available installation candidate for docker-registry). `cluster ship` "
            "streams the image instead (docker save | ssh | docker load)."
        ), run.output[-3000:]
        # Nothing half set up: no instance, no trust for the controller's engine.
        left = node_sh(name, "ls /etc/docker/certs.d /etc/systemd/system | grep -c registry")
        assert left.stdout.strip() == "0", left.stdout


def _controller_inventory(config, name: str, tmp_path) -> Path:
    """The controller container (reached through Docker) and two nodes on its network, which
    nothing is sent to: the role only asks `ip route get` which of the controller's addresses
    reaches them."""
    inventory = tmp_path / "inventory.yml"
    controller = {
        "ansible_connection": "community.docker.docker",
        "ansible_host": name,
        "ansible_python_interpreter": "/usr/bin/python3",
    }
    nodes = {
        "node1": {"ansible_host": config.node_ip(2)},
        "node2": {"ansible_host": config.node_ip(3)},
    }
    document = {
        "all": {"hosts": {"controller": controller}, "children": {"nodes": {"hosts": nodes}}}
    }
    inventory.write_text(yaml.safe_dump(document))
    return inventory


def _registry_on_a_systemd_controller(config, name: str, address: str, tmp_path) -> None:
    inventory = _controller_inventory(config, name, tmp_path)
    unit = f"torch-multinode-registry-{address.replace('.', '-')}-5000"
    playbook = PLAYBOOKS / "registry_controller.yml"

    first = ansible_playbook(inventory, playbook=playbook, timeout=600)
    assert first.returncode == 0, first.describe()
    assert "TASK [image_registry : Ensure the instance runs and starts at boot]" in first.output

    # Its own unit, enabled, as the registry's user; the package's plain-HTTP instance is off.
    state = node_sh(
        name,
        f"systemctl is-active {unit}; systemctl is-enabled {unit}; "
        "systemctl is-active docker-registry; systemctl is-enabled docker-registry; "
        f"systemctl show -p User --value {unit}",
    )
    assert state.stdout.split() == ["active", "enabled", "inactive", "disabled", "docker-registry"]
    assert node_sh(name, "pgrep -c -x docker-registry").stdout.strip() == "1"  # systemd's, alone
    # Bound to the management address only, TLS with a client certificate required.
    listening = node_sh(name, "ss -Hltn 'sport = :5000' | awk '{print $4}'")
    assert listening.stdout.split() == [f"{address}:5000"], listening.stdout
    assert registry_answers(name, address, with_client_key=True) == "200"
    assert registry_answers(name, address, with_client_key=False) == "000"

    # The unit's sandbox (ProtectSystem=full) still lets it store what is pushed.
    blob = "hello from the systemd test\n"
    auth = f"--cacert {CERTS}/ca.crt --cert {CERTS}/client.crt --key {CERTS}/private/client.key"
    stored = node_sh(
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
    reboot(name)
    assert node_sh(name, f"systemctl is-active {unit}").stdout.strip() == "active"
    kept = node_sh(
        name,
        f"curl -sS -f {auth} https://{address}:5000/v2/probe/blobs/"
        f"sha256:$(printf %s {shlex.quote(blob)} | sha256sum | cut -d' ' -f1)",
    )
    assert kept.stdout == blob, kept.stdout + kept.stderr


def test_site_yml_on_a_systemd_node_runs_every_daemon_as_an_enabled_unit(
    sim_factory, systemd_image, tmp_path
):
    with booted(sim_factory, systemd_image, "node1", docker_volume=True) as (config, name, ip):
        try:
            _site_on_a_systemd_node(config, name, ip, tmp_path)
        finally:
            (REPO_ROOT / ".slurm" / f"{config.name}.munge.key").unlink(missing_ok=True)


def _site_on_a_systemd_node(config, name: str, address: str, tmp_path) -> None:
    inventory = tmp_path / "inventory.yml"
    settings = {
        "compute_subnet": config.subnet,
        "rendezvous_port": 29500,
        "ansible_connection": "community.docker.docker",
        "ansible_python_interpreter": "/usr/bin/python3",
        "launch_mode": "host",
        "training_python": "/usr/bin/python3",
        "scheduler": "slurm",
        "slurm_cluster_name": config.name,
        # Docker owns a container's /etc/hostname (a bind mount, which hostnamectl cannot
        # replace: the name is given at `docker run`) and its addresses.
        "hostname_set": False,
        "static_ip_enabled": False,
        "container_memlock": 8388608,
    }
    node = {"ansible_host": name, "compute_ip": address, "compute_interface": "eth0", "gpus": 0}
    document = {"all": {"vars": settings, "children": {"nodes": {"hosts": {"node1": node}}}}}
    inventory.write_text(yaml.safe_dump(document))

    first = ansible_playbook(inventory, timeout=800)
    assert first.returncode == 0, first.describe()
    assert "TASK [docker : Ensure the Docker engine runs and starts at boot]" in first.output
    again = ansible_playbook(inventory, timeout=600)
    assert again.returncode == 0, again.describe()
    assert set(again.changed().values()) == {0}, again.describe()

    def units() -> list[str]:
        states = node_sh(
            name,
            " ".join(f"systemctl is-active {u}; systemctl is-enabled {u};" for u in NODE_UNITS),
        )
        return states.stdout.split()

    def slurm_runs_a_job() -> None:
        # slurmd registers with slurmctld a moment after both start.
        deadline = time.monotonic() + 60
        while node_sh(name, "sinfo -h -o %t").stdout.strip() != "idle":
            assert time.monotonic() < deadline, node_sh(
                name, "sinfo; tail -5 /var/log/slurm/*.log"
            ).stdout
            time.sleep(1)
        job = node_sh(name, "timeout 60 srun -N1 hostname", timeout=90)
        assert (job.returncode, job.stdout.strip()) == (0, "node1"), job.stdout + job.stderr

    expected = ["active", "enabled"] * len(NODE_UNITS)
    assert units() == expected
    # Each daemon is the unit's own process, not one started by hand beside it.
    for daemon in ("dockerd", "munged", "slurmd"):
        assert node_sh(name, f"pgrep -c -x {daemon}").stdout.strip() == "1", daemon
    assert node_sh(name, "ufw status").stdout.startswith("Status: active")
    slurm_runs_a_job()

    reboot(name)
    assert units() == expected
    assert node_sh(name, "ufw status").stdout.startswith("Status: active")
    assert node_sh(name, "docker version --format '{{.Server.Version}}'").returncode == 0
    slurm_runs_a_job()


def test_bootstrap_turns_password_login_off_through_systemd(sim_factory, systemd_image, tmp_path):
    """On a fresh node booted by systemd, bootstrap reloads sshd through its unit (not a signal
    to a pid file), and password login stays off after a reboot."""
    with booted(sim_factory, systemd_image, "node1") as (config, name, address):
        _bootstrap_on_a_systemd_node(config, name, address, tmp_path)


def _bootstrap_on_a_systemd_node(config, name: str, address: str, tmp_path) -> None:
    # A fresh install's user: a password, sudo asking for it, SSH password login (Debian's
    # default), no key.
    password = secrets.token_urlsafe(12)
    assert node_sh(name, "useradd -m -s /bin/bash -G sudo trainer").returncode == 0
    sim.docker("exec", "-i", name, "chpasswd", stdin=f"trainer:{password}\n")
    sshd_before = node_sh(name, "systemctl show -p MainPID --value ssh").stdout.strip()
    assert sshd_before not in ("", "0")

    known_hosts, key = tmp_path / "known_hosts", tmp_path / "id_ed25519"
    known_hosts.write_text("")
    inventory = tmp_path / "inventory.yml"
    settings = {
        "compute_subnet": config.subnet,
        "ansible_user": "trainer",
        "ansible_ssh_private_key_file": str(key),
        "ssh_known_hosts_file": str(known_hosts),
    }
    node = {"ansible_host": address, "compute_ip": address, "compute_interface": "eth0", "gpus": 0}
    document = {"all": {"vars": settings, "children": {"nodes": {"hosts": {"node1": node}}}}}
    inventory.write_text(yaml.safe_dump(document))
    printed = node_sh(name, "ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub").stdout.split()[1]
    fingerprints = tmp_path / "fingerprints"
    fingerprints.write_text(f"node1 {printed}\n")
    host = load(inventory).hosts[0]

    done = bootstrap_unattended(inventory, fingerprints, password, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SSH password login off (" in done.stdout, done.stdout
    assert password not in done.stdout + done.stderr
    # Reloaded by systemd: the same sshd, still the unit's, now without password login.
    state = node_sh(name, "systemctl is-active ssh; systemctl show -p MainPID --value ssh")
    assert state.stdout.split() == ["active", sshd_before]
    journal = node_sh(name, "journalctl -u ssh --no-pager -o cat").stdout
    assert "Reloaded ssh.service" in journal or "Reloaded OpenBSD Secure Shell" in journal, journal
    assert password_login(host, known_hosts, password) == "not offered"
    assert bootstrap.key_login_works(host, known_hosts, "trainer") == (True, True)

    reboot(name)
    assert password_login(host, known_hosts, password) == "not offered"
    assert bootstrap.key_login_works(host, known_hosts, "trainer") == (True, True)
