"""restore(overlap=True) on a new node, from the remote tier: the optimizer's files are
downloaded in the background and committed after restore returns
(snapd_client/remotearrival.py, snapd/remote/pendingpull.py). In-process clients
(daemon=False) on a file:// remote filled by the uploader's own upload_snapshot; the
background download is held by substituting a gated one. The same over a real S3
API server: tests/integration/test_remote_overlap_s3.py."""

from __future__ import annotations

import glob
import os
import shutil

import pytest
import torch

from helpers import (OverlapJob, assert_same, file_remote_of, flip_byte, hold_pull_finish,
                     read_manifest, resumed_from_remote)
from snapd.errors import CorruptSnapshot, RemoteUnavailable, SnapdError
from snapd.remote.layout import RemoteRoot
from snapd.statelog import read_records
from snapd.store import RunStore, SnapshotId
from snapd_client.fromremote import RemoteWarning
from snapd_client.restore import FallbackWarning

RUN = "r"


Job = OverlapJob


@pytest.fixture(scope="module")
def remote_dir(tmp_path_factory) -> str:
    """A pristine file:// remote of a run with snapshots at steps 3 and 6."""
    base = tmp_path_factory.mktemp("overlap-remote")
    torch.manual_seed(1)
    job = Job(str(base / "node-a"))
    for step in range(1, 7):
        job.step()
        if step % 3 == 0:
            job.client.snapshot(step)
    job.client.close()
    file_remote_of(str(base / "node-a"), RUN, str(base / "remote"))
    return str(base / "remote")


@pytest.fixture
def remote(remote_dir, tmp_path) -> str:
    """A private copy of the remote (tests damage it); its URL."""
    copy = str(tmp_path / "remote")
    shutil.copytree(remote_dir, copy)
    return f"file://{copy}"


def optimizer_file(url: str, name: str) -> str:
    """The remote optimizer file of snapshot ``name``, as a local path."""
    remote = RemoteRoot(url)
    entry = read_manifest(remote.snapshot_path(RUN, name))["objects"]["optimizer"]
    return remote.file_path(RUN, name, entry["file"]), entry


def set_aside_and_passed_over(root: str, remote: str) -> Job:
    """Snapshot 6 found damaged on this node: nothing committed, its download kept
    set aside; the next start passes it over (one RemoteWarning) and resumes from the
    next older remote one, 3. Returns that restored job."""
    store = RunStore(root, RUN)
    assert store.committed() == [] and store.tmp_dirs() == []
    assert len(glob.glob(os.path.join(store.snapshots_path,
                                      ".damaged-00000006-remote-*"))) == 1
    again = Job(root, remote=remote)
    with pytest.warns(RemoteWarning, match="00000006 passed over"):
        assert again.client.restore(overlap=True) == 3   # the next older remote one
    return again


def test_the_optimizer_file_arrives_after_restore_and_the_run_is_the_same(
        remote, tmp_path, monkeypatch):
    plain = resumed_from_remote(str(tmp_path / "plain"), remote, overlap=False)
    entered, release = hold_pull_finish(monkeypatch)
    root = str(tmp_path / "overlapped")
    store = RunStore(root, RUN)
    _, entry = optimizer_file(remote, "00000006")

    def while_held(job):
        assert entered.wait(60) and job.client.optimizer_state_pending
        # restore returned with the moments' file still remote: nothing committed,
        # the download's tmp dir holds every file but the optimizer's
        assert store.committed() == [] and store.read_pointer("LATEST") is None
        [tmp] = store.tmp_dirs()
        assert "manifest.snapd" in os.listdir(tmp) and entry["file"] not in os.listdir(tmp)
        job.forward_backward()   # the first forward and backward run meanwhile
        release.set()
        job.opt.step()   # waits for the download, verifies, commits, applies
        job.sched.step()

    overlapped = resumed_from_remote(root, remote, overlap=True, first_step=while_held)
    assert_same(overlapped, plain)
    assert store.committed() == [SnapshotId(0, 6)] and store.tmp_dirs() == []
    assert store.read_pointer("LATEST") == SnapshotId(0, 6)
    records = list(read_records(store.path, 0))
    assert [r["restored_from"] for r in records if r.get("kind") == "resume"] == ["remote"]
    assert [r["objects"] for r in records if r.get("kind") == "restored"] == [["optimizer"]]


def test_a_damaged_remote_optimizer_file_stops_the_first_step_and_is_passed_over(
        remote, tmp_path):
    damaged, entry = optimizer_file(remote, "00000006")
    flip_byte(damaged, entry["tensors"][0]["chunks"][0][0])
    root = str(tmp_path / "node-b")
    job = Job(root, remote=remote)
    assert job.client.restore(overlap=True) == 6
    weights = {k: v.clone() for k, v in job.model.state_dict().items()}
    job.forward_backward()
    for _ in range(2):   # sticky
        with pytest.raises(CorruptSnapshot) as caught:
            job.opt.step()
        assert caught.value.path == RemoteRoot(remote).where(damaged)
        assert "No update was applied" in str(caught.value)
        assert "passes that remote snapshot over" in str(caught.value)
    assert all(torch.equal(weights[k], v) for k, v in job.model.state_dict().items())
    assert not job.opt.state
    job.client.close()

    again = set_aside_and_passed_over(root, remote)
    again.step()
    again.client.close()
    assert RunStore(root, RUN).committed() == [SnapshotId(0, 3)]


def test_a_download_that_fails_in_the_background_commits_nothing_and_the_next_start_pulls(
        remote, tmp_path, monkeypatch):
    entered, release = hold_pull_finish(monkeypatch)
    path, _ = optimizer_file(remote, "00000006")
    root = str(tmp_path / "node-b")
    job = Job(root, remote=remote)
    assert job.client.restore(overlap=True) == 6
    assert entered.wait(60)
    os.rename(path, path + ".away")   # the store loses it mid-restore
    release.set()
    job.forward_backward()
    with pytest.raises(SnapdError) as caught:
        job.opt.step()
    assert isinstance(caught.value.__cause__, RemoteUnavailable)
    message = str(caught.value)
    assert "optimizer.tensors" in message and "nothing was committed locally" in message
    assert "No update was applied" in message and "Restart the process" in message
    job.client.close()
    store = RunStore(root, RUN)
    assert store.committed() == [] and store.tmp_dirs() == []
    assert not glob.glob(os.path.join(store.snapshots_path, ".damaged-*"))

    os.rename(path + ".away", path)
    monkeypatch.undo()
    again = Job(root, remote=remote)
    assert again.client.restore(overlap=True) == 6
    assert again.client.restored_from == "remote"
    again.step()
    again.client.close()
    assert store.committed() == [SnapshotId(0, 6)]


def test_a_pull_not_committed_yet_is_checked_against_the_logs_manifest_digest(
        remote, tmp_path, monkeypatch):
    # The state log recorded another manifest for 00000006 than the remote holds
    # (rewritten since): the pending pull is refused by name, set aside, never
    # committed, and the next start passes it over.
    from snapd import logdigests
    real = logdigests.LoggedDigests.get
    monkeypatch.setattr(logdigests.LoggedDigests, "get", lambda self, name: "0" * 64
                        if name == "00000006" else real(self, name))
    root = str(tmp_path / "node-b")
    job = Job(root, remote=remote)
    with pytest.raises(CorruptSnapshot) as caught, \
            pytest.warns(FallbackWarning, match="passes that remote snapshot over"):
        job.client.restore(overlap=True)
    assert "manifest_sha256" in str(caught.value) and "00000006" in str(caught.value)
    job.client.close()
    set_aside_and_passed_over(root, remote).client.close()
