"""The handle of a snapshot() call that took none: made for nearly every call under
``every``, so it shares its event and lock with every other, and must still behave as
a handle of its own (snapd_client/handle.py)."""

from __future__ import annotations

import pytest

from snapd_client.handle import SnapshotHandle


def test_a_not_taken_handle_is_done_at_once_with_nothing_to_wait_for():
    handle = SnapshotHandle.not_taken(7)
    assert handle.step == 7 and not handle.taken and handle.done()
    assert handle.wait(timeout=0) is None   # returns at once, nothing raised
    assert handle.result is None and not handle.failed and not handle.skipped
    assert handle.error is None and handle.stall_seconds == 0.0
    assert repr(handle) == "<SnapshotHandle step=7 not taken>"


def test_each_not_taken_handle_runs_its_own_callbacks_only():
    first, second = SnapshotHandle.not_taken(1), SnapshotHandle.not_taken(2)
    seen = []
    first.add_done_callback(lambda h: seen.append(("first", h.step)))
    second.add_done_callback(lambda h: seen.append(("second", h.step)))
    first.add_done_callback(lambda h: seen.append(("first again", h.step)))
    assert seen == [("first", 1), ("second", 2), ("first again", 1)]
    assert first._callbacks is not second._callbacks


def test_a_not_taken_handle_cannot_be_reopened_so_the_shared_event_stays_set():
    handle = SnapshotHandle.not_taken(3)
    with pytest.raises(RuntimeError, match="no snapshot was taken"):
        handle.reopen(None)
    assert SnapshotHandle.not_taken(4).done()


def test_a_not_taken_handle_has_every_attribute_an_ordinary_one_has():
    ordinary = SnapshotHandle(5)
    assert set(vars(SnapshotHandle.not_taken(5))) == set(vars(ordinary))
