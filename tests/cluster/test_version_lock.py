"""The version lock (cluster.version_lock): its probe, run here for real in both launch modes; the
file netcheck writes; what the launcher says of a node that changed (launch.prepare)."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
import uuid
from dataclasses import replace

import pytest
import torch

from tests.fakes import FakeNodes
from tests.helpers import inventory, inventory_text, node
from torch_multinode.cluster import cli, engine
from torch_multinode.cluster import version_lock as lock
from torch_multinode.cluster.errors import UserError
from torch_multinode.cluster.remote import Result
from torch_multinode.cluster.versions import STACK_LABELS
from torch_multinode.launch.prepare import prepare_node
from torch_multinode.launch.spec import JobSpec
from torch_multinode.launch.staging import Project
from torch_multinode.provision import images

LOCKED = {"kernel": "6.1.0-18-amd64", "driver": "none", "docker": "27.3.1"}


def _probe_here(command: str) -> dict[str, str]:
    done = subprocess.run(
        ["bash", "-c", command], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    return lock.parse(done.stdout)


def test_the_probe_reads_this_machines_versions_without_importing_torch():
    hosts = inventory({"node1": node(1, training_python=sys.executable)}, launch_mode="host")
    found = _probe_here(lock.probe_command(hosts.hosts[0], hosts))
    assert found["torch"] == torch.__version__  # read from torch's files, not imported
    assert found["cuda"] == (torch.version.cuda or "none")
    assert (
        found["kernel"]
        == subprocess.run(
            ["uname", "-r"], capture_output=True, text=True, check=True
        ).stdout.strip()
    )
    assert found["driver"] == "none"  # no NVIDIA driver here
    try:  # the NCCL wheel a CUDA torch brings along, if this one did
        nccl = importlib.metadata.version("nvidia-nccl-cu13")
    except importlib.metadata.PackageNotFoundError:
        nccl = "none"
    assert found["nccl"] == nccl
    assert found["docker"]  # a version, "unknown" (no engine answers) or "none"


def test_in_container_mode_the_probe_reads_the_image_and_says_when_it_is_missing():
    hosts = inventory(
        {"node1": node(1)},
        launch_mode="container",
        training_image="torch-multinode/never-built:here",
    )
    found = _probe_here(lock.probe_command(hosts.hosts[0], hosts))
    assert {k: found[k] for k in ("image", *lock.STACK)} == dict.fromkeys(
        ("image", *lock.STACK), "unknown"
    ) | {"image": "missing"}, found


@pytest.mark.sim  # needs this machine's Docker engine: skipped without one, outside CI
@pytest.mark.parametrize(
    "labels",
    [
        {"torch": "2.14.1+cu130", "cuda": "13.0", "nccl": "2.30.7"},
        {"torch": "2.14.1+cu130"},  # labelled by an older version of this project
        {},
    ],
)
def test_in_container_mode_the_probe_reads_the_images_torch_cuda_and_nccl_labels(labels):
    """Against this machine's engine: an image made here (nothing pulled) with some labels."""
    engine.require_engine()
    tag = f"tmn-stack-labels:{uuid.uuid4().hex[:8]}"
    options = [f"--label={STACK_LABELS[field]}={value}" for field, value in labels.items()]
    subprocess.run(
        ["docker", "build", "-q", *options, "-t", tag, "-"],
        input="FROM scratch\nLABEL purpose=test\n",
        text=True,
        capture_output=True,
        check=True,
    )
    try:
        hosts = inventory({"node1": node(1)}, launch_mode="container", training_image=tag)
        found = _probe_here(lock.probe_command(hosts.hosts[0], hosts))
        identity = engine.docker("image", "inspect", "--format", "{{.Id}}", tag).stdout.strip()
        assert found["image"] == identity
        assert {field: found[field] for field in lock.STACK} == {
            field: labels.get(field, "unknown") for field in lock.STACK
        }
        assert images.stack_labels(tag) == {f: labels.get(f, "unknown") for f in lock.STACK}
    finally:
        engine.docker("rmi", tag, check=False)


def test_the_lock_keeps_nodes_not_checked_and_survives_no_file_or_a_bad_one(tmp_path):
    path = tmp_path / lock.FILENAME
    assert lock.load(path) is None
    lock.write(path, {"node1": LOCKED, "node2": LOCKED})
    lock.write(path, {"node2": {**LOCKED, "kernel": "6.1.0-21-amd64"}})
    assert lock.load(path) == {"node1": LOCKED, "node2": {**LOCKED, "kernel": "6.1.0-21-amd64"}}
    assert [p.name for p in tmp_path.iterdir()] == [lock.FILENAME]  # nothing half-written
    path.write_text("{not json")
    assert lock.load(path) is None
    path.write_text(json.dumps({"nodes": {"node1": {"kernel": 6, "driver": "none"}}}))
    assert lock.load(path) == {"node1": {"driver": "none"}}


def test_a_shipped_image_is_what_the_lock_expects_on_the_nodes_it_holds(tmp_path):
    inventory_path = tmp_path / "inv.yml"
    lock.image_shipped(inventory_path, ["node1"], "sha256:" + "b" * 64, lambda: 1 / 0)
    assert not (tmp_path / lock.FILENAME).exists()  # no lock: none made, no label asked
    before = {**LOCKED, "image": "sha256:" + "a" * 64, "torch": "2.14.1+cpu"}
    lock.write(tmp_path / lock.FILENAME, {"node1": before, "node2": before})
    stack = {"torch": "2.15.0+cu130", "cuda": "13.0", "nccl": "2.30.7"}
    lock.image_shipped(inventory_path, ["node1", "node3"], "sha256:" + "b" * 64, lambda: stack)
    assert lock.load(tmp_path / lock.FILENAME) == {
        "node1": {**before, "image": "sha256:" + "b" * 64, **stack},
        "node2": before,  # not shipped to
    }  # node3: not locked, not added


