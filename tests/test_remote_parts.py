"""Node-local roots: parts written by the real writer into separate roots, uploaded to
a file:// remote, committed globally there only when every rank's part of one session
is up (snapd/remote/parts.py), and the local marker the client's committed check
accepts."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from helpers import pull_on_rank_threads
from snapd import format as fmt
from snapd.globalcommit import DanglingReference
from snapd.globalsnap import GlobalSnapshot, open_snapshot
from snapd.options import Options
from snapd.plan import ObjectPlan, SnapshotPlan, TensorSource
from snapd.remote import layout, parts
from snapd.remote.layout import RemoteRoot
from snapd.statelog import read_records
from snapd.store import RunStore, SnapshotId
from snapd.writer import write_snapshot
from snapd_client import Client

LINEAGE = {"id": 0, "mode": "fresh", "parent": None}
WHOLE = torch.arange(32, dtype=torch.float32).reshape(8, 4)   # sharded on dim 0
SHARED = torch.arange(5, dtype=torch.int64) * 7                 # replicated, rank 0's
SID = SnapshotId(0, 10)
NAME = SID.name


def plan(rank: int, world: int = 2, session: str = "s",
         ref_path: str = ".shared") -> SnapshotPlan:
    """Rank ``rank``'s plan: its rows of WHOLE, and SHARED stored by rank 0."""
    rows = WHOLE.shape[0] // world
    local = WHOLE[rank * rows:(rank + 1) * rows].contiguous()
    tensors = [TensorSource(".w", "float32", list(local.shape),
                            memoryview(local.numpy()).cast("B"),
                            shard={"global_shape": list(WHOLE.shape),
                                   "offset": [rank * rows, 0]})]
    if rank == 0:
        tensors.append(TensorSource(".shared", "int64", [5],
                                    memoryview(SHARED.numpy()).cast("B")))
    else:
        tensors.append(TensorSource(ref_path, "int64", [5], memoryview(b""), ref=0))
    return SnapshotPlan("r", SID.step, LINEAGE,
                        [ObjectPlan("model", "T", b"\x80", tensors)],
                        rng={"torch": bytes([rank])}, rank=rank, world_size=world,
                        session=session, metric=0.5)


@pytest.fixture
def remote(tmp_path):
    return RemoteRoot(f"file://{tmp_path}/remote")


@pytest.fixture
def nodes(tmp_path):
    """Two node-local roots of one run."""
    return RunStore(str(tmp_path / "node-a"), "r"), RunStore(str(tmp_path / "node-b"), "r")


def write(store, rank, **kw):
    result = write_snapshot(store, plan(rank, **kw), Options())
    assert not result.complete   # a node-local root never holds every part
    return result


def test_the_snapshot_commits_remotely_when_every_part_is_up(remote, nodes):
    a, b = nodes
    write(a, 0)
    write(b, 1)
    assert parts.upload_part(remote, a, NAME, 0)["rank"] == 0
    assert not parts.try_remote_commit(remote, a, NAME)
    assert remote.commits("r") == []
    parts.upload_part(remote, b, NAME, 1)
    assert parts.try_remote_commit(remote, b, NAME)
    assert remote.commits("r") == [SID]
    assert parts.try_remote_commit(remote, a, NAME)   # the other node sees it committed
    record = remote.read_record("r", NAME)
    assert record["world_size"] == 2 and record["top"] == fmt.COMMIT_NAME
    listed = {rel for rel, _ in record["files"]}
    assert listed == set(remote.uploaded_files("r", NAME))
    assert {"rank-00000/manifest.snapd", "rank-00001/manifest.snapd"} <= listed
    assert a.committed() == [] and b.committed() == []   # nothing committed locally


def test_a_missing_part_commits_nothing(remote, nodes):
    a, b = nodes
    write(a, 0)
    write(b, 1)
    parts.upload_part(remote, a, NAME, 0)
    assert not parts.try_remote_commit(remote, a, NAME)
    assert not parts.try_remote_commit(remote, b, NAME)   # its part is local only
    assert remote.commits("r") == []
    assert fmt.COMMIT_NAME not in remote.uploaded_files("r", NAME)


