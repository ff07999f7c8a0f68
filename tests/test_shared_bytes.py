"""Snapshots that refer to an earlier snapshot's bytes (format v4, snapd/sharing.py):
the writer refers instead of writing, the reader resolves and verifies, and what
cannot be resolved is refused, never guessed."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from snapd.errors import CorruptSnapshot
from snapd.options import Options
from snapd.plan import ObjectPlan, SnapshotPlan, TensorSource
from snapd.reader import SnapshotReader
from snapd.store import RunStore
from snapd.writer import write_snapshot
from snapd_client.capture import tensor_bytes
from snapd_client.state import flatten

from helpers import plan_for

OPTS = Options(chunk_bytes=4096)


def frozen_plan(state, step):
    """Content addressing covers the tensors the client marks frozen."""
    return plan_for(state, step=step, frozen=True)


def state(seed: int, changed: float = 0.0):
    g = torch.Generator().manual_seed(seed)
    return {"base": torch.randn(64, 64, generator=g),            # 4 chunks of 4096
            "head": torch.randn(8, 8, generator=g) + changed}


def read_back(path: str):
    reader = SnapshotReader(path)
    return {t["path"]: v for t, v in zip(reader.objects["model"]["tensors"],
                                         reader.load_object("model"))}, reader


def with_reuse(plan: SnapshotPlan, reuse: dict) -> SnapshotPlan:
    """``plan`` with the tensors named in ``reuse`` sent as unchanged since a snapshot
    (no bytes), as a client does for frozen tensors."""
    obj = plan.objects[0]
    tensors = [dataclasses.replace(t, data=memoryview(b""), reuse=reuse[t.path])
               if t.path in reuse else t for t in obj.tensors]
    return dataclasses.replace(plan, objects=[dataclasses.replace(obj, tensors=tensors)])


def test_equal_bytes_are_referred_to_not_written(tmp_path):
    store = RunStore(str(tmp_path), "r")
    first = write_snapshot(store, frozen_plan(state(0), step=1), OPTS)
    second = write_snapshot(store, frozen_plan(state(0, changed=1.0), step=2), OPTS)
    back, reader = read_back(second.path)
    assert torch.equal(back[".base"], state(0)["base"])
    assert torch.equal(back[".head"], state(0)["head"] + 1.0)
    manifest = reader.manifest
    assert manifest["shared"] == [{"snapshot": "00000001", "file": "model.tensors",
                                   "size": os.path.getsize(os.path.join(
                                       first.path, "model.tensors")), "format": 5}]
    base, head = manifest["objects"]["model"]["tensors"]
    assert base["src"] == 0 and "src" not in head
    # Only the head's bytes were written the second time: one chunk and the header.
    assert second.bytes_written == 2 * 4096
    assert os.path.getsize(os.path.join(second.path, "model.tensors")) == 2 * 4096


def test_identical_state_writes_no_file(tmp_path):
    store = RunStore(str(tmp_path), "r")
    write_snapshot(store, frozen_plan(state(0), step=1), OPTS)
    second = write_snapshot(store, frozen_plan(state(0), step=2), OPTS)
    assert second.bytes_written == 0
    assert os.listdir(second.path) == ["manifest.snapd"]
    back, reader = read_back(second.path)
    assert reader.objects["model"]["file"] is None
    assert torch.equal(back[".base"], state(0)["base"])
    reader.verify()


def test_a_reused_tensor_resolves_to_its_home_through_later_snapshots(tmp_path):
    store = RunStore(str(tmp_path), "r")
    write_snapshot(store, frozen_plan(state(0), step=1), OPTS)
    for step in (2, 3):   # each later snapshot sends the base as unchanged since 1
        plan = with_reuse(frozen_plan(state(0, changed=step), step=step),
                          {".base": "00000001"})
        done = write_snapshot(store, plan, OPTS)
        assert done.bytes_written == 2 * 4096
    back, reader = read_back(done.path)
    assert reader.manifest["shared"][0]["snapshot"] == "00000001"
    assert torch.equal(back[".base"], state(0)["base"])
    assert torch.equal(back[".head"], state(0)["head"] + 3)


def test_a_reuse_no_committed_snapshot_holds_fails_the_snapshot(tmp_path):
    store = RunStore(str(tmp_path), "r")
    write_snapshot(store, frozen_plan(state(0), step=1), OPTS)
    plan = with_reuse(frozen_plan(state(0), step=2), {".base": "00000007"})
    with pytest.raises(CorruptSnapshot) as e:
        write_snapshot(store, plan, OPTS)
    assert e.value.field == "reuse" and "00000007" in str(e.value)
    assert [s.name for s in store.committed()] == ["00000001"]


def test_damage_in_a_shared_file_is_refused_by_the_snapshot_that_reads_it(tmp_path):
    store = RunStore(str(tmp_path), "r")
    first = write_snapshot(store, frozen_plan(state(0), step=1), OPTS)
    second = write_snapshot(store, frozen_plan(state(0, changed=1.0), step=2), OPTS)
    path = os.path.join(first.path, "model.tensors")
    with open(path, "r+b") as f:   # a byte of the base's first chunk
        f.seek(4096 + 100)
        byte = f.read(1)
        f.seek(4096 + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CorruptSnapshot) as e:
        SnapshotReader(second.path).load_object("model")
    assert e.value.path == path and "chunk" in e.value.field


def test_a_missing_shared_file_names_both_places(tmp_path):
    store = RunStore(str(tmp_path), "r")
    first = write_snapshot(store, frozen_plan(state(0), step=1), OPTS)
    second = write_snapshot(store, frozen_plan(state(0, changed=1.0), step=2), OPTS)
    os.unlink(os.path.join(first.path, "model.tensors"))
    with pytest.raises(CorruptSnapshot) as e:
        SnapshotReader(second.path).load_object("model")
    assert "shared/00000001" in str(e.value) and "snapshots/00000001" in str(e.value)


def test_a_file_kept_in_shared_is_found_there(tmp_path):
    store = RunStore(str(tmp_path), "r")
    first = write_snapshot(store, frozen_plan(state(0), step=1), OPTS)
    second = write_snapshot(store, frozen_plan(state(0, changed=1.0), step=2), OPTS)
    kept = os.path.join(store.path, "shared", "00000001")
    os.makedirs(kept)
    os.rename(os.path.join(first.path, "model.tensors"), os.path.join(kept, "model.tensors"))
    back, _ = read_back(second.path)
    assert torch.equal(back[".base"], state(0)["base"])


def test_a_refused_snapshot_is_never_referred_to(tmp_path):
    store = RunStore(str(tmp_path), "r")
    write_snapshot(store, frozen_plan(state(0), step=1), OPTS)
    plan = dataclasses.replace(frozen_plan(state(0), step=2), supersedes=["00000001"])
    done = write_snapshot(store, plan, OPTS)
    assert SnapshotReader(done.path).manifest["shared"] == []


def test_tensors_that_train_are_written_without_identities(tmp_path):
    store = RunStore(str(tmp_path), "r")
    write_snapshot(store, plan_for(state(0), step=1), OPTS)
    done = write_snapshot(store, plan_for(state(0), step=2), OPTS)
    reader = SnapshotReader(done.path)
    assert reader.manifest["shared"] == []
    assert all(len(c) == 5 for t in reader.objects["model"]["tensors"] for c in t["chunks"])


def test_a_tensor_of_other_shape_with_the_same_bytes_is_written(tmp_path):
    store = RunStore(str(tmp_path), "r")
    write_snapshot(store, frozen_plan(state(0), step=1), OPTS)
    base = state(0)["base"].reshape(32, 128)
    flat = flatten({"base": base}, "model")
    plan = SnapshotPlan("r", 2, {"id": 0, "mode": "fresh", "parent": None},
                        [ObjectPlan("model", "x.Y", flat.skeleton,
                                    [TensorSource(".base", "float32", [32, 128],
                                                  tensor_bytes(base), frozen=True)])],
                        {"python": b"s"})
    done = write_snapshot(store, plan, OPTS)
    assert SnapshotReader(done.path).manifest["shared"] == []


def test_bytes_of_a_file_that_is_gone_are_written_not_referred_to(tmp_path):
    store = RunStore(str(tmp_path), "r")
    first = write_snapshot(store, frozen_plan(state(0), step=1), OPTS)
    os.unlink(os.path.join(first.path, "model.tensors"))   # the newest's file is gone
    done = write_snapshot(store, frozen_plan(state(0), step=2), OPTS)
    assert SnapshotReader(done.path).manifest["shared"] == []
    plan = with_reuse(frozen_plan(state(0), step=3), {".base": "00000002"})
    os.unlink(os.path.join(done.path, "model.tensors"))
    with pytest.raises(CorruptSnapshot) as e:
        write_snapshot(store, plan, OPTS)
    assert e.value.field == "reuse"


def test_share_unchanged_off_writes_every_byte(tmp_path):
    store = RunStore(str(tmp_path), "r")
    first = write_snapshot(store, frozen_plan(state(0), step=1), OPTS)
    done = write_snapshot(store, frozen_plan(state(0), step=2), Options(chunk_bytes=4096,
                                                                     share_unchanged=False))
    assert done.bytes_written == first.bytes_written
    assert SnapshotReader(done.path).manifest["shared"] == []
