"""The commit service, and the daemon's one event per accepted submit.

Failures are injected by substitution: a faulty writer or retention handed to the
service (or the daemon), a hot cache, an arena or a connection whose one method
raises. Each write after a commit must still free the slot and send exactly one
event, and the snapshot on disk must stay intact.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import shutil

import pytest
import torch
from click.testing import CliRunner

from snapd import protocol as p
from snapd.arena_map import HotCache, MappedArena as Arena
from snapd.cli import main as cli
from snapd.commit import CommitService
from snapd.daemon import Daemon
from snapd.errors import InsufficientSpace, SnapshotExists, SnapshotFailed
from snapd.format import MANIFEST_NAME, dtype_name
from snapd.options import Options
from snapd.plan import ObjectPlan, SnapshotPlan, TensorSource, from_descriptor
from snapd.reader import SnapshotReader
from snapd.retention import apply_retention
from snapd.server import Submission
from snapd.store import RunStore, SnapshotId
from snapd.writer import write_snapshot
from snapd_client import Client

from helpers import client_descriptor

SLOT = 4096
DATA = torch.arange(8, dtype=torch.float32)


# --- a daemon without its process ------------------------------------------------------

class Sink:
    """A connection that records the events it is asked to send."""

    finished = False   # the client has not said bye

    def __init__(self, fail_send: bool = False) -> None:
        self.events, self.fail_send = [], fail_send

    def send_event(self, message):
        self.events.append(message)
        if self.fail_send:
            raise OSError(errno.EPIPE, "injected: the event could not be queued")
        return True


class FaultyReleaseArena(Arena):
    def release(self, slot: int) -> None:
        super().release(slot)
        raise RuntimeError("injected: slot release failed")


class FaultyPublishCache(HotCache):
    def publish(self, *args, **kwargs):
        raise RuntimeError("injected: hot publish failed")


def plan(step: int, lineage: int = 0, metric=None, rank: int = 0,
         parent=None) -> SnapshotPlan:
    made = SnapshotPlan("r", step, {"id": lineage, "mode": "fresh", "parent": parent},
                        [ObjectPlan("model", "T", b"\x90",
                                    [TensorSource(".w", dtype_name(DATA.dtype), [8],
                                                  memoryview(bytes(32)))])],
                        rng={}, metric=metric, rank=rank, world_size=max(rank + 1, 1))
    return made


def submission(shm, step: int, sink: Sink, opts: Options = Options(),
               arena_cls=Arena) -> Submission:
    """A submit as the server hands it over: staged in slot 0 of a fresh arena,
    attached as hot (its committed slot is held)."""
    name = f"snapd-unit-{step}-{len(os.listdir(shm))}"
    with open(shm / name, "wb") as f:
        f.truncate(2 * SLOT)
    arena = arena_cls(name, 2 * SLOT, 2, shm_dir=str(shm))
    arena.hot = True
    arena.acquire(0)
    view = arena.slot_view(0)
    view[:32] = DATA.numpy().tobytes()
    desc = client_descriptor({"model": {"w": DATA}}, [0], step=step)
    return Submission(sink, arena, 0, view, from_descriptor(desc, view), desc, opts)


@pytest.fixture
def shm(tmp_path):
    d = tmp_path / "shm"
    d.mkdir()
    return d


def daemon(root, shm, **kwargs) -> Daemon:
    d = Daemon(root, Options(min_free_bytes=0), **kwargs)
    d.hot_cache = HotCache(shm_dir=str(shm))
    return d


def intact(root, step: int) -> None:
    reader = SnapshotReader(RunStore(root, "r").snapshot_path(SnapshotId(0, step)))
    reader.verify()
    assert torch.equal(reader.load_object("model")[0], DATA)


def failing_retention(store, opts, **kwargs):
    raise OSError(errno.EIO, "injected: retention failed", store.snapshots_path)


# --- a failure after the commit, at each step -------------------------------------------

def test_retention_failing_after_the_commit_still_commits(root, shm):
    d = daemon(root, shm, retain=failing_retention)
    sink = Sink()
    sub = submission(shm, 4, sink, Options(keep_last=1))
    d._write(sub)
    [event] = sink.events
    assert isinstance(event, p.Committed) and event.name == "00000004"
    assert sub.arena.busy == set()
    intact(root, 4)
    d.hot_cache.close()


def test_hot_publish_failing_after_the_commit_still_commits(root, shm):
    d = daemon(root, shm)
    d.hot_cache = FaultyPublishCache(shm_dir=str(shm))
    sink = Sink()
    sub = submission(shm, 4, sink)
    d._write(sub)
    [event] = sink.events
    assert isinstance(event, p.Committed) and sub.arena.busy == set()
    assert d.hot_cache.get("r", 0) is None          # no stale copy held
    sub.arena.acquire(0)                            # and the slot is not held
    sub.arena.release(0)
    intact(root, 4)
    # The slot is free for the next submit, which commits too.
    second = submission(shm, 5, sink)
    d._write(second)
    assert [type(e) for e in sink.events] == [p.Committed, p.Committed]
    intact(root, 5)


def test_slot_release_failing_still_sends_the_one_event(root, shm):
    d = daemon(root, shm)
    sink = Sink()
    sub = submission(shm, 4, sink, arena_cls=FaultyReleaseArena)
    d._write(sub)   # never raises: the failure is logged
    [event] = sink.events
    assert isinstance(event, p.Committed) and sub.arena.busy == set()
    intact(root, 4)
    d.hot_cache.close()


def test_event_send_failing_still_frees_the_slot_and_finishes_retention(root, shm):
    d = daemon(root, shm)
    opts = Options(keep_last=1)
    d._write(submission(shm, 3, Sink(), opts))
    broken = Sink(fail_send=True)
    first = submission(shm, 4, broken, opts)
    d._write(first)   # never raises: the failure is logged
    assert len(broken.events) == 1 and first.arena.busy == set()
    store = RunStore(root, "r")
    assert store.tmp_dirs() == []   # step 3's delete was finished too
    good = Sink()
    d._write(submission(shm, 5, good, opts))
    [event] = good.events
    assert isinstance(event, p.Committed) and event.name == "00000005"
    assert [s.name for s in store.committed()] == ["00000005"]
    intact(root, 5)
    d.hot_cache.close()


def test_a_failed_write_sends_failed_with_the_errors_path_and_field(root, shm):
    other = {"run": "r", "snapshot": "00000002", "step": 2}
    write_snapshot(RunStore(root, "r"), plan(4, parent=other), Options())  # another history
    d = daemon(root, shm)
    sink = Sink()
    sub = submission(shm, 4, sink)
    d._write(sub)
    [event] = sink.events
    assert isinstance(event, p.Failed) and event.kind == "SnapshotExists"
    assert event.field == "lineage" and event.path.endswith(MANIFEST_NAME)
    assert sub.arena.busy == set() and RunStore(root, "r").tmp_dirs() == []
    assert p.from_wire(p.to_wire(event)) == event    # the fields cross the socket
    d.hot_cache.close()


# --- the service itself: the in-process writer's path -----------------------------------

def test_enospc_part_way_is_insufficient_space_and_leaves_no_tmp_dir(root):
    other = RunStore(root, "r").new_tmp_dir(SnapshotId(0, 9))   # another writer's

    def fills_the_disk(store, plan, opts, progress=None):
        tmp = store.new_tmp_dir(plan.sid)
        with open(os.path.join(tmp, "model.tensors"), "wb") as f:
            f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device", tmp)

    service = CommitService(root, 0, writer=fills_the_disk, retain=apply_retention)
    with pytest.raises(InsufficientSpace, match="filled up") as failure:
        service.commit(RunStore(root, "r"), plan(4), Options())
    assert root in str(failure.value) and failure.value.path.startswith(root)
    assert RunStore(root, "r").tmp_dirs() == [other]   # only its own tmp dir removed


def test_in_process_snapshot_checks_free_space_first(root):
    client = Client(root, "r", daemon=False, min_free_bytes=1 << 62)
    client.track(model=torch.nn.Linear(4, 4))
    with pytest.raises(SnapshotFailed) as failure:
        client.snapshot(1).wait()
    assert isinstance(failure.value.__cause__, InsufficientSpace)
    assert failure.value.__cause__.field == "min_free_bytes"
    assert failure.value.__cause__.path == os.path.abspath(root)
    assert RunStore(root, "r").committed() == [] and RunStore(root, "r").tmp_dirs() == []
    client.close()   # the failure was raised by wait(): close() does not raise it again


def test_in_process_snapshot_refuses_another_history_as_snapshot_exists(root):
    other = {"run": "r", "snapshot": "00000000", "step": 0}
    write_snapshot(RunStore(root, "r"), plan(1, parent=other), Options())  # another history
    client = Client(root, "r", daemon=False, rank=0)
    client.track(model=torch.nn.Linear(4, 4))
    with pytest.raises(SnapshotFailed) as failure:
        client.snapshot(1).wait()
    cause = failure.value.__cause__
    assert isinstance(cause, SnapshotExists) and isinstance(cause, FileExistsError)
    assert cause.field == "lineage" and cause.path.endswith(MANIFEST_NAME)
    client.close()


# --- one rule set: the daemon after a commit and snapd gc -------------------------------

def committed(root):
    return [s.name for s in RunStore(root, "r").committed()]


def test_gc_and_the_daemon_keep_the_same_snapshots_and_never_latest(tmp_path, shm):
    base = tmp_path / "base"
    store = RunStore(str(base), "r")
    for step, metric in ((1, 0.1), (2, 0.5), (3, None), (4, 0.9), (5, 0.7)):
        write_snapshot(store, plan(step, metric=metric), Options())
    roots = []
    for name in ("by-daemon", "by-gc"):
        shutil.copytree(base, tmp_path / name)
        roots.append(str(tmp_path / name))
    opts = Options(keep_last=1, keep_best=1)
    # LATEST names step 3, behind step 5 (a crash left it there). The daemon commits
    # step 3 again (a resume from it): the existing snapshot is kept, LATEST stays.
    for r in roots:
        RunStore(r, "r").write_pointer("LATEST", SnapshotId(0, 3))
    d = daemon(roots[0], shm)
    sink = Sink()
    d._write(submission(shm, 3, sink, opts))
    assert isinstance(sink.events[0], p.Committed) and sink.events[0].name == "00000003"
    d.hot_cache.close()
    out = CliRunner().invoke(cli, ["gc", "--root", roots[1], "--keep-last", "1",
                                   "--keep-best", "1"])
    assert out.exit_code == 0, out.output
    assert "kept 00000003 because LATEST names it" in out.output
    assert committed(roots[0]) == committed(roots[1]) == ["00000001", "00000003",
                                                          "00000005"]
    for r in roots:
        assert RunStore(r, "r").read_pointer("LATEST") == SnapshotId(0, 3)
        assert RunStore(r, "r").read_pointer("BEST") == SnapshotId(0, 1)


# --- LATEST: one rule for every commit (docs/format.md, "Pointers") -----------------

def latest(root: str) -> SnapshotId:
    return RunStore(root, "r").read_pointer("LATEST")


def test_latest_only_moves_forward_in_lineage_then_step_order(root):
    store = RunStore(root, "r")
    for step in (2, 5):
        write_snapshot(store, plan(step), Options())
    write_snapshot(store, plan(2), Options())   # a resume below 5 saves step 2 again
    write_snapshot(store, plan(3), Options())   # and a new step below 5
    assert store.committed() == [SnapshotId(0, 2), SnapshotId(0, 3), SnapshotId(0, 5)]
    assert latest(root) == SnapshotId(0, 5)
    write_snapshot(store, plan(1, lineage=1), Options())   # a warm start forks
    assert latest(root) == SnapshotId(1, 1)


def test_latest_moves_back_from_a_snapshot_the_restore_refused_or_one_gone(root):
    store = RunStore(root, "r")
    for step in (2, 5):
        write_snapshot(store, plan(step), Options())
    # The trainer's restore refused step 5 as damaged and resumed from step 2.
    write_snapshot(store, dataclasses.replace(plan(3), supersedes=("00000005",)),
                   Options())
    assert latest(root) == SnapshotId(0, 3)
    store.write_pointer("LATEST", SnapshotId(0, 7))   # names no committed snapshot
    write_snapshot(store, plan(4), Options())
    assert latest(root) == SnapshotId(0, 4)


def test_the_daemon_committing_a_step_below_latest_leaves_latest_and_keeps_both(root,
                                                                                shm):
    store = RunStore(root, "r")
    for step in (1, 3, 5):
        write_snapshot(store, plan(step), Options())
    d = daemon(root, shm)
    sink = Sink()
    d._write(submission(shm, 3, sink, Options(keep_last=1)))   # a resume below 5
    d.hot_cache.close()
    assert isinstance(sink.events[0], p.Committed) and sink.events[0].name == "00000003"
    assert latest(root) == SnapshotId(0, 5)
    # Retention after the commit keeps the newest and the one just committed.
    assert store.committed() == [SnapshotId(0, 3), SnapshotId(0, 5)]
