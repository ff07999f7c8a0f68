"""The daemon's uploads to a real S3 API (moto's server on 127.0.0.1): a trainer with
the remote on gets every committed snapshot replicated byte for byte; a daemon killed
before the record leaves files no reader sees, and the next daemon commits them; the
S3 server killed while the trainer snapshots never stops training, shows in status,
and after its restart the newest snapshot is committed remotely."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from click.testing import CliRunner

from harness import Peer, snapshot_and_replicate
from helpers import plan_for, wait_until
from snapd import protocol as p
from snapd.cli import main as cli
from snapd.options import Options
from snapd.remote.layout import RemoteRoot
from snapd.remote.upload import local_files
from snapd.store import RunStore, SnapshotId
from snapd.writer import write_snapshot
from snapd_client import Client

pytestmark = pytest.mark.integration

HERE = os.path.dirname(os.path.abspath(__file__))


def model():
    torch.manual_seed(0)
    return torch.nn.Linear(64, 32)


def remote_of(server, url):
    """This process's view of ``server``: fsspec caches one S3 filesystem per set of
    arguments, and the endpoint comes from the environment, so each server gets its own."""
    import s3fs
    return RemoteRoot(url, fs=s3fs.S3FileSystem(endpoint_url=server.endpoint,
                                                skip_instance_cache=True))


def remote_status(root, run):
    with Peer(root) as peer:
        status = peer.request(p.Status())["status"]["remote"]
    return status, (status["runs"].get(run) or {})


def assert_same_bytes(store, remote, sid):
    for f in local_files(store.snapshot_path(sid)):
        with open(os.path.join(store.snapshot_path(sid), f.relpath), "rb") as local:
            data = remote.fs.cat_file(remote.file_path(store.run, sid.name, f.relpath))
            assert data == local.read(), f.relpath


def test_every_committed_snapshot_is_replicated_byte_for_byte(env, s3_env):
    url = s3_env.url()
    remote = remote_of(s3_env, url)
    net = model()
    client = Client(env.root, env.run, remote=url)
    client.track(model=net)
    try:
        snapshot_and_replicate(client, env, remote, net, (1, 2, 3))
        store = RunStore(env.root, env.run)
        # Remote retention's default (remote_keep_last 2): step 1 is gone remotely.
        wait_until(lambda: remote.commits(env.run) == [SnapshotId(0, 2), SnapshotId(0, 3)],
                   30, "remote retention")
        for sid in remote.commits(env.run):
            assert_same_bytes(store, remote, sid)
        status, run = remote_status(env.root, env.run)
        assert status["url"] == url and run["last"]["name"] == "00000003"
        assert run["steps_behind"] == 0 and run["last_error"] is None
    finally:
        client.close()


def commit_locally(root, run, steps):
    store = RunStore(root, run)
    for step in steps:
        state = {"w": torch.arange(4096, dtype=torch.float32) * step}
        write_snapshot(store, plan_for(state, step), Options())
    return store


def serve(root, url, env, *script):
    """A daemon with ``--remote url``; ``script``: a test daemon script and its args."""
    cmd = [sys.executable, *script] if script else \
        [sys.executable, "-m", "snapd", "serve", "--root", root, "--remote", url]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


def test_a_daemon_killed_before_the_record_leaves_nothing_committed(tmp_path, s3_env):
    url, run = s3_env.url(), "r"
    root = str(tmp_path / "root")
    store = commit_locally(root, run, (1, 2))
    env = {**os.environ, **s3_env.env, "SNAPD_MIN_FREE_BYTES": "0"}
    gate = str(tmp_path / "gate")
    gated = serve(root, url, env, os.path.join(HERE, "gated_upload_daemon.py"), root,
                  gate, url)
    try:
        # The daemon resumes the newest local commit: every file up, then it waits.
        wait_until(lambda: os.path.exists(gate + ".waiting"), 60, "the upload's files")
        gated.kill()
        gated.wait(30)
    finally:
        if gated.poll() is None:
            gated.kill()
    remote = remote_of(s3_env, url)
    newest = SnapshotId(0, 2)
    assert remote.commits(run) == []
    assert set(remote.uploaded_files(run, newest.name)) == \
        {f.relpath for f in local_files(store.snapshot_path(newest))}
    daemon = serve(root, url, env)
    try:
        wait_until(lambda: remote.commits(run) == [newest], 60, "the resumed upload")
        assert_same_bytes(store, remote, newest)
    finally:
        daemon.terminate()
        daemon.wait(30)


def test_the_remote_killed_while_training_never_stops_it(env, own_s3_server, monkeypatch):
    for key, value in {**own_s3_server.env, "SNAPD_REMOTE_RETRY_MAX_SECONDS": "0.5"}.items():
        monkeypatch.setenv(key, value)
    url = own_s3_server.url()
    remote = remote_of(own_s3_server, url)
    net = model()
    client = Client(env.root, env.run, remote=url)
    client.track(model=net)
    try:
        client.snapshot(1).wait(60)
        env.daemon(client)
        wait_until(lambda: remote.commits(env.run) == [SnapshotId(0, 1)], 60, "step 1 up")
        own_s3_server.kill()
        for step in (2, 3, 4):   # snapshot() and the local commits go on
            client.snapshot(step).wait(60)
        assert RunStore(env.root, env.run).committed()[-1] == SnapshotId(0, 4)
        wait_until(lambda: remote_status(env.root, env.run)[1].get("last_error"), 60,
                   "the remote's failure in status")
        _, run = remote_status(env.root, env.run)
        assert run["last"]["name"] == "00000001" and run["steps_behind"] == 3
        shown = CliRunner().invoke(cli, ["status", env.root, "--json"])
        lag = json.loads(shown.output)["remote"]["runs"][env.run]
        assert lag["last_error"] and lag["steps_behind"] == 3
        own_s3_server.restart()   # empty, as a store that lost everything
        wait_until(lambda: remote.commits(env.run) == [SnapshotId(0, 4)], 60,
                   "the newest snapshot up after the restart")
        wait_until(lambda: remote_status(env.root, env.run)[1].get("last_error") is None,
                   30, "the error cleared")
    finally:
        client.close()
