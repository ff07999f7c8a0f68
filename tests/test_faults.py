"""Damaged, truncated and hostile snapshots are refused, named, and never half-applied."""

from __future__ import annotations

import functools
import os
import shutil
import time

import pytest
import torch
import zstandard

from helpers import (flip_byte, outside_listing, read_manifest, trained_root,
                     write_manifest_raw)
from snapd import format as fmt
from snapd.errors import CorruptSnapshot, IncompatibleState, SnapshotFailed
from snapd.reader import SnapshotReader
from snapd.store import RunStore
from snapd_client import Client
from snapd_client.restore import FallbackWarning


def make_run(root, run="r", steps=(1, 2), data_version="v1", **options):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    client = Client(root, run, data_version=data_version, **options)
    client.track(model=model, optimizer=opt)
    for step in steps:
        model(torch.randn(8, 16)).sum().backward()
        opt.step()
        opt.zero_grad()
        client.snapshot(step).wait()
    client.close()
    return os.path.join(root, run, "snapshots")


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """make_run's runs that most tests here damage, steps 1 and 2 and step 1 alone: made
    once (training and committing them was most of each test's time)."""
    return {steps: trained_root(tmp_path_factory, f"faults-{len(steps)}",
                                functools.partial(make_run, steps=steps))
            for steps in ((1, 2), (1,))}


@pytest.fixture
def made(pristine, root):
    """made(steps) -> make_run(root, steps=steps)'s snapshots folder: a private copy of
    the pristine run, free to damage."""
    def copy(steps=(1, 2)):
        shutil.copytree(pristine[steps], root, dirs_exist_ok=True)
        return os.path.join(root, "r", "snapshots")
    return copy


def fresh(root, run="r", data_version="v1", width=32):
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.Linear(width, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    client = Client(root, run, data_version=data_version)
    client.track(model=model, optimizer=opt)
    return client, model


def weights(model):
    return [p.detach().clone() for p in model.parameters()]


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_restore_returns_latest_step_and_loads_it(root, made):
    snaps = made()
    client, model = fresh(root)
    assert client.restore() == 2
    saved = SnapshotReader(os.path.join(snaps, "00000002")).load_object("model")
    assert same(weights(model), saved)


def test_flipped_byte_in_tensor_chunk_falls_back_with_a_named_warning(root, made):
    snaps = made()
    flip_byte(os.path.join(snaps, "00000002", "model.tensors"), fmt.CHUNK_ALIGN + 100)
    client, _ = fresh(root)
    with pytest.warns(FallbackWarning, match=r"model\.tensors.*chunk 0"):
        assert client.restore() == 1
    assert os.path.isdir(os.path.join(snaps, "00000002")), "a bad snapshot is never deleted"
    assert "00000002" in client.restored.refused


def test_flipped_padding_byte_is_damage_too(root, made):
    """The zeros between chunks are in no chunk's digest; they must stay zero."""
    snaps = made()
    flip_byte(os.path.join(snaps, "00000002", "model.tensors"), fmt.HEADER_BYTES + 100)
    client, _ = fresh(root)
    with pytest.warns(FallbackWarning, match=r"model\.tensors: padding at bytes "
                                             r"32\.\.4096 is not zero"):
        assert client.restore() == 1


def test_only_snapshot_corrupt_raises_and_touches_nothing(root, made):
    snaps = made((1,))
    flip_byte(os.path.join(snaps, "00000001", "optimizer.tensors"), fmt.CHUNK_ALIGN + 3)
    client, model = fresh(root)
    before = weights(model)
    with pytest.warns(FallbackWarning):
        with pytest.raises(CorruptSnapshot, match=r"optimizer\.tensors") as info:
            client.restore()
    assert "no snapshot verifies" in str(info.value)
    assert same(weights(model), before), "the model was modified before verification"


def test_model_weights_read_without_reading_optimizer_state(root, made):
    snaps = made((1,))
    path = os.path.join(snaps, "00000001")
    flip_byte(os.path.join(path, "optimizer.tensors"), fmt.CHUNK_ALIGN + 3)
    reader = SnapshotReader(path)
    assert len(reader.load_object("model")) == 4
    with pytest.raises(CorruptSnapshot, match="checksum"):
        reader.load_object("optimizer")


@pytest.mark.parametrize("keep", [0, 10, fmt.HEADER_BYTES + 5])
def test_truncated_manifest_is_refused(root, made, keep):
    snaps = made((1,))
    manifest = os.path.join(snaps, "00000001", fmt.MANIFEST_NAME)
    with open(manifest, "r+b") as f:
        f.truncate(keep)
    with pytest.raises(CorruptSnapshot, match="manifest") as info:
        SnapshotReader(os.path.dirname(manifest))
    assert info.value.path == manifest


def test_missing_rng_field_is_refused_by_name(root, made):
    snaps = made()
    path = os.path.join(snaps, "00000002")
    manifest = read_manifest(path)
    del manifest["rng"]["numpy"]
    write_manifest_raw(path, manifest)
    client, _ = fresh(root)
    with pytest.warns(FallbackWarning, match=r"rng\.numpy"):
        assert client.restore() == 1


def test_changed_data_version_is_refused_by_name(root, made):
    made()
    client, model = fresh(root, data_version="v2")
    before = weights(model)
    with pytest.raises(IncompatibleState, match="data_version") as info:
        client.restore()
    assert info.value.field == "data_version"
    assert "warm_start" in str(info.value)
    assert same(weights(model), before)


def test_changed_shape_is_refused_naming_the_tensor(root, made):
    made()
    client, _ = fresh(root, width=33)
    with pytest.raises(IncompatibleState, match=r"objects\.model\.0\.weight"):
        client.restore()


def test_untracked_object_in_snapshot_is_refused(root, made):
    made()
    client = Client(root, "r", data_version="v1")
    client.track(model=torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)))
    with pytest.raises(IncompatibleState, match="'optimizer'"):
        client.restore()


