"""One fresh 3-node simulated cluster, provisioned once for every test here (provisioning is
most of this module's time, so the scenario is one):

1. node1's /etc/hosts gets the Debian installer's line for the machine's own name and an
   entry of the site's, and each node's state is read (`before`);
2. `site.yml --check` succeeds, predicts changes and changes nothing (read again);
3. the first run provisions every node, and `cluster ship` streams the image to them;
4. a second run changes nothing, and shipping again sends nothing;
5. a rule added by hand on node3 is taken out by a `--tags firewall` run, which touches
   nothing else;
6. last, the same nodes described as an INI file with group_vars/ provision, check and train.

The nodes end up named, resolving, meshed, firewalled, with Docker, rsync, the job directories
and the same image. Tests that change a node (extra firewall openings, a running job) put it
back as they found it."""

from __future__ import annotations

import itertools
import json
import signal
import subprocess
from dataclasses import dataclass

import pytest
import yaml

from tests.ansible.conftest import (
    Listener,
    PlaybookRun,
    ansible_playbook,
    image_id,
    listening_tcp,
    node_sh,
    node_tcp_connects,
    node_tcp_probe,
    ship_image,
    snapshot,
    tcp_connects,
    ufw_status_lines,
)
from tests.conftest import VENV_BIN, make
from tests.helpers import SCRIPTS
from tests.training.conftest import TINY

# The first test's time holds the module's cluster: three fresh nodes taken through site.yml
# four times (779 s in CI run 23, 802 s in stop 56's landing, 911 s beside a busy run).
pytestmark = [pytest.mark.sim, pytest.mark.timeout(1800)]
LISTEN_PORT = 47123
NODES = ["node1", "node2", "node3"]


@dataclass
class Provisioned:
    cluster: object
    before: dict[str, str]
    check: PlaybookRun
    after_check: dict[str, str]
    first: PlaybookRun
    shipped: subprocess.CompletedProcess
    second: PlaybookRun
    reshipped: subprocess.CompletedProcess
    firewall: PlaybookRun

    @property
    def hosts(self):
        return self.cluster.inventory.hosts

    def container(self, host) -> str:
        return self.cluster.config.container(self.hosts.index(host) + 1)

    @property
    def containers(self) -> list[str]:
        return [self.container(host) for host in self.hosts]


@pytest.fixture(scope="module")
def provisioned(sim_factory, tiny_image):
    cluster = sim_factory.up(len(NODES))
    try:
        inventory = cluster.config.inventory_path
        containers = [cluster.config.container(i) for i in range(1, len(NODES) + 1)]
        # The Debian installer's line for the machine's own name, and an entry of the site's:
        # written before the first look, so that --check is proven on them too.
        seeded = node_sh(
            containers[0],
            r"printf '127.0.1.1\tnode1.lan node1\n192.0.2.7\tprinter\n' >> /etc/hosts",
        )
        assert seeded.returncode == 0, seeded.stderr
        before = snapshot(containers)
        check = ansible_playbook(inventory, "--check")
        after_check = snapshot(containers)
        first = ansible_playbook(inventory)
        shipped = ship_image(inventory, tiny_image)
        second = ansible_playbook(inventory) if first.returncode == 0 else first
        reshipped = ship_image(inventory, tiny_image)
        # A rule someone added by hand: the firewall role must take it out again.
        foreign = node_sh(containers[2], "ufw allow 8080/tcp")
        assert foreign.returncode == 0, foreign.stderr
        firewall = ansible_playbook(inventory, "--tags", "firewall")
        yield Provisioned(
            cluster, before, check, after_check, first, shipped, second, reshipped, firewall
        )
    finally:
        sim_factory.down(cluster)


def test_check_mode_on_fresh_nodes_succeeds_and_changes_nothing(provisioned):
    run = provisioned.check
    assert run.returncode == 0, run.describe()
    assert all(run.changed()[node] > 0 for node in NODES), run.describe()  # it does predict
    assert provisioned.after_check == provisioned.before
    assert all("debian-" in state.splitlines()[0] for state in provisioned.before.values())


def test_first_run_provisions_every_node(provisioned):
    run = provisioned.first
    assert run.returncode == 0, run.describe()
    assert run.failed() == {"localhost": 0, "node1": 0, "node2": 0, "node3": 0}, run.describe()
    assert all(run.changed()[node] > 0 for node in NODES), run.describe()


