"""Why the daemon holds no hot copy of a run, as its ``hot_reply`` and its log say it:
the hot cache's record of each drop and refusal, the commit-time reasons for not
holding a slot (snapd/hotwhy.py), and ``Daemon.hot()`` (in process, no socket)."""

from __future__ import annotations

import logging
import os
import time
from types import SimpleNamespace

import pytest

from snapd.arena_map import HotCache, MappedArena
from snapd.daemon import Daemon
from snapd.hotwhy import not_held_because
from snapd.options import Options
from snapd.store import RunStore, SnapshotId

SLOT = 4096


@pytest.fixture
def shm(tmp_path):
    d = tmp_path / "shm"
    d.mkdir()
    return d


def arena(shm, name="snapd-unit-h", slots=2) -> MappedArena:
    with open(shm / name, "wb") as f:
        f.truncate(SLOT * slots)
    return MappedArena(name, SLOT * slots, slots, shm_dir=str(shm))


DESC = {"objects": [{"name": "model", "tensors": [
    {"path": ".w", "dtype": "float32", "shape": [8], "nbytes": 32, "offset": 0}]}]}


def held(cache: HotCache, shm, snapshot="00000004") -> HotCache:
    cache.publish("r", 0, arena(shm), 0, DESC, snapshot)
    return cache


# --- the hot cache remembers why ---------------------------------------------------

def test_a_cache_that_never_heard_of_a_run_gives_no_reason(shm):
    assert HotCache(shm_dir=str(shm)).why_not("r", 0) is None


def test_each_drop_keeps_its_reason_until_the_next_publish(shm):
    cache = held(HotCache(shm_dir=str(shm)), shm)
    assert cache.drop("r", 0, reason="its client closed cleanly")
    assert cache.why_not("r", 0) == \
        "the hot copy of 00000004 was released: its client closed cleanly"
    held(cache, shm, "00000005")
    assert cache.why_not("r", 0) is None
    cache.close()


def test_expiry_names_hot_linger_seconds(shm):
    cache = held(HotCache(shm_dir=str(shm)), shm)
    assert cache.expire([], linger=0.0) == [("r", 0)]
    assert cache.why_not("r", 0) == \
        "the hot copy of 00000004 was released: no client for 0 s (hot_linger_seconds)"


def test_the_memory_bound_names_hot_max_bytes(shm):
    cache = HotCache(shm_dir=str(shm), max_bytes=3 * SLOT)   # one 2-slot arena fits
    cache.publish("r", 0, arena(shm, "snapd-unit-a"), 0, DESC, "00000004")
    cache.publish("s", 0, arena(shm, "snapd-unit-b"), 0, DESC, "00000007")
    assert cache.get("r", 0) is None and cache.get("s", 0) is not None
    assert cache.why_not("r", 0) == ("the hot copy of 00000004 was released: all hot "
                                     f"copies together are kept within hot_max_bytes "
                                     f"({3 * SLOT} bytes)")
    cache.close()


def test_a_refused_commit_says_why_and_drops_the_older_copy(shm):
    cache = held(HotCache(shm_dir=str(shm)), shm)
    cache.refuse("r", 0, "00000005", "its client set hot_restore=False")
    assert cache.get("r", 0) is None
    assert cache.why_not("r", 0) == \
        "00000005 was not held in memory: its client set hot_restore=False"


# --- why a committed slot is not held ----------------------------------------------

def sub(hot_restore=True, hot=True, slots=2, finished=False, world_size=1, reuse=False,
        size=2 * SLOT):
    tensor = dict(DESC["objects"][0]["tensors"][0], **({"reuse": "00000002"} if reuse
                                                        else {}))
    return SimpleNamespace(options=Options(hot_restore=hot_restore),
                           arena=SimpleNamespace(hot=hot, slots=slots, size=size),
                           conn=SimpleNamespace(finished=finished),
                           desc={"world_size": world_size,
                                 "objects": [{"name": "model", "tensors": [tensor]}]})


