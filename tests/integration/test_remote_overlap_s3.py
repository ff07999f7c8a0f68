"""restore(overlap=True) on a new node, from a real S3 API (moto's server on
127.0.0.1): the optimizer's file is downloaded after restore returns, then committed
locally, and the run is bit for bit the restore without overlap; a process killed
while it downloads leaves nothing committed, and the next start pulls again. The
clients run in this process (daemon=False); the killed one is a child of a warm
parent (warm.py). The same cases on a file:// remote, and damage:
tests/test_restore_overlap_remote.py."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from helpers import (OverlapJob, assert_same, hold_pull_finish, read_manifest,
                     resumed_from_remote, wait_until)
from snapd.remote.layout import RemoteRoot
from snapd.remote.upload import upload_snapshot
from snapd.store import RunStore, SnapshotId

RUN = "r"
JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "overlap_pull_job.py")
SIX = SnapshotId(0, 6)


Job = OverlapJob


@pytest.fixture(scope="module")
def trained(s3_server, tmp_path_factory):
    """A run with snapshots at steps 3 and 6 uploaded by the uploader's own
    upload_snapshot to a prefix of the module's server (no test changes it): its
    URL, and the optimizer's file name in snapshot 6."""
    root = str(tmp_path_factory.mktemp("overlap-s3") / "node-a")
    torch.manual_seed(1)
    job = Job(root)
    for step in range(1, 7):
        job.step()
        if step % 3 == 0:
            job.client.snapshot(step)
    job.client.close()
    url, store = s3_server.url(), RunStore(root, RUN)
    with pytest.MonkeyPatch.context() as env:
        for key, value in s3_server.env.items():
            env.setenv(key, value)
        remote = RemoteRoot(url)
        for sid in store.committed():
            upload_snapshot(remote, store, sid.name)
    optimizer = read_manifest(store.snapshot_path(SIX))["objects"]["optimizer"]["file"]
    return url, optimizer


def test_over_s3_the_optimizer_file_arrives_after_restore_and_the_run_is_the_same(
        trained, s3_env, tmp_path, monkeypatch):
    url, optimizer = trained
    plain = resumed_from_remote(str(tmp_path / "plain"), url, overlap=False)
    entered, release = hold_pull_finish(monkeypatch)
    root = str(tmp_path / "overlapped")
    store = RunStore(root, RUN)

    def held_first_step(job):
        assert entered.wait(60) and job.client.optimizer_state_pending
        assert store.committed() == []
        [tmp] = store.tmp_dirs()
        assert "manifest.snapd" in os.listdir(tmp) and optimizer not in os.listdir(tmp)
        job.forward_backward()
        release.set()
        job.opt.step()   # waits for the download, verifies, commits, applies
        job.sched.step()

    assert_same(resumed_from_remote(root, url, overlap=True, first_step=held_first_step), plain)
    assert store.committed() == [SIX] and store.read_pointer("LATEST") == SIX
    assert store.tmp_dirs() == []


def test_a_kill_while_the_optimizer_file_downloads_commits_nothing(trained, s3_env,
                                                                   tmp_path, warm):
    url, _ = trained
    root, marker = str(tmp_path / "node-b"), str(tmp_path / "restored")
    out = str(tmp_path / "job.out")
    proc = warm["resumed"].start(JOB, [root, url, marker], None, out)
    try:
        wait_until(lambda: os.path.exists(marker) or proc.poll() is not None, 120,
                   "the job's restore to return")
        assert os.path.exists(marker), open(out).read()[-3000:]
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(60) == -signal.SIGKILL
    finally:
        proc.kill()
    store = RunStore(root, RUN)
    assert store.committed() == [] and store.read_pointer("LATEST") is None
    assert len(store.tmp_dirs()) == 1   # the download, never read, collected as any

    job = Job(root, remote=url)
    assert job.client.restore(overlap=True) == 6
    assert job.client.restored_from == "remote"
    job.step()
    job.client.close()
    assert store.committed() == [SIX]
    assert store.collect_tmp() == 1 and store.committed() == [SIX]