def test_second_run_changes_nothing(provisioned):
    run = provisioned.second
    assert run.returncode == 0, run.describe()
    assert run.changed() == {"localhost": 0, "node1": 0, "node2": 0, "node3": 0}, run.describe()


def test_provisioning_succeeds_and_a_rerun_changes_nothing(provisioned):
    assert provisioned.first.returncode == 0, provisioned.first.describe()
    assert all(provisioned.first.changed()[node] > 0 for node in NODES)
    assert provisioned.second.returncode == 0, provisioned.second.describe()
    assert provisioned.second.changed() == dict.fromkeys(["localhost", *NODES], 0), (
        provisioned.second.describe()
    )


def test_every_hostname_is_the_inventory_name(provisioned):
    for host in provisioned.hosts:
        proc = node_sh(provisioned.container(host), "hostname; cat /etc/hostname")
        assert proc.stdout.split() == [host.name, host.name]


def test_every_node_resolves_every_node_to_its_compute_ip(provisioned):
    for host, peer in itertools.product(provisioned.hosts, repeat=2):
        proc = node_sh(provisioned.container(host), f"getent hosts {peer.name}")
        assert proc.stdout.split() == [str(peer.compute_ip), peer.name], (host.name, peer.name)


def test_own_name_leaves_loopback_and_other_entries_stay(provisioned):
    node1 = provisioned.hosts[0]
    lines = node_sh(provisioned.container(node1), "cat /etc/hosts").stdout.splitlines()
    marker = "torch-multinode cluster nodes (managed by Ansible)"
    block = len(provisioned.hosts) + 2
    assert lines[-block:] == [
        f"# BEGIN {marker}",
        *(f"{host.compute_ip}\t{host.name}" for host in provisioned.hosts),
        f"# END {marker}",
    ]
    assert "127.0.1.1\tnode1.lan" in lines  # the seeded line, without our name
    assert "192.0.2.7\tprinter" in lines
    assert lines[0] == "127.0.0.1\tlocalhost"
    ours = [line for line in lines[:-block] if "node1" in line.split("#")[0].split()[1:]]
    assert ours == []


def test_every_node_reaches_every_node_by_name(provisioned):
    hosts = provisioned.hosts
    for container, host in zip(provisioned.containers, hosts, strict=True):
        assert node_sh(container, "hostname").stdout.strip() == host.name
        for peer in hosts:
            resolved = node_sh(container, f"getent hosts {peer.name}").stdout.split()
            assert resolved == [str(peer.compute_ip), peer.name]
            ssh = node_sh(
                container, f"ssh -o BatchMode=yes -o StrictHostKeyChecking=yes {peer.name} true"
            )
            assert ssh.returncode == 0, (host.name, peer.name, ssh.stderr)


def test_ssh_between_every_pair_of_nodes_with_host_keys_checked(provisioned):
    for host, peer in itertools.product(provisioned.hosts, repeat=2):
        for target in (peer.name, str(peer.compute_ip)):
            proc = node_sh(
                provisioned.container(host),
                f"ssh -o BatchMode=yes -o StrictHostKeyChecking=yes {target} hostname",
            )
            assert (proc.returncode, proc.stdout.strip()) == (0, peer.name), (
                host.name,
                target,
                proc.stderr,
            )
    # An address whose key was never recorded (the peer's management side) is refused,
    # and no key was learned on first use along the way.
    node1, node2 = provisioned.hosts[:2]
    proc = node_sh(
        provisioned.container(node1),
        f"ssh -o BatchMode=yes {node2.ssh_address} true; ls /root/.ssh",
    )
    assert "Host key verification failed." in proc.stderr
    assert "known_hosts" not in proc.stdout.split()


def test_firewall_is_active_with_exactly_our_rules(provisioned):
    for host in provisioned.hosts:
        status = node_sh(provisioned.container(host), "ufw status").stdout
        assert [line.rstrip() for line in status.strip().splitlines()] == ufw_status_lines(
            provisioned.cluster.inventory
        )
        verbose = node_sh(provisioned.container(host), "ufw status verbose").stdout
        assert "Default: deny (incoming), allow (outgoing), deny (routed)" in verbose.splitlines()


