"""A rank's part of a multi-rank snapshot, written in-process: DDP replicas written
once (refs elsewhere, never staged), DTensor pieces with their shard, the global
commit once every rank's part is in, the log's part/committed records, and close()'s
IncompleteSnapshot when a rank never delivers."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from snapd import globalcommit
from snapd.errors import IncompleteSnapshot
from snapd.format import part_dir_name
from snapd.statelog import read_records
from snapd.store import SnapshotId
from snapd_client import Client
from snapd_client.capture import Capture, capture_object, stepped_tensors
from snapd_client.handle import PartOf
from snapd_client.lostdaemon import committed_on_disk
from snapd_client.staging import Arena, Stager, layout


@pytest.fixture(scope="module")
def group():
    """A process group of one (gloo), for DDP and DTensor objects in this process."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def ddp_job(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
    return model, opt


def rank_client(root, rank, world=2, **kw):
    return Client(str(root), "job", rank=rank, world_size=world, daemon=False, **kw)


def part_manifest(root, rank, name="00000003"):
    manifest, _ = globalcommit.read_part(
        os.path.join(root, "job", "snapshots", name, part_dir_name(rank)))
    return manifest


def entries(manifest):
    return {(name, t["path"]): t for name, obj in manifest["objects"].items()
            for t in obj["tensors"]}


def test_ddp_state_is_written_once_and_commits_when_every_part_is_in(group, tmp_path):
    model, opt = ddp_job()
    clients = [rank_client(tmp_path, r) for r in (0, 1)]
    for c in clients:
        c.track(model=model, optimizer=opt)
    sid = SnapshotId(0, 3)
    clients[0].snapshot(3).wait()
    store = clients[0].store
    assert not os.path.exists(store.snapshot_path(sid))      # rank 1's part is missing
    assert committed_on_disk(store, sid, PartOf(0, "none", 2)).complete is False
    clients[1].snapshot(3).wait()
    assert os.path.isdir(store.snapshot_path(sid))           # the global commit
    assert committed_on_disk(store, sid, PartOf(0, "none", 2)).complete is True
    parts = [entries(part_manifest(tmp_path, r)) for r in (0, 1)]
    assert parts[0].keys() == parts[1].keys()
    for key in parts[0]:
        a, b = parts[0][key], parts[1][key]
        # Exactly one rank stores each replicated tensor; the other refers to it.
        assert ("ref" in a) != ("ref" in b), key
        stored, ref = (b, a) if "ref" in a else (a, b)
        assert ref["chunks"] == [] and ref["nbytes"] == stored["nbytes"]
    written = [sum(t["nbytes"] for t in p.values() if "ref" not in t) for p in parts]
    total = sum(t["nbytes"] for t in parts[0].values())
    assert sum(written) == total and min(written) > 0        # one copy, balanced
    summaries = [c.close() for c in clients]
    assert [s.committed for s in summaries] == [(3,), (3,)]
    events = [r["event"] for r in read_records(store.path, 0) if r["kind"] == "snapshot"]
    assert events[-2:] == ["part", "committed"]   # committed once the snapshot was


def test_the_writer_assignment_is_the_same_on_every_rank(group, tmp_path):
    model, opt = ddp_job()
    caps = []
    for r in (0, 1):
        c = rank_client(tmp_path, r)
        c.track(model=model, optimizer=opt)
        caps.append(c.capture(1))
        c.close()
    refs = [[ref for o in cap.objects for ref in o.refs] for cap in caps]
    assert all((a is None) != (b is None) for a, b in zip(*refs))
    assert {r for r in refs[0] if r is not None} == {1}
    assert {r for r in refs[1] if r is not None} == {0}


def test_a_leaf_another_rank_writes_takes_no_arena_bytes_and_is_not_copied(group, tmp_path):
    model, opt = ddp_job()
    c = rank_client(tmp_path, 1)
    c.track(model=model, optimizer=opt)
    cap = c.capture(1)
    c.close()
    stored_bytes = sum(t.numel() * t.element_size()
                       for t, s in zip(cap.tensors, cap.stored) if s)
    offsets, need = layout(cap.tensors, cap.stored)
    assert 0 < stored_bytes <= need < sum(t.numel() * t.element_size() for t in cap.tensors)
    assert all(o == 0 for o, s in zip(offsets, cap.stored) if not s)
    desc = cap.descriptor(offsets)
    refs = [t for o in desc["objects"] for t in o["tensors"] if "ref" in t]
    assert refs and all(t["offset"] == 0 for t in refs)
    plan = cap.plan_in_memory()
    assert all(len(t.data) == 0 for o in plan.objects for t in o.tensors if not t.stored)
    # A ref leaf at offset 0 is never copied over the stored leaf there.
    arena = Arena(1 << 20)
    try:
        first, other = torch.ones(8), torch.full((8,), 2.0)
        Stager("wait").stage(arena, 0, [first, other], [0, 0], [False, False],
                             lambda error: None, [True, False])
        assert torch.equal(arena.view(0, 0, 32).view(torch.float32), first)
    finally:
        arena.close()


def test_close_raises_incomplete_snapshot_naming_the_missing_rank(group, tmp_path):
    model, opt = ddp_job()
    c = rank_client(tmp_path, 0, world=3, global_commit_timeout=0.02)   # ranks 1, 2 never come
    c.track(model=model, optimizer=opt)
    c.snapshot(5).wait()
    with pytest.raises(IncompleteSnapshot) as info:
        c.close()
    e = info.value
    assert e.field == "parts"
    assert e.path == c.store.parts_path(SnapshotId(0, 5))
    assert "rank(s) 1, 2 of 3" in str(e)
    events = [r["event"] for r in read_records(c.store.path, 0) if r["kind"] == "snapshot"]
    assert "part" in events and "committed" not in events


def test_a_job_of_one_rank_is_unchanged(tmp_path):
    model = torch.nn.Linear(4, 2)
    c = Client(str(tmp_path), "solo", rank=0, world_size=1, daemon=False)
    c.track(model=model)
    cap = c.capture(1)
    assert cap.world_size == 1 and all(cap.stored)
    assert all(s is None for o in cap.objects for s in o.shards)
    c.snapshot(1).wait()
    assert c.close().committed == (1,)


def test_the_session_each_capture_takes_is_the_clients_current_one(tmp_path):
    c = rank_client(tmp_path, 0)
    c.track(model=torch.nn.Linear(2, 2))
    assert c.capture(1).session == "none"
    c.session = "0123456789abcdef"   # what restore() does after agreeing on one
    assert c.capture(2).session == "0123456789abcdef"
    c.close()


def test_dtensor_leaves_are_their_local_piece_with_a_shard(group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    model = torch.nn.Linear(6, 4)
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 6)).sum().backward()
    opt.step()
    defer = stepped_tensors({"optimizer": opt})
    cap = capture_object("model", model, defer)
    assert all(type(t) is torch.Tensor for t in cap.tensors)
    assert cap.shards == ({"global_shape": [4, 6], "offset": [0, 0]},
                          {"global_shape": [4], "offset": [0]})
    assert cap.deferrable == (True, True)     # overlap mode: local data pointers
    assert cap.refs == (None, None)
    state = capture_object("optimizer", opt)
    exp_avg = state.paths.index(".state.0.exp_avg")
    assert state.shards[exp_avg] == {"global_shape": [4, 6], "offset": [0, 0]}
    assert Capture(run="r", step=1, rank=0, lineage={"id": 0}, data_version=None,
                   metric=None, rng={}, cursor=None, objects=(cap,)).stored == (True, True)
