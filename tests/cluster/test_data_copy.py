"""The data-safety matrix's `make data` x Ctrl-C and x a full disk (docs/faults.md): a dataset's
copy on a node is replaced all at once, so a copy stopped part way leaves the node's previous
copy as it was, byte for byte, never a mix of old and new files.

`cluster data` runs as the user types it, with real rsync and real SSH to the simulated
cluster's nodes (`sim2`), into a data_root of the test's own; each node's copy is read back
through its container. For Ctrl-C part way, a relay first on PATH stands between rsync and
the real ssh and stops passing rsync's stream on after its first megabyte (the new version's
first files sent, a larger one on its way): the copy stays stopped there, as long as the test
needs, whatever the machine's load."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from tests.helpers import REPO_ROOT, digests, digests_on_node, on_node
from tests.training.conftest import wait_until

pytestmark = pytest.mark.sim

# What the relay passes on before it stops: more than the new version's a.bin and b.txt (about
# 200 KB), far less than its z.bin.
RELAY_LIMIT = 1_000_000

RELAY_SSH = f"""#!{sys.executable}
import os, subprocess, sys, threading, time
ssh = subprocess.Popen([os.environ["REAL_SSH"], *sys.argv[1:]], stdin=subprocess.PIPE)
# STOP_AFTER=N: pass on N bytes of what rsync sends, then write PAUSED and pass nothing more.
limit = int(os.environ.get("STOP_AFTER", "0"))


def relay():
    sent = 0
    while chunk := os.read(0, 65536):
        ssh.stdin.write(chunk)
        ssh.stdin.flush()
        sent += len(chunk)
        if limit and sent >= limit:
            open(os.environ["PAUSED"], "w").close()
            while True:
                time.sleep(1)
    ssh.stdin.close()


