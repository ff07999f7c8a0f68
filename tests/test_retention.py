"""Retention: which snapshots a run keeps, ordered by manifest, never the last good one."""

from __future__ import annotations

import os
import time

import pytest
import torch

from snapd import format as fmt
from snapd.errors import AlreadyServing
from snapd.options import Options
from snapd.plan import ObjectPlan, SnapshotPlan, TensorSource
from snapd.reader import SnapshotReader
from snapd.retention import (DELETING_PREFIX, SnapshotInfo, apply_retention, collect_tmp,
                             gc, plan_retention, purge, scan)
from snapd.rootlock import RootLock
from snapd.runlock import RunLock
from snapd.store import RunStore, SnapshotId
from snapd.writer import write_snapshot


def info(step, metric=None, lineage=0):
    return SnapshotInfo(SnapshotId(lineage, step), lineage, step, metric)


def steps(infos):
    return [i.step for i in infos]


def make(store, step, metric=None, lineage=0):
    data = torch.full((16,), float(step))
    plan = SnapshotPlan(store.run, step, {"id": lineage, "mode": "fresh", "parent": None},
                        [ObjectPlan("w", "test.W", b"\x90",
                                    [TensorSource("x", "float32", [16],
                                                  memoryview(data.numpy()).cast("B"))])],
                        rng={}, metric=metric)
    return write_snapshot(store, plan, Options())


@pytest.fixture
def store(root):
    s = RunStore(root, "r")
    s.ensure()
    return s


# --- planning (pure) ----------------------------------------------------------------

def test_no_rule_keeps_everything():
    plan = plan_retention([info(s) for s in (3, 1, 2)])
    assert steps(plan.keep) == [1, 2, 3] and plan.delete == []


def test_keep_last():
    plan = plan_retention([info(s) for s in range(1, 6)], keep_last=2)
    assert steps(plan.keep) == [4, 5]
    assert steps(plan.delete) == [1, 2, 3]


def test_keep_every_with_keep_last():
    plan = plan_retention([info(s) for s in range(1, 8)], keep_last=1, keep_every=3)
    assert steps(plan.keep) == [3, 6, 7]


def test_keep_best_min_and_max():
    infos = [info(1, 0.5), info(2, 0.1), info(3, 0.9), info(4, 0.3), info(5)]
    assert steps(plan_retention(infos, keep_last=1, keep_best=2).keep) == [2, 4, 5]
    assert steps(plan_retention(infos, keep_last=1, keep_best=1,
                                best_mode="max").keep) == [3, 5]


def test_nan_metric_is_never_best():
    infos = [info(1, float("nan")), info(2, 5.0), info(3)]
    assert steps(plan_retention(infos, keep_last=0, keep_best=1).keep) == [2, 3]


@pytest.mark.parametrize("rules", [dict(keep_last=0), dict(keep_every=100),
                                   dict(keep_best=1)])
def test_never_deletes_newest(rules):
    infos = [info(1, 0.1), info(2, 0.2), info(3, 0.3)]
    plan = plan_retention(infos, **rules)
    assert 3 in steps(plan.keep)


def test_only_snapshot_is_kept():
    assert steps(plan_retention([info(7)], keep_last=0).keep) == [7]


def test_order_is_lineage_then_step():
    # A warm start (lineage 1) at step 5 is newer than lineage 0's step 30.
    infos = [info(30), info(5, lineage=1), info(20)]
    assert [i.sid.name for i in plan_retention(infos, keep_last=1).keep] == ["00000005.L1"]


# --- on disk ----------------------------------------------------------------------

def test_apply_deletes_and_leaves_no_trash(store):
    for s in range(1, 5):
        make(store, s)
    result = apply_retention(store, Options(keep_last=2))
    assert result.deleted == ["00000001", "00000002"]
    assert [s.step for s in store.committed()] == [3, 4]
    assert store.tmp_dirs() == []


def test_delete_renames_first(store):
    for s in range(1, 4):
        make(store, s)
    result = apply_retention(store, Options(keep_last=1), purge_now=False)
    # Already un-committed (a crash now leaves tmp dirs only), not yet removed.
    assert [s.step for s in store.committed()] == [3]
    assert len(result.trash) == 2
    assert all(os.path.basename(t).startswith(DELETING_PREFIX) for t in result.trash)
    purge(result.trash)
    assert store.tmp_dirs() == []


def test_order_from_manifest_not_mtime_or_name(store):
    for s in (1, 2, 3):
        make(store, s)
    # Make the oldest look newest by mtime and by name: only its manifest says step 1.
    os.rename(store.snapshot_path(SnapshotId(0, 1)), store.snapshot_path(SnapshotId(0, 9)))
    os.utime(store.snapshot_path(SnapshotId(0, 9)), (2e9, 2e9))
    os.utime(store.snapshot_path(SnapshotId(0, 3)), (1e9, 1e9))
    infos, _ = scan(store)
    assert sorted((i.sid.name, i.step) for i in infos) == [
        ("00000002", 2), ("00000003", 3), ("00000009", 1)]
    apply_retention(store, Options(keep_last=1))
    assert [s.name for s in store.committed()] == ["00000003"]