def test_leftover_tmp_dir_never_shadows_the_last_good_snapshot(root, made):
    snaps = made()
    shutil.copytree(os.path.join(snaps, "00000002"), os.path.join(snaps, ".tmp-00000009-dead"))
    os.makedirs(os.path.join(snaps, ".tmp-00000010-beef"))
    with open(os.path.join(root, "r", "LATEST"), "w") as f:
        f.write(".tmp-00000009-dead\n")
    client, _ = fresh(root)
    assert client.restore() == 2


def test_latest_pointing_at_a_missing_snapshot_falls_back_to_newest(root):
    snaps = make_run(root, steps=(1, 2, 3))
    shutil.rmtree(os.path.join(snaps, "00000003"))
    client, _ = fresh(root)
    assert client.restore() == 2


@pytest.mark.parametrize("name", ["../x", "/etc/passwd", "a/../../x", "..", "sub/x"])
def test_manifest_naming_a_path_outside_is_refused(root, made, name):
    snaps = made((1,))
    path = os.path.join(snaps, "00000001")
    manifest = read_manifest(path)
    entry = manifest["files"].pop("model.tensors")
    manifest["files"][name] = entry
    manifest["objects"]["model"]["file"] = name
    write_manifest_raw(path, manifest)
    before = outside_listing(root)
    with pytest.raises(CorruptSnapshot, match="plain file name"):
        SnapshotReader(path)
    client, _ = fresh(root)
    with pytest.warns(FallbackWarning), pytest.raises(CorruptSnapshot):
        client.restore()
    assert outside_listing(root) == before


def test_symlinked_tensor_file_is_refused(root, made, tmp_path):
    snaps = made((1,))
    target = os.path.join(snaps, "00000001", "model.tensors")
    os.rename(target, str(tmp_path / "outside" / "model.tensors"))
    os.symlink(str(tmp_path / "outside" / "model.tensors"), target)
    with pytest.raises(CorruptSnapshot, match="not a regular file"):
        SnapshotReader(os.path.dirname(target))


def test_declared_size_far_above_the_file_is_refused_without_allocating(root, made):
    snaps = made((1,))
    path = os.path.join(snaps, "00000001")
    manifest = read_manifest(path)
    tensor = manifest["objects"]["model"]["tensors"][0]
    tensor["shape"] = [1 << 20, 1 << 20]
    tensor["nbytes"] = (1 << 40) * 4
    tensor["chunks"][0][1] = tensor["chunks"][0][2] = tensor["nbytes"]
    write_manifest_raw(path, manifest)
    t0 = time.perf_counter()
    with pytest.raises(CorruptSnapshot, match="points past the end"):
        SnapshotReader(path)
    # refused before any 4 TiB allocation (which would fail or swap); generous for load
    assert time.perf_counter() - t0 < 30


