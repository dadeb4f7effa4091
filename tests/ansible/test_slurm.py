"""scheduler: slurm in the inventory: provisioning also sets Slurm up from the distribution's
packages on three simulated nodes that never had it (no systemd there: the daemons are started
directly). --check changes nothing; the run registers every node idle and a job runs on all of
them; the munge key is one, made on the controller, 0400 munge on the nodes and never printed;
a second run changes nothing. Only the hostname role (Slurm knows nodes by name) and the slurm
role run (--tags hostname,slurm): the other roles have their own end-to-end tests.

The nodes are the node-loss tests' (`sim3`, tests/three_nodes.py), this test first on them: its
daemons are stopped at the end and the packages stay, as they would on a user's nodes."""

from __future__ import annotations

import json
import subprocess
import time
import uuid

import pytest

from tests.ansible.conftest import (
    ansible_playbook,
    node_sh,
    read_inventory,
    snapshot,
    write_inventory,
)
from tests.conftest import REPO_ROOT, VENV_BIN

pytestmark = [pytest.mark.sim, pytest.mark.extended]


# sim3's set-up waits for the training image, built by another worker (tests/three_nodes.py).
@pytest.mark.timeout(2400)
def test_slurm_from_the_inventory_registers_every_node_idle_and_runs_a_job(sim3, tmp_path):
    cluster, _ = sim3
    name = f"tmn-test-{uuid.uuid4().hex[:8]}"  # its own munge key, removed at the end
    key = REPO_ROOT / ".slurm" / f"{name}.munge.key"
    containers = [cluster.config.container(i) for i in (1, 2, 3)]
    try:
        document = read_inventory(cluster.config.inventory_path)  # as sim-up wrote it
        document["all"]["vars"]["scheduler"] = "slurm"
        inventory = write_inventory(document, tmp_path / "slurm.yml")
        args = ("--tags", "hostname,slurm", "-e", f"slurm_cluster_name={name}")

        before = snapshot(containers)
        check = ansible_playbook(inventory, "--check", *args)
        assert check.returncode == 0, check.describe()
        assert snapshot(containers) == before
        assert node_sh(containers[0], "command -v slurmctld").returncode != 0  # not installed

        first = ansible_playbook(inventory, *args)
        assert first.returncode == 0, first.describe()
        nodes = node_sh(containers[0], "sinfo --Node --noheader --format '%N %T'")
        assert nodes.stdout.split("\n")[:3] == ["node1 idle", "node2 idle", "node3 idle"], nodes
        job = node_sh(containers[0], "srun --nodes 3 --label hostname | sort", timeout=120)
        assert job.returncode == 0, job.stderr
        assert job.stdout.splitlines() == ["0: node1", "1: node2", "2: node3"], job.stdout

        assert oct(key.stat().st_mode & 0o777) == "0o600" and key.stat().st_size == 1024
        for container in containers:
            mode = node_sh(container, "stat -c '%a %U' /etc/munge/munge.key").stdout.strip()
            assert mode == "400 munge", container
            same = node_sh(container, "sha256sum < /etc/munge/munge.key").stdout.split()[0]
            assert same == _sha256(key)
        assert key.read_bytes().hex()[:32] not in first.output

        # netcheck's Slurm column: every node ready; then a drained node is named, with the
        # reason Slurm gives and the command that returns it. (Only the slurm role ran here,
        # so netcheck's other checks may fail: the test reads this column alone.)
        assert _slurm_column(inventory) == {
            "node1": ("PASS", "Slurm has node1 idle"),
            "node2": ("PASS", "Slurm has node2 idle"),
            "node3": ("PASS", "Slurm has node3 idle"),
        }
        drained = node_sh(containers[0], "scontrol update nodename=node2 state=drain reason=disk")
        assert drained.returncode == 0, drained.stderr
        column = _slurm_column(inventory, remedies=True)
        assert column["node2"] == (
            "FAIL",
            "Slurm has node2 drained (disk)",
            ["on node1: once that is dealt with, scontrol update nodename=node2 state=resume"],
        )
        node_sh(containers[0], "scontrol update nodename=node2 state=resume")

        # make queue and make cancel, from the controller: a job on every node is listed
        # running, cancelled, and gone; an ID Slurm does not know is one line and exit 1.
        job = node_sh(containers[0], "sbatch --parsable --nodes 3 --wrap 'sleep 300'")
        assert job.returncode == 0, job.stderr
        job_id = job.stdout.strip().split(";")[0]
        listed = _until(lambda: _cli("queue", inventory), lambda out: " RUNNING " in out)
        header, row = listed.stdout.splitlines()
        assert header.split()[:4] == ["JOB", "NAME", "USER", "STATE"]
        cells = row.split()
        assert (cells[0], cells[3], cells[5], cells[6]) == (job_id, "RUNNING", "3", "node[1-3]")
        cancelled = _cli("cancel", inventory, job_id)
        assert (cancelled.returncode, cancelled.stdout) == (
            0,
            f"Cancelled Slurm job {job_id} on node1's controller.\n",
        ), cancelled.stderr
        empty = _until(lambda: _cli("queue", inventory), lambda out: "No jobs" in out)
        assert empty.stdout == "No jobs in Slurm's queue on node1.\n"
        unknown = _cli("cancel", inventory, "999999")
        assert unknown.returncode == 1 and unknown.stderr.startswith(
            "Error: Slurm did not cancel job 999999: "
        ), unknown.stderr

        second = ansible_playbook(inventory, *args)
        assert second.returncode == 0, second.describe()
        changed = second.changed()
        assert {"node1", "node2", "node3"} <= set(changed) and set(changed.values()) == {0}, (
            second.describe()
        )
    finally:
        # sim3 as the node-loss tests expect it: no Slurm daemon running and no state of this
        # cluster's (slurmctld refuses to start under another ClusterName over it), the
        # packages left installed.
        for container in containers:
            node_sh(container, "pkill -x slurmctld; pkill -x slurmd; pkill -x munged")
        # slurm_state_dir, once slurmctld has saved its state there on its way out
        node_sh(
            containers[0],
            "for _ in $(seq 150); do pgrep -x slurmctld >/dev/null || break; sleep 0.2; done; "
            "rm -rf /var/lib/slurm/slurmctld/*",
        )
        key.unlink(missing_ok=True)


def _sha256(path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def _slurm_column(inventory, remedies: bool = False) -> dict:
    done = subprocess.run(
        [str(VENV_BIN / "netcheck"), "-i", str(inventory), "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    results = json.loads(done.stdout)["results"]
    return {
        node: (row["slurm"]["status"], row["slurm"]["detail"])
        + ((row["slurm"]["remedies"],) if remedies else ())
        for node, row in results.items()
    }


def _cli(command: str, inventory, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(VENV_BIN / "cluster"), command, "-i", str(inventory), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _until(run, done, limit: float = 60) -> subprocess.CompletedProcess:
    """`run()` again until `done(its stdout)`, for at most `limit` seconds (Slurm acts
    asynchronously: a job starts, and leaves the queue, a moment later)."""
    deadline = time.monotonic() + limit
    while True:
        result = run()
        if done(result.stdout) or time.monotonic() > deadline:
            return result
        time.sleep(1)
