"""The one durable write (cluster.durable): a name holds the old file or the complete new one,
readable by all, and both the file and its directory entry reach the disk."""

from __future__ import annotations

import os

import pytest

from torch_multinode.cluster import durable, files


class Failed(Exception):
    pass


def test_the_complete_file_takes_its_name_readable_by_all(tmp_path):
    path = tmp_path / "deeper" / "state.json"
    durable.write_atomically(path, '{"a": 1}\n')
    assert path.read_text() == '{"a": 1}\n'
    # not mkstemp's 0600: the inventory's user fetches what a root container wrote
    assert path.stat().st_mode & 0o777 == 0o644
    durable.write_atomically(path, b"\x00bytes")
    assert path.read_bytes() == b"\x00bytes"
    durable.write_streamed(path, lambda file: [file.write(b"in "), file.write(b"pieces")])
    assert path.read_bytes() == b"in pieces"
    assert os.listdir(path.parent) == ["state.json"]


@pytest.mark.parametrize("failure", [Failed, KeyboardInterrupt])
def test_a_failing_writer_leaves_the_old_file_and_no_temp_file(tmp_path, failure):
    path = tmp_path / "checkpoint.pt"
    path.write_bytes(b"old")

    def writer(file):
        file.write(b"half of it")
        raise failure("disk full")

    with pytest.raises(failure, match="disk full"):
        durable.write_streamed(path, writer)
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["checkpoint.pt"]


def test_before_rename_sees_the_complete_temp_file_while_the_name_holds_the_old(tmp_path):
    path = tmp_path / "rank-00000.pt"
    path.write_bytes(b"old")
    seen = []

    def before_rename(temporary):
        seen.append((temporary.parent, temporary.name, temporary.read_bytes(), path.read_bytes()))

    durable.write_atomically(path, b"new and whole", before_rename)
    [(parent, name, content, held)] = seen
    assert parent == tmp_path and name.startswith(".rank-00000.pt.") and name.endswith(".tmp")
    assert (content, held) == (b"new and whole", b"old")
    assert path.read_bytes() == b"new and whole"
    assert os.listdir(tmp_path) == ["rank-00000.pt"]


def test_a_failing_before_rename_leaves_the_old_file(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"old")

    def crash(temporary):
        raise Failed("killed before the rename")

    with pytest.raises(Failed):
        durable.write_atomically(path, b"new", crash)
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["f"]


def test_the_file_and_its_directory_are_fsynced(tmp_path, monkeypatch):
    path = tmp_path / "exit-code"
    synced = []
    real_fsync = os.fsync

    def fsync(descriptor):
        synced.append(os.readlink(f"/proc/self/fd/{descriptor}"))
        real_fsync(descriptor)

    monkeypatch.setattr(os, "fsync", fsync)
    durable.write_atomically(path, "0\n")
    [file, directory] = synced
    assert os.path.basename(file).startswith(".exit-code.") and file.endswith(".tmp")
    assert directory == str(tmp_path)
    assert path.read_text() == "0\n"


def test_the_controllers_write_and_a_received_file_are_the_same_write(tmp_path):
    assert files.write_atomically is durable.write_atomically
    target = durable.AtomicFile(tmp_path / "received")
    target.write(b"whole")
    target.commit()
    assert (tmp_path / "received").read_bytes() == b"whole"
    assert (tmp_path / "received").stat().st_mode & 0o777 == 0o644


def test_write_synced_writes_in_place_and_fsyncs(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    durable.write_synced(tmp_path / "manifest.pt", lambda file: file.write(b"m"))
    assert (tmp_path / "manifest.pt").read_bytes() == b"m" and len(synced) == 1
