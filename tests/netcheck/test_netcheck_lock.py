"""A failed netcheck leaves the version lock (cluster.version_lock) as it was: netcheck's own
command (`netcheck -i`, its real code path: preflight, then the lock only when nothing FAILed)
on the fake cluster, no network. The lock is not rewritten, not touched, and not created where
there was none; the same cluster healed, the same command writes it."""

from __future__ import annotations

import json

import pytest

from tests.netcheck.netcheck_fakes import INVENTORY, FakeCluster, inventory
from torch_multinode.cluster import version_lock as lock
from torch_multinode.netcheck import cli

# A lock as a person might have left it: hand-indented, a node this check does not cover,
# fields of an older format, no newline at the end. Any rewrite would change these bytes.
EARLIER = (
    b'{ "nodes": {\n'
    b'    "node1": {"kernel": "6.1.0-18-amd64", "driver": "none", "docker": "26.0.0"},\n'
    b'    "node9": {"kernel": "5.10.0-old", "retired": "yes"}\n'
    b'  },\n  "written_at": "2026-01-01T00:00:00+00:00" }'
)
FAULTS = {
    "node-down": {"down": {"node3"}},  # ssh FAILs
    "firewalled": {"firewalled": {"node2"}},  # ports FAIL
    "worker-broken": {"broken_worker": {"node2"}},  # the collective FAILs
}


def _netcheck(tmp_path, monkeypatch, capsys, cluster: FakeCluster) -> tuple[int, dict]:
    monkeypatch.setattr(cli, "SshNodes", lambda inventory: cluster)
    code = cli.main(["-i", str(tmp_path / "inventory.yml"), "--json"])
    assert cluster.surprises == []
    return code, json.loads(capsys.readouterr().out)


def _cluster(**faults) -> FakeCluster:
    return FakeCluster(list(inventory().hosts), **faults)


def _locks(directory) -> list[str]:
    """The lock and anything its atomic write might leave beside it (a temporary file)."""
    return sorted(p.name for p in directory.iterdir() if lock.FILENAME in p.name)


@pytest.mark.parametrize("faults", FAULTS.values(), ids=FAULTS.keys())
def test_a_failed_netcheck_leaves_the_lock_byte_for_byte_and_a_passing_one_writes_it(
    tmp_path, monkeypatch, capsys, faults
):
    (tmp_path / "inventory.yml").write_text(INVENTORY)
    path = tmp_path / lock.FILENAME
    path.write_bytes(EARLIER)
    before = path.stat()

    broken = _cluster(**faults)
    code, report = _netcheck(tmp_path, monkeypatch, capsys, broken)
    assert (code, report["ok"], report["lock_file"]) == (1, False, None)
    assert path.read_bytes() == EARLIER
    assert (path.stat().st_mtime_ns, path.stat().st_ino) == (before.st_mtime_ns, before.st_ino)
    assert _locks(tmp_path) == [lock.FILENAME]  # no temporary file left beside it either
    assert "versions" not in [kind for _, kind in broken.calls]  # no node was even probed

    healed = _cluster()
    code, report = _netcheck(tmp_path, monkeypatch, capsys, healed)
    assert (code, report["ok"], report["lock_file"]) == (0, True, str(path))
    locked = lock.load(path)
    assert locked["node1"] == {
        "kernel": "6.1.0-fake",
        "driver": "none",
        "docker": "27.3.1",
        "torch": "2.14.1+cpu",
        "nccl": "none",
    }
    assert set(locked) == {"node1", "node2", "node3", "node9"}  # a node not checked is kept
    assert sorted(name for name, kind in healed.calls if kind == "versions") == [
        "node1",
        "node2",
        "node3",
    ]


@pytest.mark.parametrize("faults", FAULTS.values(), ids=FAULTS.keys())
def test_a_failed_netcheck_creates_no_lock_where_there_was_none(
    tmp_path, monkeypatch, capsys, faults
):
    (tmp_path / "inventory.yml").write_text(INVENTORY)
    code, report = _netcheck(tmp_path, monkeypatch, capsys, _cluster(**faults))
    assert (code, report["lock_file"]) == (1, None)
    assert _locks(tmp_path) == []
    assert lock.load(tmp_path / lock.FILENAME) is None  # make train then compares nothing
