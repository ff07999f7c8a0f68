"""The global commit of a multi-rank snapshot, in one process: each rank's part written
by the one commit path, committed only when every part of one session is there, and
read back whole (snapd/globalcommit.py, snapd/globalsnap.py)."""

from __future__ import annotations

import os

import pytest
import torch

from snapd import format as fmt
from snapd.commit import CommitService
from snapd.errors import CorruptSnapshot
from snapd.globalcommit import LOCK_NAME, DanglingReference, incomplete
from snapd.globalsnap import GlobalSnapshot, open_snapshot
from snapd.options import Options
from snapd.plan import ObjectPlan, SnapshotPlan, TensorSource
from snapd.reader import SnapshotReader
from snapd.retention import apply_retention
from snapd.store import RunStore, SnapshotId
from snapd.writer import write_snapshot
from snapd_client.distrestore import Parts

LINEAGE = {"id": 0, "mode": "fresh", "parent": None}
WHOLE = torch.arange(24, dtype=torch.float32).reshape(6, 4)   # sharded on dim 0
SHARED = torch.arange(5, dtype=torch.int64) * 7                 # replicated


def part(rank: int, world: int = 2, step: int = 10, session: str = "s",
         shared_by: int = 0, ref_path: str = ".shared") -> SnapshotPlan:
    """Rank ``rank``'s plan: its rows of WHOLE, and SHARED stored by ``shared_by``."""
    rows = WHOLE.shape[0] // world
    local = WHOLE[rank * rows:(rank + 1) * rows].contiguous()
    tensors = [TensorSource(".w", "float32", list(local.shape),
                            memoryview(local.numpy()).cast("B"),
                            shard={"global_shape": list(WHOLE.shape),
                                   "offset": [rank * rows, 0]})]
    if rank == shared_by:
        tensors.append(TensorSource(".shared", "int64", [5],
                                    memoryview(SHARED.numpy()).cast("B")))
    else:
        tensors.append(TensorSource(ref_path, "int64", [5], memoryview(b""),
                                    ref=shared_by))
    return SnapshotPlan("r", step, LINEAGE, [ObjectPlan("model", "T", b"\x80", tensors)],
                        rng={"torch": bytes([rank])}, rank=rank, world_size=world,
                        session=session, metric=0.5)


@pytest.fixture
def store(tmp_path):
    return RunStore(str(tmp_path), "r")


def test_a_snapshot_commits_only_when_every_part_is_in(store):
    first = write_snapshot(store, part(1), Options())
    assert not first.complete and store.committed() == []
    assert store.read_pointer("LATEST") is None
    [waiting] = incomplete(store)
    assert (waiting["ranks"], waiting["missing"]) == ([1], [0])
    last = write_snapshot(store, part(0), Options())
    assert last.complete and store.committed() == [SnapshotId(0, 10)]
    assert store.read_pointer("LATEST") == SnapshotId(0, 10)
    assert store.parts_dirs() == [] and incomplete(store) == []
    path = store.snapshot_path(SnapshotId(0, 10))
    assert sorted(os.listdir(path)) == [fmt.COMMIT_NAME, "rank-00000", "rank-00001"]


def test_the_whole_snapshot_reads_back_shards_assembled_and_refs_resolved(store):
    for rank in (0, 1):
        write_snapshot(store, part(rank), Options())
    snap = open_snapshot(store.snapshot_path(SnapshotId(0, 10)))
    assert isinstance(snap, GlobalSnapshot) and snap.world_size == 2
    whole, shared = snap.load_object("model")
    assert torch.equal(whole, WHOLE) and torch.equal(shared, SHARED)
    parts, entries = Parts(snap.path), snap.part(1).objects["model"]["tensors"]
    local, shared1 = (parts.tensor(1, "model", t) for t in entries)   # rank 1's view
    assert torch.equal(local, WHOLE[3:]) and torch.equal(shared1, SHARED)
    assert snap.objects["model"]["tensors"][0]["shape"] == [6, 4]
    assert snap.manifest["metric"] == 0.5
    snap.verify()