def test_unreadable_snapshot_is_never_deleted_nor_counted(store):
    for s in (1, 2, 3):
        make(store, s)
    manifest = os.path.join(store.snapshot_path(SnapshotId(0, 3)), fmt.MANIFEST_NAME)
    with open(manifest, "r+b") as f:
        f.truncate(10)
    result = apply_retention(store, Options(keep_last=1))
    assert result.refused == ["00000003"]
    # Step 3 is refused, so step 2 is the newest verified one and is kept.
    assert [s.step for s in store.committed()] == [2, 3]


def test_best_pointer(store):
    for s, metric in ((1, 0.5), (2, 0.2), (3, 0.9)):
        make(store, s, metric)
    apply_retention(store, Options(keep_best=1))
    assert store.read_pointer("BEST") == SnapshotId(0, 2)
    assert [s.step for s in store.committed()] == [2, 3]
    apply_retention(store, Options(keep_best=1, best_mode="max"))
    assert store.read_pointer("BEST") == SnapshotId(0, 3)
    assert [s.step for s in store.committed()] == [3]


def test_best_pointer_follows_survivors(store):
    make(store, 1, 0.1)
    make(store, 2, 0.7)
    apply_retention(store, Options(keep_best=1))
    assert store.read_pointer("BEST") == SnapshotId(0, 1)
    make(store, 3, None)
    apply_retention(store, Options(keep_last=1))   # deletes the best one
    assert [s.step for s in store.committed()] == [3]
    assert store.read_pointer("BEST") is None      # no survivor has a metric


def test_kept_snapshots_still_verify(store):
    for s in range(1, 5):
        make(store, s)
    apply_retention(store, Options(keep_every=2))
    for sid in store.committed():
        SnapshotReader(store.snapshot_path(sid)).verify()
    assert store.read_pointer("LATEST") == SnapshotId(0, 4)


def test_gc_over_runs(root):
    a, b = RunStore(root, "a"), RunStore(root, "b")
    for s in range(1, 4):
        make(a, s)
        make(b, s)
    dry = gc(root, Options(keep_last=1), dry_run=True)
    assert dry["a"].deleted == ["00000001", "00000002"] and dry["a"].bytes > 0
    assert len(a.committed()) == 3
    gc(root, Options(keep_last=1))
    assert [s.step for s in a.committed()] == [3] == [s.step for s in b.committed()]
    assert a.tmp_dirs() == [] == b.tmp_dirs()


# --- LATEST is never deleted, by any caller -------------------------------------------

def test_the_snapshot_latest_names_is_kept(store):
    for s in (1, 2, 3):
        make(store, s)
    store.write_pointer("LATEST", SnapshotId(0, 1))   # a crash left it behind step 3
    result = apply_retention(store, Options(keep_last=1))
    assert result.deleted == ["00000002"] and result.protected == ["00000001"]
    assert [s.step for s in store.committed()] == [1, 3]


def test_protect_in_the_pure_plan():
    plan = plan_retention([info(s) for s in (1, 2, 3)], keep_last=1,
                          protect=[SnapshotId(0, 2)])
    assert steps(plan.keep) == [2, 3] and steps(plan.protected) == [2]
    assert steps(plan.delete) == [1]


# --- collecting tmp dirs by hand ------------------------------------------------------

def tmp_dir(store, name, age):
    path = os.path.join(store.snapshots_path, name)
    os.mkdir(path)
    os.utime(path, (time.time() - age, time.time() - age))
    return path


def test_collect_tmp_removes_old_tmp_dirs_only(root):
    store = RunStore(root, "a")
    make(store, 1)
    old, young = tmp_dir(store, ".tmp-00000009-dead", 7200), tmp_dir(store, ".tmp-x-1", 5)
    done = collect_tmp(root, ["a"])
    assert done.removed == [old] and store.tmp_dirs() == [young] and done.busy == []


def test_collect_tmp_is_refused_while_a_daemon_holds_the_root(root):
    store = RunStore(root, "a")
    make(store, 1)
    old = tmp_dir(store, ".tmp-00000009-dead", 7200)
    with RootLock(root):   # what a serving daemon holds
        with pytest.raises(AlreadyServing) as refused:
            collect_tmp(root, ["a"])
    assert refused.value.path == os.path.join(root, ".snapd.lock")
    assert store.tmp_dirs() == [old]


def test_collect_tmp_skips_a_run_a_live_client_writes(root):
    a, b = RunStore(root, "a"), RunStore(root, "b")
    for store in (a, b):
        make(store, 1)
    kept, gone = tmp_dir(a, ".tmp-00000009-x", 7200), tmp_dir(b, ".tmp-00000009-y", 7200)
    lock = RunLock(a.path, "a", 0)   # an in-process writer of run a
    lock.acquire()
    try:
        done = collect_tmp(root, ["a", "b"])
    finally:
        lock.release()
    assert done.busy == ["a"] and done.removed == [gone]
    assert a.tmp_dirs() == [kept] and b.tmp_dirs() == []