def test_parts_of_two_sessions_are_never_joined(remote, nodes):
    a, b = nodes
    write(a, 0, session="old")
    write(b, 1, session="new")
    parts.upload_part(remote, a, NAME, 0)
    parts.upload_part(remote, b, NAME, 1)
    assert not parts.try_remote_commit(remote, a, NAME)
    assert not parts.try_remote_commit(remote, b, NAME)
    assert remote.commits("r") == []
    # The new attempt's rank 0 replaces the old part, and completes the set.
    write(a, 0, session="new")
    parts.upload_part(remote, a, NAME, 0)
    assert parts.try_remote_commit(remote, a, NAME)
    snap = pulled(remote, a.root + "-pulled")
    assert {p.manifest["session"] for p in snap.parts()} == {"new"}


def test_two_committers_write_the_same_bytes(remote, nodes):
    a, b = nodes
    committed_remotely(remote, nodes)
    first = (remote.fs.cat_file(remote.record_path("r", NAME)),
             remote.fs.cat_file(remote.file_path("r", NAME, fmt.COMMIT_NAME)))
    remote.fs.rm_file(remote.record_path("r", NAME))   # as if b looked before a wrote
    assert parts.try_remote_commit(remote, b, NAME)
    assert (remote.fs.cat_file(remote.record_path("r", NAME)),
            remote.fs.cat_file(remote.file_path("r", NAME, fmt.COMMIT_NAME))) == first


def test_the_committed_snapshot_reads_back_whole_once_copied_down(remote, nodes, tmp_path):
    a, b = nodes
    write(a, 0)
    write(b, 1)
    for store, rank in ((a, 0), (b, 1)):
        parts.upload_part(remote, store, NAME, rank)
    assert parts.try_remote_commit(remote, b, NAME)
    snap = pulled(remote, str(tmp_path / "fresh"))
    assert isinstance(snap, GlobalSnapshot) and snap.world_size == 2
    whole, shared = snap.load_object("model")
    assert torch.equal(whole, WHOLE) and torch.equal(shared, SHARED)
    snap.verify()


def test_a_reference_nobody_stores_is_never_committed(remote, nodes):
    a, b = nodes
    write(a, 0)
    write(b, 1, ref_path=".other")
    parts.upload_part(remote, a, NAME, 0)
    parts.upload_part(remote, b, NAME, 1)
    with pytest.raises(DanglingReference) as refused:
        parts.try_remote_commit(remote, b, NAME)
    assert refused.value.field == "objects.model.other.ref"
    assert remote.commits("r") == []


def test_a_part_whose_manifest_changed_after_it_was_announced_is_not_joined(remote, nodes):
    a, b = nodes
    write(a, 0)
    write(b, 1)
    parts.upload_part(remote, a, NAME, 0)
    parts.upload_part(remote, b, NAME, 1)
    manifest = remote.file_path("r", NAME, "rank-00001/manifest.snapd")
    data = bytearray(remote.fs.cat_file(manifest))
    data[-1] ^= 0xFF
    remote.fs.pipe_file(manifest, bytes(data))
    assert not parts.try_remote_commit(remote, a, NAME)
    # Its uploader's next attempt puts the manifest back, and the set commits.
    parts.upload_part(remote, b, NAME, 1)
    assert parts.try_remote_commit(remote, a, NAME)
    pulled(remote, a.root + "-pulled").verify()


def test_a_part_is_never_uploaded_over_a_remote_commit(remote, nodes):
    a, _ = nodes
    committed_remotely(remote, nodes)
    before = remote.uploaded_files("r", NAME)
    write(a, 0, session="later")   # a later attempt's part of the same step
    assert parts.upload_part(remote, a, NAME, 0) is None
    assert remote.uploaded_files("r", NAME) == before
    assert pulled(remote, str(nodes[0].root) + "-again").part(0).manifest["session"] == "s"


def test_the_daemons_marker_is_what_the_client_checks_and_never_a_snapshot(remote, nodes):
    a, _ = nodes
    older = SnapshotId(0, 5)
    write_snapshot(a, SnapshotPlan("r", 5, LINEAGE, plan(0).objects, rng={"torch": b"0"},
                                   rank=0, world_size=2, session="s"), Options())
    write(a, 0)
    assert not parts.remote_committed(a, SID)
    parts.note_remote_commit(a, NAME)
    assert parts.remote_committed(a, SID) and parts.markers(a) == [SID]
    assert a.committed() == [] and not os.path.isdir(parts.marker_path(a, NAME))
    # Older parts dirs can never complete on this root: removed.
    assert [sid for sid, _ in a.parts_dirs()] == [SID]
    assert not os.path.exists(a.parts_path(older))


