"""Node-local roots through the remote tier (issue 16, "Many nodes"): one torchrun job
of 4 ranks on 2 roots (separate directories, a daemon each, as on two nodes), ranks
0-1 on the first and 2-3 on the second, with one moto S3 server as the shared remote.
No root ever holds every part: the global commit happens in the remote tier
(snapd/remote/parts.py), and each rank's close() sees it through its daemon's marker.
The job is then restarted on two fresh roots and resumes from the remote commit:
every rank's weights, optimizer state, RNG streams, learning rate and step equal, bit
for bit, those its first run ended with. (That the steps after a resume recompute
the uninterrupted run exactly is test_multirank.py's, at 2 ranks: at 4, DDP's first
iteration after it is built reduces gradients in a bucket layout of its own, which
changes the sums by rounding, with or without snapd.)"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from helpers import stop_daemons_under
from jobs import job_env, run_job
from rankstate import load_close, load_state, state_differences, with_prefix

from snapd.remote.layout import RemoteRoot
from snapd.store import RunStore, SnapshotId

pytest.importorskip("snapd.remote.pull")       # the reading side (restore, pull)
pytest.importorskip("snapd.remote.uploader")   # the daemon's uploads

CFG = {"steps": 16, "snapshot_every": 8, "batch_size": 4, "samples": 64, "hidden": 32,
       "run": "nodes"}
FINAL = ("param/", "opt/", "rng/", "lr", "step")


@pytest.fixture
def base():
    """Short paths: the daemons' sockets live under the roots."""
    path = tempfile.mkdtemp(prefix="sdnd-", dir="/tmp")
    yield path
    stop_daemons_under(path)
    shutil.rmtree(path, ignore_errors=True)


def job(base, name, url, s3, **cfg):
    out = os.path.join(base, name)
    os.makedirs(out)
    roots = [os.path.join(base, f"{name}-a"), os.path.join(base, f"{name}-b")]
    settings = {**CFG, "root": roots[0], "roots": roots, "out": out, **cfg}
    run_job("ddp_job.py", 4, settings, os.path.join(base, f"{name}.log"), timeout=180,
            env=job_env(**s3.env, SNAPD_REMOTE=url, SNAPD_GLOBAL_COMMIT_TIMEOUT="60"))
    return out, roots


def test_two_node_local_roots_commit_through_the_remote_and_resume_from_it(
        base, s3_env):
    url = s3_env.url()
    first, roots = job(base, "first", url, s3_env)
    # Every rank's close() saw the global commit of step 16 (its daemon's marker).
    assert [load_close(first, r)["error"] for r in range(4)] == [None] * 4
    remote = RemoteRoot(url)
    assert SnapshotId(0, 16) in remote.commits("nodes")
    assert remote.read_record("nodes", "00000016")["world_size"] == 4
    for root in roots:   # nothing committed on a node-local root: the remote commits
        assert RunStore(root, "nodes").committed() == []
    stop_daemons_under(base)
    # The job restarted on two fresh roots: each pulls step 16, all resume from it
    # (and, with nothing left to train, end with what they restored).
    again, fresh = job(base, "again", url, s3_env)
    for rank in range(4):
        got, want = load_state(again, rank), load_state(first, rank)
        assert int(got["first_step"]) == 16
        assert state_differences(got, want, with_prefix(want, *FINAL)) == []
    log = open(os.path.join(base, "again.log"), errors="replace").read()
    assert "resuming from step 16 (remote)" in log
    for root in fresh:
        assert SnapshotId(0, 16) in RunStore(root, "nodes").committed()