def test_firewall_run_removes_a_foreign_rule_and_touches_nothing_else(provisioned):
    run = provisioned.firewall
    assert run.returncode == 0, run.describe()
    assert run.changed() == {"localhost": 0, "node1": 0, "node2": 0, "node3": 1}, run.describe()
    assert "ufw allow 8080/tcp" in run.output
    for container in provisioned.containers:
        status = node_sh(container, "ufw status").stdout
        assert [line.rstrip() for line in status.strip().splitlines()] == ufw_status_lines(
            provisioned.cluster.inventory
        )


def test_nccl_reads_the_compute_interface_from_its_own_configuration_file(provisioned):
    """/etc/nccl.conf, which NCCL reads in every process (a launcher typed by hand included):
    the inventory's compute interface in the exact-match form, and nothing else."""
    for host in provisioned.hosts:
        found = node_sh(
            provisioned.container(host), "cat /etc/nccl.conf; stat -c '%a %U' /etc/nccl.conf"
        )
        assert found.stdout == f"NCCL_SOCKET_IFNAME=={host.compute_interface}\n644 root\n"


def test_extra_openings_come_from_the_defaults_and_go_when_removed(provisioned):
    """A node exporter's port from one source, another port from anywhere: added beside ours,
    a rerun changes nothing, and dropped again (rule removal stays on) once no longer asked."""
    inventory = provisioned.cluster.config.inventory_path
    extra = json.dumps(
        {
            "firewall_allowed_udp_ports": [9999],
            "firewall_additional_rules": [{"port": 9100, "from_ip": "192.0.2.5"}],
        }
    )
    wanted = ["ufw allow 9999/udp", "ufw allow from 192.0.2.5 to any port 9100 proto tcp"]
    base = [
        "ufw allow 22/tcp",
        f"ufw allow from {provisioned.cluster.inventory.compute_subnet} proto tcp",
        *(
            f"ufw allow from {host.ssh_address} to any port "
            f"{provisioned.cluster.inventory.lighthouse_port} proto tcp"
            for host in provisioned.hosts
        ),
    ]
    try:
        added = ansible_playbook(inventory, "--tags", "firewall", "-e", extra)
        assert added.failed() == {"localhost": 0, "node1": 0, "node2": 0, "node3": 0}, (
            added.describe()
        )
        for host in provisioned.hosts:
            shown = node_sh(provisioned.container(host), "ufw show added").stdout
            assert [line for line in shown.splitlines() if line.startswith("ufw ")] == base + wanted
        again = ansible_playbook(inventory, "--tags", "firewall", "-e", extra)
        assert set(again.changed().values()) == {0}, again.describe()
        bad = ansible_playbook(
            inventory, "--tags", "firewall", "-e", '{"firewall_allowed_tcp_ports": [70000]}'
        )
        assert bad.returncode != 0 and "take port numbers (1-65535)" in bad.output
    finally:
        removed = ansible_playbook(inventory, "--tags", "firewall")
    assert removed.failed() == {"localhost": 0, "node1": 0, "node2": 0, "node3": 0}, (
        removed.describe()
    )
    for host in provisioned.hosts:
        status = node_sh(provisioned.container(host), "ufw status").stdout
        assert [line.rstrip() for line in status.strip().splitlines()] == ufw_status_lines(
            provisioned.cluster.inventory
        )


def test_firewall_drops_traffic_from_outside_the_compute_subnet_only(provisioned):
    node1, node2 = provisioned.hosts[:2]
    with Listener(provisioned.container(node1), LISTEN_PORT):
        # From the controller and from a peer's management side: both outside the subnet.
        assert not tcp_connects(node1.ssh_address, LISTEN_PORT)
        assert not node_tcp_connects(provisioned.container(node2), node1.ssh_address, LISTEN_PORT)
        # From the peer inside the subnet, by address and by name.
        assert node_tcp_connects(provisioned.container(node2), str(node1.compute_ip), LISTEN_PORT)
        assert node_tcp_connects(provisioned.container(node2), node1.name, LISTEN_PORT)
        # SSH stays open from outside.
        assert tcp_connects(node1.ssh_address, 22)


