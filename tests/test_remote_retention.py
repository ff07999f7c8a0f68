"""Remote retention and the sweep (snapd/remote/retention.py), and the log's
replication (snapd/remote/logsync.py), on a file:// remote."""

from __future__ import annotations

import os

import pytest

from snapd.remote import layout, retention
from snapd.remote.layout import RemoteFile, RemoteRoot
from snapd.remote.logsync import LogSync
from snapd.store import RunStore, SnapshotId

RUN = "r"


@pytest.fixture
def remote(tmp_path):
    """A file:// remote with a filesystem of its own: fsspec shares one instance per
    set of arguments, and these tests replace its methods."""
    from fsspec.implementations.local import LocalFileSystem
    fs = LocalFileSystem(auto_mkdir=True, skip_instance_cache=True)
    return RemoteRoot(f"file://{tmp_path}/remote", fs=fs)


def put(remote, step, *, record=True, lineage=0):
    sid = SnapshotId(lineage, step)
    files = (("manifest.snapd", b"M" * 8), ("a.tensors", b"x" * 4))
    for rel, data in files:
        remote.fs.pipe_file(remote.file_path(RUN, sid.name, rel), data)
    if record:
        remote.write_record(RUN, sid.name, layout.make_record(
            RUN, sid, 1, [RemoteFile(r, len(d)) for r, d in files], b"M" * 8))
    return sid


def steps(sids):
    return [s.step for s in sids]


@pytest.mark.parametrize("keep_last, keep_every, kept", [
    (2, None, [400, 500]),
    (2, 200, [200, 400, 500]),
    (0, 200, [200, 400, 500]),     # only the multiples, and the newest
    (0, None, [100, 200, 300, 400, 500]),   # 0 and no keep_every: all kept
    (1, 1000, [500]),
])
def test_remote_retention_keeps_the_last_and_every_nth_and_the_newest(
        remote, keep_last, keep_every, kept):
    for step in (100, 200, 300, 400, 500):
        put(remote, step)
    retention.apply(remote, RUN, keep_last, keep_every)
    assert steps(remote.commits(RUN)) == kept
    assert sorted(SnapshotId.parse(n).step for n in remote.snapshot_names(RUN)) == kept


def test_the_newest_remote_commit_is_never_deleted(remote):
    put(remote, 100)
    put(remote, 50, lineage=1)    # a newer lineage with a lower step is the newest
    retention.apply(remote, RUN, 1, None)
    assert remote.commits(RUN) == [SnapshotId(1, 50)]


def test_the_sweep_removes_only_uncommitted_files_older_than_the_newest_record(remote):
    put(remote, 100, record=False)          # abandoned: older than the newest record
    put(remote, 200)
    put(remote, 300, record=False)          # in progress: newer, kept
    remote.fs.pipe_file(f"{remote.parts_path(RUN, '00000100')}/rank-00000.snapd", b"p")
    assert retention.sweep(remote, RUN) == ["00000100"]
    assert remote.snapshot_names(RUN) == ["00000200", "00000300"]
    assert not remote.fs.exists(remote.parts_path(RUN, "00000100"))
    assert steps(remote.commits(RUN)) == [200]


def test_nothing_is_swept_without_any_record(remote):
    put(remote, 100, record=False)
    assert retention.sweep(remote, RUN) == []
    assert remote.snapshot_names(RUN) == ["00000100"]


def test_the_log_sends_only_segments_whose_size_changed(tmp_path, remote):
    store = RunStore(str(tmp_path / "root"), RUN)
    rank = os.path.join(store.log_path, "rank-00000")
    os.makedirs(rank)
    segs = [os.path.join(rank, f"{i:012d}.log") for i in (1, 2)]
    for seg in segs:
        with open(seg, "wb") as f:
            f.write(b"a" * 10)
    sync = LogSync(remote, store.root)
    assert sync.sync(RUN) == 2
    assert sync.sync(RUN) == 0
    with open(segs[1], "ab") as f:
        f.write(b"b" * 5)
    assert sync.sync(RUN) == 1
    remote_seg = f"{remote.log_path(RUN)}/rank-00000/{os.path.basename(segs[1])}"
    assert remote.fs.cat_file(remote_seg) == b"a" * 10 + b"b" * 5
    # A restarted daemon learns what is up from the remote, and sends nothing again.
    assert LogSync(remote, store.root).sync(RUN) == 0


def test_the_remote_lag_is_written_one_line_per_run():
    from snapd.liveview import remote_lines
    status = {"url": "s3://b/p", "last_error": None, "runs": {"r": {
        "last": {"name": "00000100", "step": 100, "at": 990.0}, "pending": "00000300",
        "uploading": "00000200", "steps_behind": 200, "bytes_behind": 3_000_000,
        "last_error": "RemoteUnavailable: down"}}}
    head, line = remote_lines(status, now=1000.0)
    assert head == "remote s3://b/p"
    assert "last remote commit 00000100" in line and "200 steps" in line
    assert "3.0 MB behind" in line and "uploading 00000200" in line
    assert "next 00000300" in line and "last error: RemoteUnavailable: down" in line
    assert remote_lines(None, 0.0) == []
