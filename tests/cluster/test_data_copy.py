"""The data-safety matrix's `make data` x Ctrl-C and x a full disk (docs/faults.md): a dataset's
copy on a node is replaced all at once, so a copy stopped part way leaves the node's previous
copy as it was, byte for byte, never a mix of old and new files.

`cluster data` runs as the user types it, with real rsync on both sides; the "nodes" are
directories on this machine, reached through a stand-in for ssh (first on PATH) that runs the
node's half here, in a session of its own: a terminal's Ctrl-C reaches this machine's
processes, not a node's. Nothing is sent to the inventory's addresses."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO_ROOT, inventory_text, node, small_filesystem
from tests.training.conftest import wait_until

# The inventory's data_root: a placeholder that the stand-in for ssh replaces with the node's
# own directory here (NODE_ROOTS/<address>).
PLACEHOLDER = "/tmn-test-node-data"

FAKE_SSH = f"""#!{sys.executable}
import os, subprocess, sys, threading, time
args = sys.argv[1:]
while args[0].startswith("-"):  # ssh's options: -p PORT, -o OPTION, -i KEY, -l USER
    if args.pop(0) in ("-p", "-o", "-i", "-l"):
        args.pop(0)
address = args.pop(0).rsplit("@", 1)[-1]
root = os.path.join(os.environ["NODE_ROOTS"], address)
command = " ".join(args).replace({PLACEHOLDER!r}, root)
node = subprocess.Popen(["sh", "-c", command], stdin=subprocess.PIPE, start_new_session=True)
# PAUSE_AFTER=PATH: relay what rsync sends until PATH (under the node's root) exists, then
# write PAUSED and send nothing more: the copy stopped part way, as long as the test needs.
pause = os.environ.get("PAUSE_AFTER")


def relay():
    while chunk := os.read(0, 65536):
        node.stdin.write(chunk)
        node.stdin.flush()
        if pause and os.path.exists(os.path.join(root, pause)):
            open(os.environ["PAUSED"], "w").close()
            while True:
                time.sleep(1)
    node.stdin.close()


threading.Thread(target=relay, daemon=True).start()
os._exit(node.wait())  # as ssh ends when the node's command does, closing rsync's pipes
"""


def _files(root: Path) -> dict[str, bytes]:
    """Every file under `root` but rsync's holding directory, by relative path."""
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and ".~tmp~" not in p.parts
    }


class Setup:
    def __init__(self, tmp_path: Path, addresses: list[str]):
        self.bin = tmp_path / "bin"
        self.bin.mkdir()
        (self.bin / "ssh").write_text(FAKE_SSH)
        (self.bin / "ssh").chmod(0o755)
        self.roots = tmp_path / "nodes"
        self.roots.mkdir()
        hosts = {
            f"node{i}": node(i, ansible_host=address)
            for i, address in enumerate(addresses, start=1)
        }
        self.inventory = tmp_path / "inventory.yml"
        self.inventory.write_text(inventory_text(hosts, data_root=PLACEHOLDER))
        self.dataset = tmp_path / "ds"
        self.started: list[subprocess.Popen] = []
        self.paused = tmp_path / "paused"
        self.env = {
            **os.environ,
            "PATH": f"{self.bin}:{os.environ['PATH']}",
            "NODE_ROOTS": str(self.roots),
            "PAUSED": str(self.paused),
        }
        # The guard of the network rule: no real ssh may reach the inventory's addresses.
        assert shutil.which("ssh", path=self.env["PATH"]) == str(self.bin / "ssh")

    def copy_on(self, address: str) -> Path:
        return self.roots / address / "ds"

    def stop_all(self) -> None:
        """Whatever a failed test left running (its rsync and the stand-in), killed."""
        for process in self.started:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()

    def data(self, **env: str) -> subprocess.Popen:
        self.started.append(process := self._data(env))
        return process

    def _data(self, env: dict[str, str]) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "torch_multinode.cluster.cli", "data"]
            + ["--inventory", str(self.inventory), str(self.dataset)],
            cwd=REPO_ROOT,
            env={**self.env, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its own process group, as a terminal's foreground job
        )


