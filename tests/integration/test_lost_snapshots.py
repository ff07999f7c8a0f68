"""Snapshots lost or failed in the background, against the real daemon.

A daemon SIGKILLed around a snapshot: the trainer hears of it at its next log(),
snapshot() or close(), in a SnapshotWarning at its own line; the snapshot, its bytes
still staged in the trainer's arena, is retried on a new daemon and commits, bit for
bit what was staged (not what the tensors hold by then). close() returns a summary
when the newest snapshot committed, and raises only when it did not.

The daemon is stopped (SIGSTOP) before the snapshot is handed off, so that it cannot
commit before the SIGKILL: the loss is certain, not a race.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from snapd.errors import SnapshotExists, SnapshotFailed
from snapd.store import RunStore
from snapd_client import Client, CloseSummary, SnapshotWarning

from helpers import wait_exited, wait_until

pytestmark = pytest.mark.integration


class Blob:
    def __init__(self, fill: float = 1.0, n: int = 1 << 18) -> None:
        self.x = torch.full((n,), fill)

    def state_dict(self):
        return {"x": self.x}

    def load_state_dict(self, state):
        self.x.copy_(state["x"])


def started(env, fill: float = 1.0):
    """A client of a fresh run with one tracked blob, its step 1 committed."""
    blob = Blob(fill)
    client = Client(env.root, env.run)
    client.track(blob=blob)
    client.snapshot(1).wait()
    return client, blob


def lose_the_next_snapshot(env, client: Client, blob: Blob, step: int):
    """snapshot(step) handed to a stopped daemon, which is then killed; the live tensor
    changes after snapshot() returned. Returns the handle and the bytes staged."""
    daemon = env.daemon(client)
    daemon.suspend()
    staged = blob.x.clone()
    handle = client.snapshot(step)
    blob.x.fill_(-7.0)                      # the live state moves on; the retry must not
    daemon.kill()
    assert not wait_exited([daemon], 30)
    wait_until(handle.done, 30, f"the loss of step {step} to be noticed")
    assert handle.failed and not handle.outcome_unknown
    return handle, staged


def where_warned(warned) -> list:
    """The files each SnapshotWarning points at. Only those: the garbage collector may
    run inside the block and emit other objects' warnings (a ResourceWarning of an
    earlier test's leftovers) at whatever frame it interrupted."""
    return [w.filename for w in warned if issubclass(w.category, SnapshotWarning)]


def restored(env) -> tuple:
    blob = Blob(0.0)
    with Client(env.root, env.run) as again:
        again.track(blob=blob)
        return again.restore(), blob.x


def test_the_next_log_warns_at_the_users_line_and_the_retry_commits(env):
    client, blob = started(env)
    blob.x.fill_(2.0)
    handle, staged = lose_the_next_snapshot(env, client, blob, 2)
    with pytest.warns(SnapshotWarning, match=r"step\(s\) 2 did not commit and are retried "
                      "on a new daemon") as warned:
        client.log(3)
    assert where_warned(warned) == [__file__]
    assert handle.wait() is not None and handle.retries == 1
    store = RunStore(env.root, env.run)
    assert os.path.isdir(store.snapshot_path(handle.sid))
    assert client.close() == CloseSummary(committed=(1, 2))
    step, x = restored(env)
    assert step == 2 and torch.equal(x, staged)   # what was staged, bit for bit


def test_the_next_snapshot_warns_at_the_users_line_and_both_commit_in_order(env):
    client, blob = started(env)
    _, staged = lose_the_next_snapshot(env, client, blob, 2)
    with pytest.warns(SnapshotWarning, match=r"step\(s\) 2 did not commit") as warned:
        newest = client.snapshot(3)
    assert where_warned(warned) == [__file__]
    newest.wait()
    assert client.close() == CloseSummary(committed=(1, 2, 3))
    store = RunStore(env.root, env.run)
    assert store.read_pointer("LATEST").step == 3   # the retry went first
    assert restored(env)[0] == 3


def test_close_retries_the_newest_snapshot_lost_with_the_daemon(env):
    client, blob = started(env)
    blob.x.fill_(5.0)
    _, staged = lose_the_next_snapshot(env, client, blob, 2)
    with pytest.warns(SnapshotWarning, match="retried") as warned:
        summary = client.close()
    assert where_warned(warned) == [__file__]
    assert summary == CloseSummary(committed=(1, 2))
    step, x = restored(env)
    assert step == 2 and torch.equal(x, staged)


def occupy(env, step: int) -> None:
    """Put a committed snapshot of another step under ``step``'s name: the daemon's
    write of ``step`` then fails (SnapshotExists), a failure in the background."""
    store = RunStore(env.root, env.run)
    shutil.copytree(store.snapshot_path(store.read_pointer("LATEST")),
                    os.path.join(store.snapshots_path, f"{step:08d}"))


def test_close_after_a_later_commit_returns_a_summary_and_does_not_raise(env):
    client, _ = started(env)
    occupy(env, 2)
    failing = client.snapshot(2)
    wait_until(failing.done, 60, "the write of step 2 to fail")
    with pytest.warns(SnapshotWarning, match="snapshot of step 2 failed") as warned:
        client.snapshot(3)
    assert where_warned(warned) == [__file__]
    assert client.close() == CloseSummary(committed=(1, 3), failed=(2,))


def test_close_raises_when_the_newest_snapshot_failed(env):
    client, _ = started(env)
    occupy(env, 2)
    client.snapshot(2)
    with pytest.raises(SnapshotFailed, match="step 2") as failed:
        client.close()
    assert isinstance(failed.value.__cause__, SnapshotExists)
