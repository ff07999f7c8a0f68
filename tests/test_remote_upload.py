"""Uploading committed snapshots to a file:// remote (snapd/remote/upload.py,
snapd/remote/uploader.py): every file, the record last, files already up skipped;
the uploader's newest-wins slot, retries, resume at start, and local retention
deleting a snapshot while it is uploaded."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from helpers import plan_for, record_puts, wait_for
from snapd import format as fmt
from snapd.errors import InvalidOption, RemoteUnavailable
from snapd.options import Options
from snapd.remote import uploader as uploader_mod
from snapd.remote.layout import RemoteRoot
from snapd.remote.upload import local_files, upload_snapshot
from snapd.remote.uploader import Uploader
from snapd.store import RunStore, SnapshotId
from snapd.writer import write_snapshot

RUN = "r"


@pytest.fixture
def store(tmp_path):
    return RunStore(str(tmp_path / "root"), RUN)


@pytest.fixture
def remote(tmp_path):
    """A file:// remote with a filesystem of its own: fsspec shares one instance per
    set of arguments, and these tests replace its methods."""
    from fsspec.implementations.local import LocalFileSystem
    fs = LocalFileSystem(auto_mkdir=True, skip_instance_cache=True)
    return RemoteRoot(f"file://{tmp_path}/remote", fs=fs)


def commit(store, step, n=2048):
    state = {"w": torch.arange(n, dtype=torch.float32) + step, "b": torch.ones(7) * step}
    return write_snapshot(store, plan_for(state, step), Options()).sid




def remote_bytes(remote, name, rel):
    return remote.fs.cat_file(remote.file_path(RUN, name, rel))


def test_every_file_goes_up_then_the_manifest_then_the_record(store, remote):
    sid = commit(store, 1)
    order = record_puts(remote, RUN)
    record = upload_snapshot(remote, store, sid.name, threads=2)
    files = local_files(store.snapshot_path(sid))
    assert sorted(order) == sorted([f"snapshots/{sid.name}/{f.relpath}" for f in files]
                                   + [f"committed/{sid.name}.snapd"])
    assert order[-1] == f"committed/{sid.name}.snapd"
    assert order[-2] == f"snapshots/{sid.name}/{fmt.MANIFEST_NAME}"
    assert remote.commits(RUN) == [sid]
    assert remote.read_record(RUN, sid.name) == record
    for f in files:
        with open(os.path.join(store.snapshot_path(sid), f.relpath), "rb") as local:
            assert remote_bytes(remote, sid.name, f.relpath) == local.read()


def test_a_second_upload_sends_only_what_is_missing_or_of_the_wrong_size(store, remote):
    sid = commit(store, 1)
    upload_snapshot(remote, store, sid.name)
    tensors = [f.relpath for f in local_files(store.snapshot_path(sid))
               if f.relpath.endswith(fmt.TENSOR_FILE_SUFFIX)]
    # As a crash leaves it: no record, the manifest not up, a tensor file cut short.
    remote.fs.rm_file(remote.record_path(RUN, sid.name))
    remote.fs.rm_file(remote.file_path(RUN, sid.name, fmt.MANIFEST_NAME))
    remote.fs.pipe_file(remote.file_path(RUN, sid.name, tensors[0]), b"torn")
    order = record_puts(remote, RUN)
    upload_snapshot(remote, store, sid.name)
    assert order == [f"snapshots/{sid.name}/{tensors[0]}",
                     f"snapshots/{sid.name}/{fmt.MANIFEST_NAME}",
                     f"committed/{sid.name}.snapd"]
    assert remote.commits(RUN) == [sid]


def test_a_snapshot_already_committed_remotely_is_not_sent_again(store, remote):
    sid = commit(store, 1)
    first = upload_snapshot(remote, store, sid.name)
    order = record_puts(remote, RUN)
    assert upload_snapshot(remote, store, sid.name) == first
    assert order == []


# --- the uploader ------------------------------------------------------------------------

def options(tmp_path, **more):
    return Options(remote=f"file://{tmp_path}/remote", remote_keep_last=0, **more)


@pytest.fixture
def fast_retries(monkeypatch):
    monkeypatch.setattr(uploader_mod, "FIRST_RETRY_S", 0.02)


def started(tmp_path, store, remote, **more):
    up = Uploader(store.root, options(tmp_path, **more), remote=remote)
    up.start()
    return up


def test_the_newest_snapshot_replaces_a_stale_one_waiting(tmp_path, store, remote):
    gate, entered = threading.Event(), threading.Event()
    put = remote.fs.put_file

    def held(src, dst, **k):   # the first upload waits until 2 and 3 are filed
        entered.set()
        gate.wait(10)
        return put(src, dst, **k)
    remote.fs.put_file = held
    up = started(tmp_path, store, remote)
    try:
        sids = [commit(store, 1)]
        up.committed(RUN, 0, sids[0], 100)
        assert entered.wait(10)
        for step in (2, 3):   # local commits while the first one is being uploaded
            sids.append(commit(store, step))
            up.committed(RUN, 0, sids[-1], 100)
        status = up.status()["runs"][RUN]
        assert status["uploading"] == sids[0].name and status["pending"] == sids[2].name
        assert status["steps_behind"] == 3 and status["bytes_behind"] >= 100
        gate.set()
        assert wait_for(lambda: up.idle() and remote.commits(RUN) == [sids[0], sids[2]], 10)
        status = up.status()["runs"][RUN]
        assert status["last"]["name"] == sids[2].name and status["steps_behind"] == 0
    finally:
        gate.set()
        up.stop()


def test_a_failing_remote_is_retried_and_its_error_shown(tmp_path, store, remote,
                                                          fast_retries):
    sid = commit(store, 1)
    failures, shown, lock = [], [], threading.Lock()
    put = remote.fs.put_file
    up = Uploader(store.root, options(tmp_path), remote=remote)

    def flaky(src, dst, **k):
        # What status shows at each transfer. A retry starts only once the failed
        # attempt's error is recorded, and the error is cleared only after the last
        # transfer succeeded: every transfer of a retry sees it, however fast the
        # retries (polling status from here could fall between them).
        shown.append(up.status()["runs"][RUN]["last_error"])
        with lock:   # transfers run in parallel: exactly three fail
            fail = len(failures) < 3
            if fail:
                failures.append(dst)
        if fail:
            raise ConnectionError("remote down")
        return put(src, dst, **k)
    remote.fs.put_file = flaky
    up.start()
    try:
        up.committed(RUN, 0, sid, 100)
        assert wait_for(lambda: remote.commits(RUN) == [sid], 10)
        assert len(failures) == 3
        assert any(e and "remote down" in e for e in shown), shown
        assert wait_for(lambda: up.status()["runs"][RUN]["last_error"] is None, 5)
    finally:
        up.stop()


def test_at_start_the_newest_local_commit_missing_remotely_is_uploaded(tmp_path, store,
                                                                       remote):
    first = commit(store, 1)
    upload_snapshot(remote, store, first.name)
    commit(store, 2)
    newest = commit(store, 3)
    up = started(tmp_path, store, remote)
    try:
        assert wait_for(lambda: remote.commits(RUN) == [first, newest], 10)
    finally:
        up.stop()


def test_a_snapshot_deleted_locally_during_its_upload_still_goes_up(tmp_path, store,
                                                                    remote):
    import shutil
    sid = commit(store, 1)
    put, deleted = remote.fs.put_file, []

    def delete_first(src, dst, **k):   # local retention strikes mid-upload
        if not deleted:
            shutil.rmtree(store.snapshot_path(sid))
            deleted.append(sid)
        return put(src, dst, **k)
    remote.fs.put_file = delete_first
    up = started(tmp_path, store, remote)
    try:
        up.committed(RUN, 0, sid, 100)
        assert wait_for(lambda: remote.commits(RUN) == [sid], 10)
        assert wait_for(up.idle, 5)
        assert not [n for n in os.listdir(store.snapshots_path) if n.startswith(".tmp-")]
    finally:
        up.stop()


def test_the_state_log_is_replicated_after_a_remote_commit(tmp_path, store, remote):
    sid = commit(store, 1)
    seg = os.path.join(store.log_path, "rank-00000", "000000000001.log")
    os.makedirs(os.path.dirname(seg))
    with open(seg, "wb") as f:
        f.write(b"records")
    up = started(tmp_path, store, remote)
    try:
        up.committed(RUN, 0, sid, 100)
        path = f"{remote.log_path(RUN)}/rank-00000/000000000001.log"
        assert wait_for(lambda: remote.fs.exists(path) and remote.fs.cat_file(path) == b"records", 10)
    finally:
        up.stop()


# --- options -------------------------------------------------------------------------------

def test_a_remote_url_with_credentials_is_refused_without_echoing_them():
    with pytest.raises(InvalidOption) as e:
        Options(remote="s3://AKIA:hunter2@bucket/prefix")
    assert "hunter2" not in str(e.value) and "environment" in str(e.value)
    assert e.value.field == "remote"


def test_remote_options_from_the_environment():
    o = Options.resolve(environ={"SNAPD_REMOTE": "file:///x", "SNAPD_REMOTE_KEEP_EVERY": "100",
                                 "SNAPD_REMOTE_KEEP_LAST": "3"})
    assert (o.remote, o.remote_keep_every, o.remote_keep_last) == ("file:///x", 100, 3)
    assert Options.resolve(environ={"SNAPD_REMOTE": ""}).remote is None


def test_a_missing_remote_is_a_transfer_error(store, remote):
    """What the uploader retries: an unreachable remote is RemoteUnavailable."""
    sid = commit(store, 1)
    remote.fs.put_file = lambda *a, **k: (_ for _ in ()).throw(ConnectionError("down"))
    with pytest.raises(RemoteUnavailable):
        upload_snapshot(remote, store, sid.name)
    assert remote.commits(RUN) == []
    assert SnapshotId.parse(sid.name) == sid
