"""Many ranks, the daemon's faults: a daemon SIGKILLed while it writes a snapshot's
parts leaves that snapshot uncommitted and the job going (issue 14, "Faults").

The daemon serving the root is the gated one (gated_daemon.py): rank 0's writes go
through, rank 1's wait at the gate, so the kill lands with rank 0's part of step 4
durable and rank 1's in flight, every time. The job's clients find the daemon gone,
start another and hand it what the lost one held (snapd_client/lostdaemon.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest

from helpers import stop_daemons_under, wait_until
from jobs import Job, snapshot_dir
from snapd.globalsnap import GlobalSnapshot
from snapd.names import SOCKET_NAME
from snapd.store import RunStore, SnapshotId

GATED = os.path.join(os.path.dirname(__file__), "gated_daemon.py")
STEPS, EVERY = 12, 4


@pytest.fixture
def short_base():
    """A short directory: the daemon's socket lives under the root."""
    path = tempfile.mkdtemp(prefix="sdmf-", dir="/tmp")
    yield path
    stop_daemons_under(path)
    subprocess.run(["rm", "-rf", path], check=False)


def test_a_daemon_killed_mid_write_leaves_that_snapshot_uncommitted_and_the_job_going(
        short_base, daemon_env):
    root, gate = os.path.join(short_base, "root"), os.path.join(short_base, "gate")
    os.makedirs(root)
    with open(os.path.join(short_base, "gated.log"), "wb") as log:
        gated = subprocess.Popen([sys.executable, GATED, root, gate, "0", "1"],
                                 stdout=log, stderr=log, env=daemon_env,
                                 start_new_session=True)
    wait_until(lambda: os.path.exists(os.path.join(root, SOCKET_NAME)), 60,
               "the gated daemon's socket")
    out = os.path.join(short_base, "out")
    os.makedirs(out)
    cfg = {"root": root, "run": "faults", "out": out, "steps": STEPS,
           "snapshot_every": EVERY, "batch_size": 4, "samples": 96}
    job = Job("ddp_job.py", 2, cfg, os.path.join(short_base, "job.log"))
    store = RunStore(root, "faults")
    first = store.parts_path(SnapshotId(0, EVERY))
    job.wait_until(lambda: os.path.exists(gate + ".waiting")
                   and os.path.isdir(os.path.join(first, "rank-00000")), 90,
                   "rank 0's part of step 4 durable and rank 1's write in flight")
    gated.kill()
    gated.wait(10)
    # Killed mid-write: one part durable, the snapshot not committed.
    assert not os.path.exists(snapshot_dir(root, "faults", EVERY))
    assert store.committed() == []
    assert job.wait(180) == 0, job.output()
    # The job went on: its clients started another daemon and every snapshot after
    # the kill committed globally; every committed one verifies, part by part.
    committed = [sid.step for sid in store.committed()]
    assert committed and committed[-1] == STEPS, committed
    for sid in store.committed():
        GlobalSnapshot(store.snapshot_path(sid)).verify()
    assert store.parts_dirs() == []   # nothing half-committed left behind
    assert store.read_pointer("LATEST").step == STEPS