@pytest.mark.parametrize("kwargs, reason", [
    ({}, None),
    ({"hot_restore": False}, "its client set hot_restore=False"),
    ({"world_size": 2}, "a multi-rank job restores from the files"),
    ({"hot": False, "slots": 1},
     "the run stages into one slot (no slot to spare for a hot copy)"),
    ({"hot": False}, "its arena could not be named for hot restore (see this log at its "
                     "attach)"),
    ({"finished": True}, "its client closed cleanly"),
    ({"reuse": True}, "it refers to bytes of earlier snapshots (share_unchanged), which "
                      "its slot lacks"),
    ({"size": 1 << 40}, "its arena of 1099511627776 bytes exceeds hot_max_bytes "
                        "(8192 bytes)"),
])
def test_why_a_committed_slot_is_not_held(shm, kwargs, reason):
    cache = HotCache(shm_dir=str(shm), max_bytes=2 * SLOT)
    assert not_held_because(sub(**kwargs), cache) == reason


# --- Daemon.hot(): the reply and the log ---------------------------------------------

@pytest.fixture
def daemon_log(caplog):
    caplog.set_level(logging.INFO, logger="snapd.daemon")
    return lambda: [r.getMessage() for r in caplog.records if "hot copy" in r.getMessage()]


def committed(root: str, step: int) -> None:
    """A committed snapshot as the directories and LATEST show it (no tensor)."""
    store = RunStore(root, "r")
    store.ensure()
    os.mkdir(store.snapshot_path(SnapshotId(0, step)))
    store.write_pointer("LATEST", SnapshotId(0, step))


def test_a_fresh_run_gets_a_reason_and_no_log_line(tmp_path, shm, daemon_log):
    daemon = Daemon(str(tmp_path), Options(min_free_bytes=0))
    daemon.hot_cache = HotCache(shm_dir=str(shm))
    reply = daemon.hot("r", 0)
    assert reply.shm is None and reply.reason.endswith(
        "has committed no snapshot of this run and rank")
    assert daemon_log() == []


def test_snapshots_an_earlier_daemon_wrote_are_named_once_in_the_log(tmp_path, shm,
                                                                       daemon_log):
    committed(str(tmp_path), 4)
    daemon = Daemon(str(tmp_path), Options(min_free_bytes=0))
    daemon.hot_cache = HotCache(shm_dir=str(shm))
    daemon.started = time.time() + 60   # started after the snapshot was written
    since = time.strftime("%H:%M:%S", time.localtime(daemon.started))
    why = (f"the daemon serving the root (pid {os.getpid()}, since {since}) has "
           "committed no snapshot of this run and rank; 00000004 was written before it "
           "started")
    assert daemon.hot("r", 0).reason == why
    assert daemon.hot("r", 0).reason == why   # the warm-up asks, then the restore
    assert daemon_log() == [f"run 'r' rank 0: no hot copy to restore from: {why}"]


def test_snapshots_another_writer_wrote_are_named(tmp_path, shm):
    daemon = Daemon(str(tmp_path), Options(min_free_bytes=0))
    daemon.hot_cache = HotCache(shm_dir=str(shm))
    committed(str(tmp_path), 4)
    assert daemon.hot("r", 0).reason.endswith(
        "; 00000004 was written by another writer (a client with daemon=False?)")


def test_a_released_copy_is_the_reply_and_the_log_line(tmp_path, shm, daemon_log):
    committed(str(tmp_path), 4)
    daemon = Daemon(str(tmp_path), Options(min_free_bytes=0))
    daemon.hot_cache = held(HotCache(shm_dir=str(shm)), shm)
    daemon.client_done("r", 0)
    why = "the hot copy of 00000004 was released: its client closed cleanly"
    assert daemon.hot("r", 0).reason == why
    assert daemon_log()[-1] == f"run 'r' rank 0: no hot copy to restore from: {why}"


def test_a_copy_older_than_latest_is_served_and_logged(tmp_path, shm, daemon_log):
    committed(str(tmp_path), 5)
    daemon = Daemon(str(tmp_path), Options(min_free_bytes=0))
    daemon.hot_cache = held(HotCache(shm_dir=str(shm)), shm)   # of 00000004
    reply = daemon.hot("r", 0)
    assert reply.snapshot == "00000004" and reply.reason is None
    assert daemon_log() == ["run 'r' rank 0: the hot copy is of 00000004, LATEST names "
                            "00000005: a restore of 00000005 reads the files"]
    daemon.hot_cache.close()