def test_while_a_job_runs_every_port_but_ssh_is_closed_from_outside_the_compute_subnet(
    provisioned,
):
    """Every TCP listener of the master during a real job that is bound beyond its compute
    address (sshd, the rendezvous store, gloo's own ports listen on all addresses) is probed on
    its management address from a peer's management address, outside the compute subnet: only
    SSH answers, so the path works and the firewall is what stops the rest. The same peer on
    the compute subnet reaches the rendezvous port. (A source outside the subnet cannot be made
    to reach the compute address here: the Docker host rewrites it to its bridge address.)"""
    node1, node2 = provisioned.hosts[:2]
    master, peer = provisioned.container(node1), provisioned.container(node2)
    rendezvous = provisioned.cluster.inventory.rendezvous_port
    job = subprocess.Popen(
        [
            str(VENV_BIN / "train"),
            "-i",
            str(provisioned.cluster.config.inventory_path),
            "--script",
            str(SCRIPTS / "endless_allreduce.py"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        seen = []
        for line in job.stdout:
            seen.append(line)
            if "rank 1 step 10" in line:
                break
        else:
            raise AssertionError("the job never ran:\n" + "".join(seen[-40:]))
        listeners = listening_tcp(master)
        outward = sorted(
            {
                port
                for address, port in listeners
                if address in ("0.0.0.0", "::", "*", node1.ssh_address)
            }
        )
        assert 22 in outward and rendezvous in outward and len(outward) >= 3, listeners  # gloo's
        targets = [(node1.ssh_address, port) for port in outward]
        outside = node_tcp_probe(peer, node2.ssh_address, targets)
        assert outside == {target: target[1] == 22 for target in targets}, outside
        inside = node_tcp_probe(peer, str(node2.compute_ip), [(str(node1.compute_ip), rendezvous)])
        assert list(inside.values()) == [True]
        assert job.poll() is None, "the job did not survive the probes"
    finally:
        job.send_signal(signal.SIGINT)
        job.communicate(timeout=60)


def test_docker_runs_and_every_node_holds_the_controllers_image(provisioned, tiny_image):
    # Jobs of this inventory run on the hosts, so no registry was set up: the image was
    # streamed, and `cluster ship` said so and why; the second time nothing moved.
    shipped = provisioned.shipped
    assert shipped.returncode == 0, shipped.stderr
    lines = shipped.stdout.splitlines()
    assert lines[0].startswith(f"Shipping {tiny_image} (")
    assert lines[0].endswith(
        ") to node1, node2, node3 by stream (docker save | ssh | docker load, each node sent "
        "only the layers it lacks): no registry is set up for "
        f"{provisioned.cluster.config.mgmt_gateway}:5000 (make provision sets it up)."
    )
    assert lines[-1].startswith(f"Done: {tiny_image} (") and "by stream" in lines[-1]
    reshipped = provisioned.reshipped
    assert reshipped.returncode == 0, reshipped.stderr
    assert reshipped.stdout.startswith(f"Every node already holds {tiny_image} (")
    assert reshipped.stdout.rstrip().endswith("): nothing sent.")
    expected = image_id(tiny_image)
    assert expected.startswith("sha256:")
    for host in provisioned.hosts:
        container = provisioned.container(host)
        engine = node_sh(container, "docker info --format '{{.ServerVersion}}'")
        assert engine.returncode == 0 and engine.stdout.strip(), engine.stderr
        assert image_id(tiny_image, container) == expected


def test_every_node_holds_the_same_image_and_runs_docker(provisioned, tiny_image):
    assert provisioned.shipped.returncode == 0, provisioned.shipped.stderr
    ids = {image_id(tiny_image, container) for container in provisioned.containers}
    assert ids == {image_id(tiny_image)}
    for container in provisioned.containers:
        assert node_sh(container, "docker info --format '{{.ServerVersion}}'").returncode == 0


def test_rsync_is_installed_and_the_job_directories_belong_to_the_training_user(provisioned):
    inventory = provisioned.cluster.inventory
    directories = [inventory.checkpoint_root, inventory.data_root, inventory.workdir_root]
    for host in provisioned.hosts:
        container = provisioned.container(host)
        rsync = node_sh(container, r"dpkg-query -W -f '${Status}\n' rsync; command -v rsync")
        assert rsync.stdout.splitlines() == ["install ok installed", "/usr/bin/rsync"], (
            host.name,
            rsync.stderr,
        )
        group = node_sh(container, f"id -gn {host.ssh_user}").stdout.strip()
        assert group, host.name
        made = node_sh(container, "stat -c '%n %F %U:%G %a' " + " ".join(directories))
        assert made.stdout.splitlines() == [
            f"{directory} directory {host.ssh_user}:{group} 755" for directory in directories
        ], (host.name, made.stderr)


# The INI scenario's values, set only in its group_vars/.
GROUP_VARS_CHECKPOINTS = "/srv/tmn-group-vars-checkpoints"
GROUP_VARS_PORT = 29611
GROUP = "gpu_boxes"


def _ini_inventory(cluster, directory):
    """The cluster's own YAML inventory rewritten as many Ansible users describe theirs: an INI
    file, the cluster's values in group_vars/all.yml beside it, the nodes in a group of the
    user's own naming beside another group that is not ours to touch (were a tool to touch its
    host, it would meet a closed port on loopback and fail at once)."""
    document = yaml.safe_load(cluster.config.inventory_path.read_text())
    cluster_vars = document["all"]["vars"]
    hosts = document["all"]["children"]["nodes"]["hosts"]
    lines = [f"[{GROUP}]"]
    for name, own in hosts.items():
        lines.append(f"{name} ansible_host={own['ansible_host']} compute_ip={own['compute_ip']}")
    lines += ["", f"[{GROUP}:vars]", "compute_interface=eth1", "gpus=0", ""]
    lines += ["[laptops]", "laptop ansible_host=127.0.0.1 ansible_port=1", ""]
    (directory / "group_vars").mkdir()
    values = {"checkpoint_root": GROUP_VARS_CHECKPOINTS, "rendezvous_port": GROUP_VARS_PORT}
    (directory / "group_vars" / "all.yml").write_text(yaml.safe_dump({**cluster_vars, **values}))
    path = directory / "cluster.ini"
    path.write_text("\n".join(lines))
    return path


@pytest.mark.timeout(1200)
def test_an_ini_inventory_with_group_vars_provisions_checks_and_trains(provisioned, tmp_path):
    """Last here: it changes the nodes' checkpoint root. Provisioning (the roles that read
    these values), netcheck and the launcher all read the INI inventory through ansible-core's
    loader and see the same values: the checkpoint root and rendezvous port set only in
    group_vars/ are where provisioning made the directory, where the job writes its
    checkpoints, and the port netcheck and the job use."""
    cluster = provisioned.cluster
    inventory = _ini_inventory(cluster, tmp_path)
    try:
        checked = make("check-inventory", f"INVENTORY={inventory}", f"GROUP={GROUP}", timeout=120)
        assert checked.returncode == 0, checked.stderr
        subnet = cluster.inventory.compute_subnet
        assert f"3 host(s), compute subnet {subnet}, rendezvous port {GROUP_VARS_PORT}" in (
            checked.stdout
        )

        # The roles that read what group_vars/ sets (validate, job_storage's directories, the
        # firewall's rendezvous port), then the image shipped and the versions locked, as
        # `make provision` does; the other roles ran on these nodes above, from the YAML.
        skipped = "docker,ssh_mesh,nvidia,static_ip,hostname,nccl_config,image_registry,slurm"
        provision = make(
            "provision",
            f"INVENTORY={inventory}",
            f"GROUP={GROUP}",
            f"ANSIBLE_ARGS=--skip-tags {skipped}",
            timeout=1500,
        )
        assert "TASK [firewall : " in provision.stdout, provision.stdout[-4000:]
        assert "TASK [job_storage : " in provision.stdout, provision.stdout[-4000:]
        assert provision.returncode == 0, provision.stdout[-4000:] + provision.stderr[-2000:]
        for container in provisioned.containers:
            made = node_sh(container, f"test -d {GROUP_VARS_CHECKPOINTS} && echo made")
            assert made.stdout == "made\n", container

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
            "train",
            f"INVENTORY={inventory}",
            f"GROUP={GROUP}",
            "NNODES=2",  # TINY's global batch splits over 2
            f"ARGS={args}",
            timeout=900,
        )
        assert train.returncode == 0, train.stdout[-4000:] + train.stderr
        assert f":{GROUP_VARS_PORT}" in train.stdout, train.stdout[-3000:]
        saved = node_sh(provisioned.containers[0], f"ls {GROUP_VARS_CHECKPOINTS}/gv")
        assert saved.returncode == 0 and saved.stdout.strip(), saved.stderr
    finally:
        for container in provisioned.containers:
            node_sh(container, f"rm -rf {GROUP_VARS_CHECKPOINTS}")