def test_parts_of_two_sessions_are_never_joined(store):
    write_snapshot(store, part(0, session="old"), Options())
    assert not write_snapshot(store, part(1, session="new"), Options()).complete
    assert store.committed() == []
    # The new attempt's rank 0 replaces the old part, and completes the set.
    assert write_snapshot(store, part(0, session="new"), Options()).complete
    snap = GlobalSnapshot(store.snapshot_path(SnapshotId(0, 10)))
    assert {p.manifest["session"] for p in snap.parts()} == {"new"}


def test_stray_parts_of_a_larger_world_do_not_ride_into_the_commit(store):
    write_snapshot(store, part(2, world=3, session="old"), Options())
    for rank in (0, 1):
        write_snapshot(store, part(rank, world=2, session="new"), Options())
    path = store.snapshot_path(SnapshotId(0, 10))
    assert sorted(os.listdir(path)) == [fmt.COMMIT_NAME, "rank-00000", "rank-00001"]


def test_a_reference_to_a_tensor_nobody_stores_is_never_committed(store):
    write_snapshot(store, part(0), Options())
    with pytest.raises(DanglingReference) as refused:
        write_snapshot(store, part(1, ref_path=".other"), Options())
    assert refused.value.field == "objects.model.other.ref"
    assert store.committed() == [] and len(store.parts_dirs()) == 1


def test_a_damaged_part_manifest_is_refused_naming_the_rank(store):
    for rank in (0, 1):
        write_snapshot(store, part(rank), Options())
    path = store.snapshot_path(SnapshotId(0, 10))
    manifest = os.path.join(path, "rank-00001", fmt.MANIFEST_NAME)
    data = bytearray(open(manifest, "rb").read())
    data[-1] ^= 0xFF
    open(manifest, "wb").write(bytes(data))
    snap = GlobalSnapshot(path)
    snap.part(0)
    with pytest.raises(CorruptSnapshot) as refused:
        snap.part(1)
    assert (refused.value.path, refused.value.field) == (manifest, "parts[1]")
    assert "rank 1's part is damaged" in str(refused.value)


def test_a_damaged_tensor_file_fails_verify(store):
    for rank in (0, 1):
        write_snapshot(store, part(rank), Options())
    path = store.snapshot_path(SnapshotId(0, 10))
    tensors = os.path.join(path, "rank-00000", "model.tensors")
    data = bytearray(open(tensors, "rb").read())
    data[4096] ^= 0x01
    open(tensors, "wb").write(bytes(data))
    with pytest.raises(CorruptSnapshot) as refused:
        GlobalSnapshot(path).verify()
    assert refused.value.path == tensors


def test_retention_after_a_global_commit_removes_older_incomplete_parts(store):
    commits = CommitService(store.root, 0, writer=write_snapshot, retain=apply_retention)
    commits.commit(store, part(0, step=5), Options()).purge()   # rank 1 never sends 5
    commits.commit(store, part(0, step=10), Options()).purge()
    assert [sid.step for sid, _ in store.parts_dirs()] == [5, 10]   # no commit yet
    done = commits.commit(store, part(1, step=10), Options())
    assert done.result.complete and done.result.sid == SnapshotId(0, 10)
    done.purge()
    assert store.parts_dirs() == [] and store.committed() == [SnapshotId(0, 10)]
    assert not [n for n in os.listdir(store.snapshots_path) if n.startswith(".")]
    assert os.path.exists(os.path.join(store.path, LOCK_NAME))   # the run's, kept


def test_a_part_for_a_committed_snapshot_keeps_it(store):
    for rank in (0, 1):
        write_snapshot(store, part(rank), Options())
    again = write_snapshot(store, part(1, session="later"), Options())
    assert again.complete and store.parts_dirs() == []
    assert GlobalSnapshot(again.path).record["session"] == "s"


def test_a_global_commit_below_latest_leaves_latest(store):
    for step in (10, 5):   # step 5 completes after 10 (a resume below it)
        for rank in (0, 1):
            write_snapshot(store, part(rank, step=step), Options())
    assert store.committed() == [SnapshotId(0, 5), SnapshotId(0, 10)]
    assert store.read_pointer("LATEST") == SnapshotId(0, 10)