def _write(dataset: Path, version: str, big: int = 0) -> dict[str, bytes]:
    """The dataset's `version`: a.bin and b.txt change with it, old.txt is v1's alone, and
    z.bin (`big` bytes, after a.bin in rsync's order) comes with v2."""
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
    return _files(dataset)


@pytest.fixture
def nodes_here(tmp_path):
    """Setup(addresses): the stand-in and inventory for those "nodes"; nothing left running."""
    made: list[Setup] = []
    yield lambda addresses: made.append(Setup(tmp_path, addresses)) or made[-1]
    for setup in made:
        setup.stop_all()


def test_ctrl_c_part_way_through_make_data_leaves_the_nodes_copy_as_it_was(nodes_here):
    setup = nodes_here(["192.0.2.1"])
    v1 = _write(setup.dataset, "v1")
    first = setup.data()
    out, err = first.communicate(timeout=120)
    assert first.returncode == 0, out + err
    assert _files(setup.copy_on("192.0.2.1")) == v1

    v2 = _write(setup.dataset, "v2", big=30_000_000)
    stopped = setup.data(PAUSE_AFTER="ds/.~tmp~/a.bin")  # v2's a.bin whole, z.bin on its way
    wait_until(setup.paused.exists, 120, "the copy never reached its pause")
    os.killpg(stopped.pid, signal.SIGINT)  # Ctrl-C in the terminal
    out, err = stopped.communicate(timeout=60)
    assert stopped.returncode == 130, out + err
    assert err.splitlines()[-1] == "Interrupted.", err
    destination = f"{PLACEHOLDER}/ds"
    assert (
        f"[data] stopped: each node's {destination} is the new copy where its transfer had "
        "ended, else the one it had before (the new files are put in place only once all have "
        f"arrived; those that did wait in {destination}/.~tmp~): run the same command again "
        "before a job reads it\n"
    ) in out, out
    assert _files(setup.copy_on("192.0.2.1")) == v1  # byte for byte, old.txt still there

    again = setup.data()
    out, err = again.communicate(timeout=120)
    assert again.returncode == 0, out + err
    assert _files(setup.copy_on("192.0.2.1")) == v2
    assert not (setup.copy_on("192.0.2.1") / ".~tmp~").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small filesystem needs root (CI's)")
def test_a_full_disk_on_one_node_keeps_its_copy_and_says_the_nodes_differ(nodes_here):
    setup = nodes_here(["192.0.2.1", "192.0.2.2"])
    (setup.roots / "192.0.2.1").mkdir()
    with small_filesystem(setup.roots / "192.0.2.2", "2m"):
        v1 = _write(setup.dataset, "v1")
        first = setup.data()
        out, err = first.communicate(timeout=120)
        assert first.returncode == 0, out + err
        filler = setup.roots / "192.0.2.2" / "filler"
        filler.write_bytes(b"\0" * 1_200_000)  # room beside v1's copy, not for v2's new files
        v2 = _write(setup.dataset, "v2", big=1_000_000)
        failed = setup.data()
        out, err = failed.communicate(timeout=120)
        assert failed.returncode == 1, out + err
        (line,) = err.splitlines()
        destination = f"{PLACEHOLDER}/ds"
        assert line.startswith(
            f"Error: on node2: copying {setup.dataset} to {destination} failed: "
        ), line
        assert "No space left on device" in line, line
        assert line.endswith(
            f". node2 kept the copy it had (the new files wait in {destination}/.~tmp~, put "
            "in place only once all have arrived); node1 got the new one: the nodes differ "
            "until it succeeds (try freeing space on node2, then the same command again)"
        ), line
        assert _files(setup.copy_on("192.0.2.2")) == v1  # byte for byte
        assert _files(setup.copy_on("192.0.2.1")) == v2

        filler.unlink()
        again = setup.data()
        out, err = again.communicate(timeout=120)
        assert again.returncode == 0, out + err
        assert _files(setup.copy_on("192.0.2.2")) == v2
