"""The whole user flow on fresh simulated nodes, through the Makefile as a user types it:

    make bootstrap INVENTORY=...      (unattended: FINGERPRINTS=file, the password on stdin)
    make provision INVENTORY=...      (builds and ships the training image, among the rest)
    make train     INVENTORY=... NNODES=2 SCRIPT=...     (nothing in between)
    make netcheck  INVENTORY=... NNODES=2

with jobs in the training image's CPU twin on every node (launch_mode: container): containers
started by the launcher on each node, not the node's own Python. Last, Ctrl-C at a running
`make train` leaves no container, process or bound port on any node, and the nodes' password is
in no output and no file of theirs. The first two steps are the shared `provisioned` cluster's
(tests/conftest.py: its playbook's first run goes on during the image's build, before `make
provision` runs it again and ships); tests/test_bootstrap.py answers bootstrap's prompts at a
terminal.
"""

from __future__ import annotations

import json
import os
import platform
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.ansible.conftest import recap_of
from tests.conftest import REPO_ROOT, make
from tests.helpers import password_in_node_files, password_login
from torch_multinode.cluster.engine import docker
from torch_multinode.cluster.inventory_read import load
from torch_multinode.provision import platforms

SCRIPT = REPO_ROOT / "tests" / "training" / "launcher_scripts" / "tutorial_ddp.py"
ENDLESS = SCRIPT.with_name("endless_allreduce.py")


@pytest.mark.sim
@pytest.mark.image_e2e
# One test for the steps of the flow; the provisioned cluster is shared with the other tests of
# jobs in containers. Its limit covers building the image and provisioning, when no earlier test
# has.
@pytest.mark.timeout(2400)
def test_provision_then_train_then_netcheck_in_the_image_on_fresh_nodes(
    provisioned, training_image
):
    """Fresh nodes; an inventory that runs jobs in the test image; then the commands."""
    cluster, inventory = provisioned.cluster, provisioned.inventory
    _bootstrap_gave_the_user_a_key_and_sudo_and_ended_password_login(provisioned)
    _playbook_then_provision_changed_the_nodes_once(provisioned)
    _provision_builds_and_ships_the_image(cluster, provisioned.provision, training_image)
    outputs = [_make_train_runs_inside_the_image_on_both_nodes(cluster, inventory)]
    outputs.append(_netcheck_passes_in_the_training_image(inventory))
    _ctrl_c_at_make_train_leaves_no_container_process_or_port(cluster, inventory)
    for run in (provisioned.bootstrap, provisioned.provision):
        outputs.append(run.stdout + run.stderr)
    outputs.append(provisioned.playbook.output)
    assert not [text for text in outputs if provisioned.password in text]
    for index in (1, 2):
        found = password_in_node_files(cluster.config.container(index), provisioned.password)
        assert found == "", found


def _bootstrap_gave_the_user_a_key_and_sudo_and_ended_password_login(provisioned) -> None:
    done, config = provisioned.bootstrap, provisioned.cluster.config
    assert done.returncode == 0, done.stdout + done.stderr
    for index in (1, 2):
        assert f"\n  node{index}        host key added to known_hosts; key added" in done.stdout
    assert done.stdout.count("SSH password login off (") == 2, done.stdout
    # As that user, not root, from here on.
    assert yaml.safe_load(provisioned.inventory.read_text())["all"]["vars"]["ansible_user"] == (
        "trainer"
    )
    hosts = load(provisioned.inventory).hosts
    logins = [password_login(host, config.known_hosts_path, provisioned.password) for host in hosts]
    assert logins == ["not offered", "not offered"]


def _playbook_then_provision_changed_the_nodes_once(provisioned) -> None:
    """The fixture ran site.yml on the fresh nodes during the image's build, then `make
    provision`, whose own run of site.yml found every task in place."""
    playbook = provisioned.playbook
    assert playbook.returncode == 0, playbook.describe()
    first = {host: count for host, count in playbook.changed().items() if host != "localhost"}
    assert {host: count > 0 for host, count in first.items()} == {"node1": True, "node2": True}
    again = recap_of(provisioned.provision.stdout)
    assert {host: again[host]["changed"] for host in again if host != "localhost"} == {
        "node1": 0,
        "node2": 0,
    }, provisioned.provision.stdout[-4000:]


def _provision_builds_and_ships_the_image(cluster, provision, training_image) -> None:
    assert provision.returncode == 0, provision.stdout[-4000:] + provision.stderr[-2000:]
    # The fixture built the image; provisioning finds it made from the same recipe and ships it.
    # Built for the nodes' platform, asked over SSH (the simulated nodes are this machine's).
    pinned = platforms.platform_of(platform.machine())
    assert f"The 2 node(s) run {pinned}: the image is built for it." in provision.stderr
    assert (
        f"{training_image.tag} (cpu, {pinned}, {training_image.image_id[:19]}). Up to date:"
        in provision.stdout
    )
    controller_image = docker("image", "inspect", "--format", "{{.Id}}", training_image.tag)
    for index in (1, 2):
        node_image = docker(
            "exec",
            cluster.config.container(index),
            "docker",
            "image",
            "inspect",
            "--format",
            "{{.Id}}",
            training_image.tag,
        ).stdout.strip()
        assert node_image == controller_image.stdout.strip()