def test_a_global_commit_below_latest_keeps_the_parts_after_it(store):
    commits = CommitService(store.root, 0, writer=write_snapshot, retain=apply_retention)
    for rank in (0, 1):
        commits.commit(store, part(rank, step=10), Options()).purge()
    # A resume below 10: rank 0 is ahead at step 7 while rank 1 completes step 5.
    commits.commit(store, part(0, step=5), Options()).purge()
    commits.commit(store, part(0, step=7), Options()).purge()
    commits.commit(store, part(1, step=5), Options()).purge()
    assert [sid.step for sid, _ in store.parts_dirs()] == [7]   # not stale: 5 is done
    assert commits.commit(store, part(1, step=7), Options()).result.complete
    assert store.committed() == [SnapshotId(0, 5), SnapshotId(0, 7), SnapshotId(0, 10)]
    assert store.read_pointer("LATEST") == SnapshotId(0, 10)


def test_one_part_is_a_snapshot_directory_of_its_own(store):
    write_snapshot(store, part(0), Options())
    [(sid, parts_dir)] = store.parts_dirs()
    reader = SnapshotReader(os.path.join(parts_dir, "rank-00000"))
    assert reader.manifest["format"] == 5 and reader.manifest["session"] == "s"
    assert reader.load_object("model")[1] is not None


def test_a_part_whose_set_another_writer_commits_before_its_fsync_commits_too(
        store, monkeypatch):
    """The last part's rename lands; before its writer fsyncs the parts dir, the other
    rank's writer (polling, or its own part just written) finds the set complete and
    commits it, renaming the parts dir away. The last writer's fsync then finds no
    parts dir: its part is committed and durable (the commit fsynced the dir after
    it saw it), so its write reports the commit, not a failure."""
    from snapd import fsio, globalcommit
    write_snapshot(store, part(0), Options())
    parts_dir = store.parts_path(SnapshotId(0, 10))
    real, raced = fsio.fsync_dir, []

    def other_writer_commits_first(path: str) -> None:
        if path == parts_dir and not raced:
            raced.append(True)
            p = part(0)   # the other writer's, as write_part builds it
            want = {"run": p.run, "step": p.step, "lineage": p.lineage,
                    "world_size": p.world_size, "session": p.session,
                    "data_version": p.data_version}
            assert globalcommit.try_commit(store, SnapshotId(0, 10), want)
        real(path)

    monkeypatch.setattr(fsio, "fsync_dir", other_writer_commits_first)
    result = write_snapshot(store, part(1), Options())
    assert raced and result.complete
    assert [sid.step for sid in store.committed()] == [10]
    assert store.parts_dirs() == []
    assert isinstance(open_snapshot(store.snapshot_path(SnapshotId(0, 10))), GlobalSnapshot)


def test_two_parts_landing_together_commit_once_and_neither_fails(store):
    """Both ranks' parts of each step written at the same moment, by two threads as
    the daemon's writers do: the one that completes the set commits it, the other
    finds it committed; neither fails on the other's rename. (With the lock file
    inside the parts dir, unlinked before the rename, a writer failed on the
    vanished directory in 3 of 5 runs here.)"""
    import threading
    steps = range(1, 21)
    start = threading.Barrier(2, timeout=30)
    done, failed = {0: [], 1: []}, []

    def rank(r: int) -> None:
        try:
            for step in steps:
                start.wait()
                done[r].append(write_snapshot(store, part(r, step=step), Options()))
        except BaseException as e:   # the other writer must not wait for this one
            failed.append(e)
            start.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failed == []
    assert [len(done[r]) for r in (0, 1)] == [len(steps)] * 2
    assert [sid.step for sid in store.committed()] == list(steps)
    assert store.parts_dirs() == []
    for sid in store.committed():
        assert sorted(os.listdir(store.snapshot_path(sid))) == \
            [fmt.COMMIT_NAME, "rank-00000", "rank-00001"]
        assert isinstance(open_snapshot(store.snapshot_path(sid)), GlobalSnapshot)