def test_only_the_newest_markers_are_kept(nodes):
    a, _ = nodes
    for step in range(1, parts.KEEP_MARKERS + 4):
        parts.note_remote_commit(a, SnapshotId(0, step).name)
    kept = parts.markers(a)
    assert len(kept) == parts.KEEP_MARKERS and kept[-1].step == parts.KEEP_MARKERS + 3


def test_a_client_whose_part_was_committed_remotely_logs_it_committed(tmp_path):
    """close() on a node-local root: the part's snapshot never appears as a local
    directory; the daemon's marker is the global commit."""
    c = Client(str(tmp_path), "job", rank=0, world_size=2, daemon=False,
               global_commit_timeout=0.2)
    c.track(model=torch.nn.Linear(2, 2))
    c.snapshot(5).wait()
    parts.note_remote_commit(c.store, SnapshotId(0, 5).name)
    assert c.close().committed == (5,)
    events = [r["event"] for r in read_records(c.store.path, 0) if r["kind"] == "snapshot"]
    assert events[-2:] == ["part", "committed"]


def pulled(remote: RemoteRoot, root: str):
    """The remote snapshot's recorded files copied into a fresh local run, opened."""
    record = remote.read_record("r", NAME)
    dest = RunStore(root, "r").snapshot_path(SID)
    for f in layout.record_files(record):
        local = os.path.join(dest, f.relpath)
        os.makedirs(os.path.dirname(local), exist_ok=True)
        remote.fs.get_file(remote.file_path("r", NAME, f.relpath), local)
        assert os.path.getsize(local) == f.size
    return open_snapshot(dest)


# --- restore on node-local roots: the remote commit pulled onto each root first --------



def pull_on_ranks(roots, url):
    """fromremote.pull_from_remote on 4 rank threads, ranks 0-1 on roots[0], 2-3 on
    roots[1]; each rank's result (or error) and the FallbackWarnings."""
    return pull_on_rank_threads(
        [SimpleNamespace(options=Options(remote=url), run="r", rank=rank,
                         store=RunStore(roots[rank // 2], "r"), _keys=None)
         for rank in range(4)], join_s=30)


def committed_remotely(remote, nodes):
    a, b = nodes
    write(a, 0)
    write(b, 1)
    for store, rank in ((a, 0), (b, 1)):
        parts.upload_part(remote, store, NAME, rank)
    assert parts.try_remote_commit(remote, a, NAME)


def test_each_root_pulls_the_newest_remote_commit_before_the_agreement(remote, nodes,
                                                                       tmp_path):
    pytest.importorskip("snapd.remote.pull")
    committed_remotely(remote, nodes)
    roots = [str(tmp_path / "new-a"), str(tmp_path / "new-b")]
    out, warned = pull_on_ranks(roots, f"file://{tmp_path}/remote")
    assert out == [{NAME}] * 4 and not warned
    for root in roots:
        store = RunStore(root, "r")
        assert store.committed() == [SID] and store.read_pointer("LATEST") == SID
        GlobalSnapshot(store.snapshot_path(SID)).verify()


def test_a_root_with_a_newer_local_snapshot_pulls_nothing(remote, nodes, tmp_path):
    pytest.importorskip("snapd.remote.pull")
    committed_remotely(remote, nodes)
    roots = [str(tmp_path / "new-a"), str(tmp_path / "new-b")]
    newer = RunStore(roots[1], "r")
    newer.ensure()
    os.mkdir(newer.snapshot_path(SnapshotId(0, 20)))
    out, _ = pull_on_ranks(roots, f"file://{tmp_path}/remote")
    assert out == [{NAME}] * 4   # pulled on the first root only
    assert RunStore(roots[0], "r").committed() == [SID]
    assert newer.committed() == [SnapshotId(0, 20)]


def test_an_unreachable_remote_is_warned_of_and_nothing_is_pulled(tmp_path):
    roots = [str(tmp_path / "new-a"), str(tmp_path / "new-b")]
    # A URL of a protocol no fsspec implementation has: listing it fails.
    out, warned = pull_on_ranks(roots, "nosuchprotocol://bucket/prefix")
    assert out == [set()] * 4
    assert warned and "could not be listed" in warned[0]
    assert all(RunStore(r, "r").committed() == [] for r in roots)
