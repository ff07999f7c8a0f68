"""Failures reach the trainer when they happen, at its own line; close() raises only
for the newest snapshot. A stand-in connection plays the daemon (no process starts):
the test sends the events a daemon would, or loses it."""

from __future__ import annotations

import errno
import warnings

import pytest
import torch

from snapd import protocol as proto
from snapd.errors import DaemonUnavailable, InsufficientSpace, SnapshotFailed
from snapd.store import SnapshotId
from snapd_client import Client, CloseSummary, SnapshotWarning
from snapd_client import handoff as handoff_mod
from snapd_client.handle import SnapshotHandle
from snapd.plan import used_bytes


class StandIn:
    """What Handoff needs of a daemon connection; records the submits, and can be
    lost (dead) like a SIGKILLed daemon's."""

    def __init__(self, *args, pid: int = 4242, **kwargs) -> None:
        self.lost = None
        self.daemon_pid = pid
        self.sent: list = []
        self.alive = True

    def request(self, message):
        assert isinstance(message, (proto.Attach, proto.Bye, proto.HotGet)), message
        return proto.HotReply() if isinstance(message, proto.HotGet) else proto.Ok()

    def send_request(self, message, on_reply) -> None:
        self.sent.append(message)

    def wait_for(self, event, what) -> None:
        if not event.wait(5):
            raise self.lost or DaemonUnavailable(f"stand-in: no event for {what}")

    def check(self, what, since=0.0) -> None:
        if self.lost is not None:
            raise self.lost

    def daemon_alive(self) -> bool:
        return self.alive

    def close(self) -> None:
        self.lost = self.lost or DaemonUnavailable("closed")


@pytest.fixture
def client(tmp_path):
    c = Client(str(tmp_path), "r", daemon=True)
    c._handoff.conn = StandIn()   # before track(): its warm-up connects
    c.track(model=torch.nn.Linear(8, 4))
    yield c
    c._closed = True        # a test that left the client open: release its resources
    c._handoff.close()
    if c._journal is not None:
        c._journal.close()
    c._lock.release()


def submitted(client: Client, conn: StandIn, step: int) -> proto.Submit:
    client._handoff.drain()   # the submit is the stager thread's
    [submit] = [m for m in conn.sent if isinstance(m, proto.Submit) and m.step == step]
    return submit


def commit(client: Client, conn: StandIn, step: int) -> None:
    sub = submitted(client, conn, step)
    client._handoff._on_event(proto.Committed("r", 0, step, sub.slot,
                                              SnapshotId(0, step).name, 100, 0.1))


def fail(client: Client, conn: StandIn, step: int) -> None:
    sub = submitted(client, conn, step)
    client._handoff._on_event(proto.Failed("r", 0, step, sub.slot, "InsufficientSpace",
                                           "disk full: free space"))


def no_warning(call) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        call()


def first_snapshot_failed(client):
    """snapshot(1) handed off, then failed by the (stand-in) daemon; its connection."""
    conn = client._handoff.conn
    client.snapshot(1)
    fail(client, conn, 1)
    return conn


def test_a_background_failure_is_warned_once_at_the_next_log_on_the_users_line(client):
    conn = first_snapshot_failed(client)
    with pytest.warns(SnapshotWarning, match="snapshot of step 1 failed: disk full") as w:
        client.log(2)
    assert [r.filename for r in w] == [__file__]
    no_warning(lambda: client.log(3))           # once per snapshot
    handle = client.snapshot(4)
    fail(client, conn, 4)
    with pytest.raises(SnapshotFailed):
        handle.wait()
    no_warning(lambda: client.log(5))           # wait() already told the trainer


def test_the_warning_at_the_next_snapshot_points_at_the_users_line(client):
    first_snapshot_failed(client)
    with pytest.warns(SnapshotWarning, match="step 1") as w:
        client.snapshot(2)
    assert [r.filename for r in w] == [__file__]


def test_close_returns_a_summary_when_a_later_snapshot_committed(client, caplog):
    conn = client._handoff.conn
    client.snapshot(1)
    fail(client, conn, 1)
    with pytest.warns(SnapshotWarning):
        client.snapshot(2)
    commit(client, conn, 2)
    with caplog.at_level("INFO", logger="snapd_client"):
        summary = client.close()
    assert summary == CloseSummary(committed=(2,), failed=(1,), skipped=())
    assert summary.newest_committed == 2
    assert "1 committed (step 2), 1 failed (step 1), 0 skipped" in caplog.text


def test_close_raises_when_the_newest_did_not_commit(client):
    conn = client._handoff.conn
    client.snapshot(1)
    commit(client, conn, 1)
    client.snapshot(2)
    fail(client, conn, 2)
    with pytest.raises(SnapshotFailed, match="step 2"):
        client.close()
    assert client.close() == CloseSummary(committed=(1,), failed=(2,))


def test_an_older_failure_first_seen_at_close_is_warned_at_the_users_close(tmp_path):
    c = Client(str(tmp_path), "r", daemon=True, slots=2)
    c._handoff.conn = conn = StandIn()
    c.track(model=torch.nn.Linear(8, 4))
    c.snapshot(1)
    c.snapshot(2)          # both in flight: one slot each
    fail(c, conn, 1)
    commit(c, conn, 2)
    with pytest.warns(SnapshotWarning, match="step 1") as w:
        assert c.close() == CloseSummary(committed=(2,), failed=(1,))
    assert [r.filename for r in w] == [__file__]