threading.Thread(target=relay, daemon=True).start()
sys.exit(ssh.wait())
"""


class Setup:
    """sim2's nodes with a data_root of this test's own, and `cluster data` run as typed."""

    def __init__(self, cluster, tmp_path: Path):
        self.cluster = cluster
        self.data_root = f"/var/tmp/tmn-data-{uuid.uuid4().hex[:8]}"
        self.destination = f"{self.data_root}/ds"
        document = yaml.safe_load(cluster.config.inventory_path.read_text())
        document["all"]["vars"]["data_root"] = self.data_root
        self.inventory = tmp_path / "inventory.yml"
        self.inventory.write_text(yaml.safe_dump(document, sort_keys=False))
        self.bin = tmp_path / "bin"
        self.bin.mkdir()
        (self.bin / "ssh").write_text(RELAY_SSH)
        (self.bin / "ssh").chmod(0o755)
        self.dataset = tmp_path / "ds"
        self.paused = tmp_path / "paused"
        self.started: list[subprocess.Popen] = []
        self.env = {
            **os.environ,
            "PATH": f"{self.bin}:{os.environ['PATH']}",
            "REAL_SSH": shutil.which("ssh") or "ssh",
            "PAUSED": str(self.paused),
        }

    def copy_on(self, index: int) -> dict[str, str]:
        """Node `index`'s copy: every file but rsync's holding directory, by relative path, its
        SHA-256."""
        return digests_on_node(self.cluster, index, self.destination, leave_out=".~tmp~")

    def data(self, **env: str) -> subprocess.Popen:
        process = subprocess.Popen(
            [sys.executable, "-m", "torch_multinode.cluster.cli", "data"]
            + ["--inventory", str(self.inventory), str(self.dataset)],
            cwd=REPO_ROOT,
            env={**self.env, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its own process group, as a terminal's foreground job
        )
        self.started.append(process)
        return process

    def done(self, process: subprocess.Popen, code: int = 0) -> tuple[str, str]:
        out, err = process.communicate(timeout=180)
        assert process.returncode == code, out + err
        return out, err

    def clean(self) -> None:
        """Whatever a failed test left running killed; the nodes as they were."""
        for process in self.started:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        for index in (1, 2):
            on_node(
                self.cluster,
                index,
                f"umount {self.data_root} 2>/dev/null; rm -rf {self.data_root}",
                check=False,
            )


def _write(dataset: Path, version: str, big: int = 0) -> dict[str, str]:
    """The dataset's `version`: a.bin and part/b.txt change with it, old.txt is v1's alone,
    and z.bin (`big` bytes, after a.bin in rsync's order) comes with v2. Its files' digests."""
    shutil.rmtree(dataset, ignore_errors=True)
    (dataset / "part").mkdir(parents=True)
    (dataset / "a.bin").write_bytes(os.urandom(200_000))
    (dataset / "part" / "b.txt").write_text(f"{version}\n")
    if version == "v1":
        (dataset / "old.txt").write_text("only in v1\n")
    if big:
        (dataset / "z.bin").write_bytes(os.urandom(big))
    # Each version's own time: rsync's quick check (size and time) sees the change even when
    # both versions are written within one second.
    when = {"v1": 1_700_000_000, "v2": 1_700_000_100}[version]
    for path in dataset.rglob("*"):
        os.utime(path, (when, when))
    return digests(dataset)


@pytest.fixture
def on_sim2(sim2, tmp_path):
    setup = Setup(sim2, tmp_path)
    try:
        yield setup
    finally:
        setup.clean()


def test_ctrl_c_part_way_through_make_data_leaves_the_nodes_copy_as_it_was(on_sim2):
    setup = on_sim2
    v1 = _write(setup.dataset, "v1")
    setup.done(setup.data())
    assert setup.copy_on(1) == setup.copy_on(2) == v1

    v2 = _write(setup.dataset, "v2", big=5_000_000)
    stopped = setup.data(STOP_AFTER=str(RELAY_LIMIT))
    wait_until(setup.paused.exists, 120, "the copy never reached its stop", every=0.2)
    # The new version's first file arrived whole on each node, in rsync's holding directory.
    for index in (1, 2):
        wait_until(
            lambda index=index: on_node(
                setup.cluster, index, f"ls {setup.destination}/.~tmp~/a.bin", check=False
            ).strip(),
            120,
            f"node{index}: a.bin never reached {setup.destination}/.~tmp~",
            every=0.5,
        )
    os.killpg(stopped.pid, signal.SIGINT)  # Ctrl-C in the terminal
    out, err = setup.done(stopped, 130)
    assert err.splitlines()[-1] == "Interrupted.", err
    assert (
        f"[data] stopped: each node's {setup.destination} is the new copy where its transfer "
        "had ended, else the one it had before (the new files are put in place only once all "
        f"have arrived; those that did wait in {setup.destination}/.~tmp~): run the same "
        "command again before a job reads it\n"
    ) in out, out
    assert setup.copy_on(1) == setup.copy_on(2) == v1  # byte for byte, old.txt still there

    setup.done(setup.data())
    assert setup.copy_on(1) == setup.copy_on(2) == v2
    for index in (1, 2):
        left = on_node(setup.cluster, index, f"ls -A {setup.destination}").split()
        assert ".~tmp~" not in left, left


def test_a_full_disk_on_one_node_keeps_its_copy_and_says_the_nodes_differ(on_sim2):
    setup = on_sim2
    mounted = on_node(
        setup.cluster,
        2,
        f"mkdir -p {setup.data_root} && mount -t tmpfs -o size=2m tmpfs {setup.data_root} "
        f"&& df -P {setup.data_root} | tail -n 1",
        check=False,
    )
    assert mounted.split()[-1:] == [setup.data_root], mounted
    v1 = _write(setup.dataset, "v1")
    setup.done(setup.data())
    # Room beside v1's copy on node2, not for v2's new files as well.
    on_node(setup.cluster, 2, f"head -c 1200000 /dev/zero > {setup.data_root}/filler")
    v2 = _write(setup.dataset, "v2", big=1_000_000)
    _, err = setup.done(setup.data(), 1)
    (line,) = err.splitlines()
    assert line.startswith(
        f"Error: on node2: copying {setup.dataset} to {setup.destination} failed: "
    ), line
    assert "No space left on device" in line, line
    assert line.endswith(
        f". node2 kept the copy it had (the new files wait in {setup.destination}/.~tmp~, put "
        "in place only once all have arrived); node1 got the new one: the nodes differ "
        "until it succeeds (try freeing space on node2, then the same command again)"
    ), line
    assert setup.copy_on(2) == v1  # byte for byte
    assert setup.copy_on(1) == v2

    on_node(setup.cluster, 2, f"rm {setup.data_root}/filler")
    setup.done(setup.data())
    assert setup.copy_on(1) == setup.copy_on(2) == v2