def test_file_size_differing_from_manifest_is_refused(root, made):
    snaps = made((1,))
    path = os.path.join(snaps, "00000001")
    manifest = read_manifest(path)
    manifest["files"]["model.tensors"]["size"] += 1 << 30
    write_manifest_raw(path, manifest)
    with pytest.raises(CorruptSnapshot, match=r"files\['model\.tensors'\]\.size"):
        SnapshotReader(path)


def test_zstd_frame_declaring_a_huge_size_is_refused(root):
    bomb = zstandard.ZstdCompressor().compress(b"\0" * (64 << 20))
    chunk = [fmt.HEADER_BYTES, len(bomb), 4096, fmt.CODEC_ZSTD, fmt.checksum(bomb)]
    with pytest.raises(CorruptSnapshot, match="decompress"):
        fmt.decode_chunk(bomb, chunk, path="p", field="f")


def test_warm_start_loads_weights_across_data_version_and_starts_a_lineage(root, made):
    snaps = made()
    client, model = fresh(root, data_version="v2")
    assert client.restore(mode="warm_start") == 0
    saved = SnapshotReader(os.path.join(snaps, "00000002")).load_object("model")
    assert same(weights(model), saved)
    assert client.lineage == {"id": 1, "mode": "warm_start",
                              "parent": {"run": "r", "snapshot": "00000002", "step": 2}}
    client.snapshot(1).wait()
    client.close()   # one writer per run and rank: the next client writes after it
    assert sorted(os.listdir(snaps)) == ["00000001", "00000001.L1", "00000002"]
    again, _ = fresh(root, data_version="v2")
    assert again.restore() == 1
    assert again.lineage["mode"] == "warm_start" and again.restored.sid.name == "00000001.L1"


def test_snapshot_of_a_committed_step_and_lineage_keeps_the_committed_one(root, made):
    snaps = made()
    before = os.stat(os.path.join(snaps, "00000002", fmt.MANIFEST_NAME))
    client, _ = fresh(root)
    assert client.restore() == 2
    result = client.snapshot(2).wait()   # the resumed run saves step 2 again
    client.close()
    assert result.path == os.path.join(snaps, "00000002")
    after = os.stat(os.path.join(snaps, "00000002", fmt.MANIFEST_NAME))
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert RunStore(root, "r").read_pointer("LATEST").name == "00000002"
    assert sorted(os.listdir(snaps)) == ["00000001", "00000002"]


def test_snapshot_of_a_step_another_rank_committed_fails_through_the_handle(root, made):
    made((1,))
    torch.manual_seed(1)
    model = torch.nn.Linear(4, 4)
    client = Client(root, "r", data_version="v1", rank=1)
    client.track(model=model)
    handle = client.snapshot(1)
    assert handle.done() and handle.failed
    with pytest.raises(SnapshotFailed, match="already exists with fields step, lineage, rank"):
        client.close()


def test_a_refused_snapshot_is_set_aside_not_deleted_when_its_step_is_saved_again(root, made):
    snaps = made()
    flip_byte(os.path.join(snaps, "00000002", "model.tensors"), fmt.CHUNK_ALIGN + 7)
    client, _ = fresh(root)
    with pytest.warns(FallbackWarning):
        assert client.restore() == 1
    client.snapshot(2).wait()  # the resumed run reaches step 2 again
    client.close()
    names = os.listdir(snaps)
    aside = [n for n in names if n.startswith(".damaged-00000002-")]
    assert len(aside) == 1 and "00000002" in names
    SnapshotReader(os.path.join(snaps, "00000002")).verify()
    with pytest.raises(CorruptSnapshot):  # the damaged one is kept as it was
        SnapshotReader(os.path.join(snaps, aside[0])).verify()


def test_in_process_writes_apply_retention_and_move_best(root):
    snaps = make_run(root, steps=(1, 2, 3), keep_last=2)
    assert sorted(os.listdir(snaps)) == ["00000002", "00000003"]
    client, _ = fresh(root)
    client.options = client.options.replace(keep_last=2, keep_best=1)
    client.restore()
    client.snapshot(4, metric=0.5).wait()
    client.snapshot(5, metric=0.9).wait()
    client.close()
    assert open(os.path.join(root, "r", "BEST")).read().strip() == "00000004"
    assert "00000004" in os.listdir(snaps)  # the best is kept past keep_last