def _netcheck_passes_in_the_training_image(inventory) -> str:
    proc = subprocess.run(
        [
            str(REPO_ROOT / ".venv" / "bin" / "netcheck"),
            "-i",
            str(inventory),
            "--nnodes",
            "2",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"] is True, proc.stdout[-4000:]
    assert report["stack"] == f"the training image {report['stack'].split()[-1]}"
    statuses = {check["status"] for node in report["results"].values() for check in node.values()}
    assert statuses == {"PASS"}, report["results"]
    return proc.stdout + proc.stderr


def _make_train_runs_inside_the_image_on_both_nodes(cluster, inventory) -> str:
    proc = make("train", f"INVENTORY={inventory}", "NNODES=2", f"SCRIPT={SCRIPT}", timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr
    ranks = sorted(line for line in proc.stdout.splitlines() if "identical on all ranks" in line)
    assert len(ranks) == 2
    # The image's interpreter, on each provisioned node (hostnames set by provisioning).
    assert ranks[0].startswith("[node1] rank 0/2 local 0 on node1:")
    assert ranks[1].startswith("[node2] rank 1/2 local 0 on node2:")
    assert all(line.endswith("(python /opt/venv/bin/python3)") for line in ranks)
    # The container was the job's lifetime: none is left on any node.
    for index in (1, 2):
        left = docker("exec", cluster.config.container(index), "docker", "ps", "-aq").stdout
        assert left.strip() == ""
    return proc.stdout + proc.stderr


def test_provision_ships_nothing_when_jobs_run_on_the_host(tmp_path):
    """launch_mode: host needs no image: `cluster image -i` says so and builds nothing."""
    document = {
        "all": {
            "vars": {"compute_subnet": "10.8.0.0/24", "launch_mode": "host"},
            "children": {
                "nodes": {
                    "hosts": {
                        "a": {
                            "ansible_host": "10.8.0.1",
                            "compute_ip": "10.8.0.1",
                            "compute_interface": "eth0",
                            "gpus": 0,
                        }
                    }
                }
            },
        }
    }
    path = Path(tmp_path) / "inventory.yml"
    path.write_text(yaml.safe_dump(document))
    proc = subprocess.run(
        [str(REPO_ROOT / ".venv" / "bin" / "cluster"), "image", "-i", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (proc.returncode, proc.stdout) == (
        0,
        f"inventory {path}: launch_mode host, no training image needed.\n",
    )


def _containers(cluster, index: int) -> list[str]:
    """Every container on node `index`, running or not."""
    return docker("exec", cluster.config.container(index), "docker", "ps", "-aq").stdout.split()


def _ctrl_c_at_make_train_leaves_no_container_process_or_port(cluster, inventory) -> None:
    # As a terminal's Ctrl-C does: SIGINT to make and everything it started.
    process = subprocess.Popen(
        [
            "make",
            "--no-print-directory",
            "train",
            f"INVENTORY={inventory}",
            "NNODES=2",
            f"SCRIPT={ENDLESS}",
        ],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    seen = []
    for line in process.stdout:
        seen.append(line)
        if "rank 1 step 10" in line:
            break
    else:
        raise AssertionError("the job never ran:\n" + "".join(seen[-40:]))
    running = docker("exec", cluster.config.container(1), "docker", "ps", "-q").stdout.split()
    assert len(running) == 1, running  # the job's container, which Ctrl-C must take down
    os.killpg(process.pid, signal.SIGINT)
    rest, _ = process.communicate(timeout=60)
    assert "interrupted" in rest, rest[-3000:]
    # the stop reached and confirmed both nodes; how long Ctrl-C takes is make bench's to
    # measure (docs/benchmarks.md), never asserted here
    confirmed = r"\[launcher\] stopped: node1 in [\d.]+ s, node2 in [\d.]+ s\n"
    assert re.search(confirmed, rest), rest[-3000:]
    # make got the same SIGINT: it ends by that signal, or, when it saw the launcher's 130
    # first, with its own 2; which one is a race (CI saw make die before it reported). The
    # launcher's own 130 is asserted where it is started directly (tests/training/test_faults.py,
    # tests/test_projects_in_containers.py).
    assert process.returncode in (-signal.SIGINT, 2), (process.returncode, rest[-3000:])
    port = yaml.safe_load(inventory.read_text())["all"]["vars"].get("rendezvous_port", 29500)
    for index in (1, 2):
        left = docker(
            "exec",
            cluster.config.container(index),
            "sh",
            "-c",
            f"grep -lsaF TMN_RUN_ID= /proc/[0-9]*/environ | grep -v self; "
            f"ss -ltnH 'sport = :{port}'",
            check=False,
        ).stdout
        assert left.strip() == "", (index, left)
    # The container itself: Docker removes it once its cleanup is done, at once on an idle disk,
    # 15 s and more on a saturated one (unmounting syncs the disk); the stop does not wait for it.
    deadline = time.monotonic() + 60
    for index in (1, 2):
        while (left := _containers(cluster, index)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert left == [], (index, left)