def test_a_drift_names_what_changed_from_what_to_what():
    assert lock.drift(LOCKED, dict(LOCKED)) == []
    image_a, image_b = "sha256:" + "a" * 64, "sha256:" + "b" * 64
    assert lock.drift(
        {**LOCKED, "image": image_a}, {**LOCKED, "image": image_b, "kernel": "6.1.0-21-amd64"}
    ) == [
        "kernel from 6.1.0-18-amd64 to 6.1.0-21-amd64",
        "training image from aaaaaaaaaaaa to bbbbbbbbbbbb",
    ]
    # A field the lock does not hold (an older lock) is no drift; one the node no longer says is.
    assert lock.drift({"driver": "550.54.15"}, {**LOCKED, "torch": "2.14.1"}) == [
        "NVIDIA driver from 550.54.15 to none"
    ]
    assert lock.drift({"torch": "2.14.1"}, {}) == ["torch from 2.14.1 to unknown"]


class _Session:
    """A node's session that answers the lock's probe with `versions`, and anything else 0."""

    def __init__(self, versions: dict[str, str]):
        self.versions, self.commands = versions, []

    def run(self, command, timeout=60, check=False, stdin=None):
        self.commands.append(command)
        text = "".join(f"{k}={v}\n" for k, v in self.versions.items())
        stdout = text if command.startswith('echo "kernel=') else ""
        return Result("node2", command, 0, stdout, "")


@pytest.fixture
def _prepared(tmp_path):
    hosts = inventory({"node1": node(1), "node2": node(2)}, path=str(tmp_path / "inv.yml"))
    project = Project(trees=(), workdir="/work", script=None)
    spec = JobSpec(run_id="tmn-lock")

    def prepare(versions, locked, allow=False, said=None):
        remote = _Session(versions)
        emit = said.append if said is not None else (lambda line: None)
        return prepare_node(
            remote,
            hosts.hosts[1],
            hosts,
            replace(spec, allow_drift=allow),
            project,
            "gloo",
            None,
            locked,
            emit,
        ), remote

    return hosts, prepare


def test_the_launcher_refuses_a_node_that_drifted_naming_it_and_the_way_out(_prepared):
    hosts, prepare = _prepared
    newer = {**LOCKED, "driver": "560.35.03"}
    with pytest.raises(UserError) as refused:
        prepare(newer, {**LOCKED, "driver": "550.54.15"})
    message = f"{refused.value}"
    assert message.startswith(
        "node2 changed since netcheck passed: NVIDIA driver from 550.54.15 to 560.35.03"
    ), message
    assert refused.value.exit_code == 1
    assert "make netcheck INVENTORY=" in refused.value.hint
    assert "ALLOW_DRIFT=1" in refused.value.hint


def test_with_allow_drift_or_no_lock_the_node_is_prepared_and_its_versions_returned(_prepared):
    hosts, prepare = _prepared
    said: list[str] = []
    newer = {**LOCKED, "kernel": "6.1.0-21-amd64"}
    (versions, changes), remote = prepare(newer, LOCKED, allow=True, said=said)
    assert versions == newer and changes == ["kernel from 6.1.0-18-amd64 to 6.1.0-21-amd64"]
    assert said == [
        "[launcher] node2 changed since netcheck passed: kernel from 6.1.0-18-amd64 to "
        "6.1.0-21-amd64 (ALLOW_DRIFT=1: running anyway)"
    ]
    assert any(c.startswith("mkdir -p") for c in remote.commands)  # prepared on
    (versions, changes), _ = prepare(newer, None)  # no lock: nothing to compare
    assert versions == newer and changes == []


def test_a_lock_that_cannot_be_written_is_one_error_naming_it(tmp_path):
    (tmp_path / "inventory.yml").write_text("")  # a file where the lock's directory would be
    path = tmp_path / "inventory.yml" / lock.FILENAME
    with pytest.raises(UserError, match=f"cannot write the version lock {path}: ") as refused:
        lock.write(path, {"node1": LOCKED})
    assert refused.value.exit_code == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["inventory.yml"]


def test_lock_nodes_probes_every_node_and_cluster_lock_says_where(tmp_path, capsys, monkeypatch):
    """`cluster lock` (make provision's last step): every node probed (fake nodes answering as
    the probe would), each one's versions written beside the inventory."""
    path = tmp_path / "inv.yml"
    path.write_text(inventory_text({"n1": node(1), "n2": node(2)}, launch_mode="host"))

    def answer(host, command):
        return f"kernel=6.1.0-{host.name}\ndocker=28.2.2\ntorch=2.14.1\n"

    fake = FakeNodes(responder=answer)
    monkeypatch.setattr("torch_multinode.cluster.execution.SshNodes", lambda inventory: fake)
    assert cli.main(["lock", "-i", str(path)]) == 0
    written = tmp_path / "versions.lock.json"
    assert capsys.readouterr().out == (
        f"Each node's versions locked in {written} (make train checks them)\n"
    )
    locked = lock.load(written)
    assert locked["n1"]["kernel"] == "6.1.0-n1" and locked["n2"]["kernel"] == "6.1.0-n2"
    assert fake.closed and {name for name, _ in fake.commands} == {"n1", "n2"}
