"""The remote tier's layout and records (snapd/remote/layout.py), on a file:// remote:
what counts as committed, what a hostile record is refused for, and that URLs
with credentials are never shown with them."""

from __future__ import annotations

import pytest

from snapd.errors import CorruptSnapshot, RemoteUnavailable
from snapd.remote import layout
from snapd.remote.layout import RemoteFile, RemoteRoot
from snapd.store import SnapshotId


@pytest.fixture
def remote(tmp_path):
    return RemoteRoot(f"file://{tmp_path}/remote")


def _commit(remote, run, sid, files=(("manifest.snapd", b"M" * 40), ("a.tensors", b"x" * 9))):
    for rel, data in files:
        remote.fs.pipe_file(remote.file_path(run, sid.name, rel), data)
    record = layout.make_record(run, sid, 1, [RemoteFile(r, len(d)) for r, d in files],
                                dict(files)["manifest.snapd"])
    remote.write_record(run, sid.name, record)
    return record


def test_only_snapshots_with_a_record_are_committed(remote):
    _commit(remote, "run", SnapshotId(0, 20))
    remote.fs.pipe_file(remote.file_path("run", "00000030", "a.tensors"), b"half")
    assert remote.commits("run") == [SnapshotId(0, 20)]
    assert remote.snapshot_names("run") == ["00000020", "00000030"]
    assert remote.runs() == ["run"]
    record = remote.read_record("run", "00000020")
    assert layout.record_files(record) == [RemoteFile("a.tensors", 9),
                                           RemoteFile("manifest.snapd", 40)]
    assert remote.uploaded_files("run", "00000020") == {"a.tensors": 9,
                                                        "manifest.snapd": 40}


def test_delete_removes_the_record_before_the_files(remote):
    _commit(remote, "run", SnapshotId(0, 20))
    remote.delete_snapshot("run", "00000020")
    assert remote.commits("run") == []
    assert remote.uploaded_files("run", "00000020") == {}


def test_a_record_filed_under_another_name_is_refused(remote):
    record = _commit(remote, "run", SnapshotId(0, 20))
    remote.fs.pipe_file(remote.record_path("run", "00000040"),
                        layout.encode_record(record))
    with pytest.raises(CorruptSnapshot) as e:
        remote.read_record("run", "00000040")
    assert e.value.field == "name" and "00000040" in str(e.value)


@pytest.mark.parametrize("relpath", ["../escape", "/etc/passwd", "rank-1/x", "a/b/c", ""])
def test_a_record_naming_a_path_outside_the_snapshot_is_refused(remote, relpath):
    record = _commit(remote, "run", SnapshotId(0, 20))
    record["files"].append([relpath, 1])
    remote.write_record("run", "00000020", record)
    with pytest.raises(CorruptSnapshot) as e:
        remote.read_record("run", "00000020")
    assert e.value.field == "files"


def test_a_damaged_record_is_refused_naming_the_url(remote):
    _commit(remote, "run", SnapshotId(0, 20))
    path = remote.record_path("run", "00000020")
    data = bytearray(remote.fs.cat_file(path))
    data[-1] ^= 0xFF
    remote.fs.pipe_file(path, bytes(data))
    with pytest.raises(CorruptSnapshot) as e:
        remote.read_record("run", "00000020")
    assert e.value.field == "checksum" and e.value.path.startswith("file://")


def test_credentials_never_appear_in_the_url_shown():
    shown = layout.redact("s3://AKIAXYZ:s3cr3t@bucket/prefix")
    assert "s3cr3t" not in shown and "AKIAXYZ" not in shown
    assert shown == "s3://bucket/prefix"


def test_a_path_that_is_not_a_url_is_refused_with_advice():
    with pytest.raises(RemoteUnavailable) as e:
        RemoteRoot("/mnt/shared")
    assert "s3://" in str(e.value) and e.value.field == "remote"