def test_a_later_slot_whose_pages_could_not_be_allocated_fails_that_snapshot_only(
        tmp_path):
    """A first snapshot waits for its own slot's pages only (staging.Arena.ready).
    Suppose a later slot's pages cannot be allocated while another slot is in flight.
    Then that snapshot fails, naming the slot, and the arena the other one is staged
    in is kept."""
    c = Client(str(tmp_path), "r", daemon=True, slots=2)
    c._handoff.conn = conn = StandIn()
    c.track(model=torch.nn.Linear(8, 4))
    first = c.snapshot(1)
    arena = c._handoff.arena
    arena._prefault.error = OSError(errno.ENOSPC, "No space left on device")
    second = c.snapshot(2)
    assert second.failed and isinstance(second.error, InsufficientSpace)
    assert "staging slot 1" in str(second.error) and arena.path in str(second.error)
    assert c._handoff.arena is arena and not first.done()
    commit(c, conn, 1)
    assert first.wait().bytes_written == 100
    with pytest.raises(SnapshotFailed, match="staging slot 1"):   # the newest failed
        c.close()


def test_a_skipped_newest_is_not_a_failure(tmp_path):
    c = Client(str(tmp_path), "r", daemon=True, on_busy="skip")
    c._handoff.conn = conn = StandIn()
    c.track(model=torch.nn.Linear(8, 4))
    c.snapshot(1)
    assert c.snapshot(2).skipped             # step 1 still holds the one slot
    commit(c, conn, 1)
    assert c.close() == CloseSummary(committed=(1,), skipped=(2,))


def test_an_in_process_failure_is_warned_at_the_next_log(tmp_path, monkeypatch):
    c = Client(str(tmp_path), "r", daemon=False)
    c.track(model=torch.nn.Linear(8, 4))
    monkeypatch.setattr("snapd_client.client.CommitService.commit",
                        lambda *a, **k: (_ for _ in ()).throw(OSError(28, "No space")))
    c.snapshot(1)
    with pytest.warns(SnapshotWarning, match="step 1 failed") as w:
        c.log(2)
    assert w[0].filename == __file__
    with pytest.raises(SnapshotFailed):
        c.close()


# --- a lost daemon: the retry of what is still staged --------------------------------

def lose(client: Client, conn: StandIn) -> None:
    """The daemon dies (SIGKILL): the reader thread's loss, as the connection reports it."""
    conn.alive = False
    conn.lost = DaemonUnavailable("lost the daemon (pid 4242): connection reset")
    client._handoff._on_lost(conn.lost)


def test_a_lost_snapshot_still_staged_is_retried_on_a_new_daemon(client, monkeypatch):
    old = client._handoff.conn
    handle = client.snapshot(1)
    sub = submitted(client, old, 1)
    staged = bytes(client._handoff.arena.view(sub.slot, 0, used_bytes(sub.plan)).numpy())
    lose(client, old)
    assert handle.failed and "did not commit" in str(handle.error)
    new = StandIn(pid=5151)
    monkeypatch.setattr(handoff_mod, "DaemonConnection", lambda *a, **k: new)
    with pytest.warns(SnapshotWarning, match=r"step\(s\) 1 did not commit and are retried "
                      r"on a new daemon \(pid 5151\)") as w:
        client.log(2)
    assert [r.filename for r in w] == [__file__]
    retry = submitted(client, new, 1)
    assert retry.plan == sub.plan                 # the same plan, over the same bytes
    assert bytes(client._handoff.arena.view(retry.slot, 0, len(staged)).numpy()) == staged
    assert not handle.done()                      # in flight again
    commit(client, new, 1)
    assert handle.wait().bytes_written == 100 and handle.retries == 1
    assert client.close() == CloseSummary(committed=(1,))


def test_a_lost_snapshot_whose_slot_was_reused_is_not_retried(client, monkeypatch):
    old = client._handoff.conn
    handoff = client._handoff
    handle = client.snapshot(1)
    sub = submitted(client, old, 1)
    lose(client, old)
    # A later snapshot took the slot before the loss was acted on: the bytes changed.
    handoff._reserve(old, used_bytes(sub.plan), SnapshotHandle(2))
    monkeypatch.setattr(handoff_mod, "DaemonConnection", lambda *a, **k: StandIn(pid=5151))
    with pytest.warns(SnapshotWarning, match=r"step\(s\) 1 did not commit \(their staged "
                      "bytes were no longer whole"):
        client.log(2)
    assert handle.failed and handle.retries == 0
    assert handoff.conn is None                   # the next snapshot() starts a daemon


def test_close_retries_a_newest_snapshot_lost_with_the_daemon(client, monkeypatch):
    old = client._handoff.conn
    handle = client.snapshot(1)
    submitted(client, old, 1)
    lose(client, old)
    new = StandIn(pid=5151)
    monkeypatch.setattr(handoff_mod, "DaemonConnection", lambda *a, **k: new)
    # The new daemon commits whatever is submitted to it.
    new.send_request = lambda m, on_reply: client._handoff._on_event(
        proto.Committed("r", 0, m.step, m.slot, SnapshotId(0, m.step).name, 7, 0.1)) \
        if isinstance(m, proto.Submit) else None
    with pytest.warns(SnapshotWarning, match="retried"):
        summary = client.close()
    assert summary == CloseSummary(committed=(1,)) and handle.result.bytes_written == 7
