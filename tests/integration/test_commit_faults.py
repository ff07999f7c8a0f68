"""The real daemon process with a step after the commit that fails.

The daemon is started by a test harness (``DAEMON`` below, not ``snapd serve``): it
builds :class:`snapd.daemon.Daemon` with a faulty retention, or a hot cache whose
publish raises, and serves the root. A real trainer then snapshots through it with
one staging slot: each snapshot must resolve (no hang), the slot must come back for
the next one, and the snapshots on disk must verify.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from helpers import wait_for

from snapd.reader import SnapshotReader
from snapd.store import RunStore, SnapshotId
from snapd_client import Client
from snapd_client.connection import try_connect

pytestmark = pytest.mark.integration

DAEMON = textwrap.dedent("""
    import sys
    from snapd.arena_map import HotCache
    from snapd.daemon import Daemon

    root, fault = sys.argv[1], sys.argv[2]

    def failing_retention(store, opts, **kwargs):
        raise OSError(5, "injected: retention failed", store.snapshots_path)

    class FaultyPublish(HotCache):
        def publish(self, *args, **kwargs):
            raise RuntimeError("injected: hot publish failed")

    daemon = Daemon(root, **({"retain": failing_retention} if fault == "retention" else {}))
    if fault == "hot":
        daemon.hot_cache = FaultyPublish(max_bytes=daemon.options.hot_max_bytes)
    sys.exit(daemon.serve_forever())
""")


def start_daemon(root: str, fault: str, log_path: str) -> subprocess.Popen:
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-c", DAEMON, root, fault], stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    def serving() -> bool:   # no event to wait on: poll the socket
        assert proc.poll() is None, open(log_path).read()
        sock = try_connect(root)
        if sock is not None:
            sock.close()
        return sock is not None

    if wait_for(serving, 60, 0.05):
        return proc
    proc.kill()
    raise AssertionError(f"the test daemon did not serve: {open(log_path).read()}")


def train(root: str, outcome: list) -> None:
    client = Client(root, "r", slots=1, keep_last=1)
    client.track(model=torch.nn.Linear(4, 4))
    for step in (1, 2, 3):   # slots=1: snapshot(2) needs the slot step 1 used
        outcome.append(client.snapshot(step).wait(timeout=60))
    client.close()
    outcome.append("closed")


@pytest.mark.parametrize("fault", ["retention", "hot"])
def test_a_failure_after_the_commit_resolves_the_snapshot_and_frees_the_slot(tmp_path,
                                                                            fault):
    root = str(tmp_path / "root")
    os.mkdir(root, 0o700)
    log_path = str(tmp_path / "daemon.log")
    proc = start_daemon(root, fault, log_path)
    outcome: list = []
    try:
        trainer = threading.Thread(target=train, args=(root, outcome), daemon=True)
        trainer.start()
        trainer.join(120)
        assert not trainer.is_alive(), f"the trainer hangs: {open(log_path).read()}"
    finally:
        proc.kill()
        proc.wait(10)
    assert outcome and outcome[-1] == "closed", outcome
    assert [r.sid.name for r in outcome[:3]] == ["00000001", "00000002", "00000003"]
    store = RunStore(root, "r")
    kept = ["00000001", "00000002", "00000003"] if fault == "retention" else ["00000003"]
    assert [s.name for s in store.committed()] == kept
    for sid in store.committed():
        SnapshotReader(store.snapshot_path(sid)).verify()
    assert store.read_pointer("LATEST") == SnapshotId(0, 3)
    assert "injected" in open(log_path).read()
