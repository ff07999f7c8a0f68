"""Hostile snapshot files, in this process: refused, named, fallen back from.

One real run (a model, AdamW and a data cursor; snapshots at steps 1 and 2;
tests/hostile_worker.py) is trained once per module; each case damages a copy: a
symlinked directory, a step that disagrees with its directory's name, an object
that refuses its state half way, a hot copy and a file both damaged, a descriptor
the reader would refuse. The cases judged in processes of their own (hostile
manifests, FIFOs) are tests/integration/test_hostile_processes.py.
"""

from __future__ import annotations

import os
import shutil

import msgpack
import pytest
import torch

from helpers import flip_byte, private_copy, read_manifest, trained_root, write_manifest_raw
from snapd.errors import CorruptSnapshot, IncompatibleState
from snapd.reader import SnapshotReader
from snapd_client import Client, FallbackWarning

from hostile_worker import RUN, build, snap, train


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return trained_root(tmp_path_factory, "hostile", train)


@pytest.fixture
def root(pristine, tmp_path):
    return private_copy(pristine, tmp_path)


@pytest.mark.parametrize("level", ["snapshot", "snapshots", "run"])
def test_symlinked_directories_are_refused(root, tmp_path, level):
    elsewhere = str(tmp_path / "outside" / "copy")
    target = {"snapshot": snap(root), "snapshots": os.path.dirname(snap(root)),
              "run": os.path.join(root, RUN)}[level]
    shutil.move(target, elsewhere)
    os.symlink(elsewhere, target)
    path = snap(root)
    with pytest.raises(CorruptSnapshot, match="symlink") as caught:
        SnapshotReader(path)
    assert caught.value.field == "directory"


def test_step_disagreeing_with_the_directory_name_is_refused_on_restore(root):
    os.rename(snap(root, "00000002"), snap(root, "00000003"))
    model, opt, loader = build(seed=7)
    client = Client(root, RUN, data_version="v1", daemon=False)
    client.track(model=model, optimizer=opt)
    client.batches(loader)
    with pytest.warns(UserWarning, match="directory is named 00000003"):
        assert client.restore() == 1


# --- all or nothing ---------------------------------------------------------------------

class Refuses:
    """A tracked object whose load_state_dict raises once when asked to (after the
    model and the optimizer were loaded: dict order); putting back then works."""

    def __init__(self) -> None:
        self.value, self.refuse = 1, False

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        if self.refuse:
            self.refuse = False
            raise RuntimeError("refused by the object")
        self.value = state["value"]


def test_apply_failing_half_way_puts_everything_back(root):
    model, opt, _ = build()
    extra = Refuses()
    client = Client(root, "apply", data_version="v1", daemon=False)
    client.track(model=model, optimizer=opt, extra=extra)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    client.snapshot(1).wait()
    client.close()

    model, opt, _ = build(seed=3)
    extra = Refuses()
    extra.refuse = True
    before = ([p.detach().clone() for p in model.parameters()], opt.state_dict()["state"])
    rng_before = torch.get_rng_state()
    again = Client(root, "apply", data_version="v1", daemon=False)
    again.track(model=model, optimizer=opt, extra=extra)
    with pytest.raises(IncompatibleState, match="untouched") as caught:
        again.restore()
    assert "refused by the object" in str(caught.value)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before[0]))
    assert opt.state_dict()["state"] == before[1] == {}
    assert torch.equal(torch.get_rng_state(), rng_before)


@pytest.mark.parametrize("older", ["absent", "incompatible"])
def test_hot_copy_and_file_both_damaged_leave_every_object_untouched(root, older):
    """The daemon's copy (a real /dev/shm segment laid out as the daemon lays it out)
    fails its checksum in the optimizer's region, and the optimizer file on disk is
    damaged too: the model, read in place from the hot copy, must be put back, whether
    restore then finds no older snapshot or an older one that does not fit."""
    from snapd_client.hotrestore import HotSource
    from snapd_client.restore import load_for_resume
    from snapd_client.rng import RngStreams
    from snapd.store import RunStore

    if older == "absent":
        shutil.rmtree(snap(root, "00000001"))
        stops = pytest.raises(CorruptSnapshot, match="untouched")
    else:
        manifest = read_manifest(snap(root, "00000001"))
        manifest["data_version"] = "other-data"
        write_manifest_raw(snap(root, "00000001"), manifest)
        stops = pytest.raises(IncompatibleState, match="data_version")
    reader = SnapshotReader(snap(root))
    segment = f"snapd-test-{os.getpid()}-hot"
    objects, blob = [], bytearray()
    for name in ("model", "optimizer"):
        tensors = []
        for entry, t in zip(reader.objects[name]["tensors"], reader.load_object(name)):
            tensors.append({"path": entry["path"], "dtype": entry["dtype"],
                            "shape": entry["shape"], "nbytes": entry["nbytes"],
                            "offset": len(blob)})
            blob += t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        objects.append({"name": name, "tensors": tensors})
    blob[objects[1]["tensors"][0]["offset"]] ^= 0xFF   # optimizer region, in memory
    with open(os.path.join("/dev/shm", segment), "wb") as f:
        f.write(blob)
    entry = reader.objects["optimizer"]["tensors"][0]
    flip_byte(os.path.join(snap(root), "optimizer.tensors"), entry["chunks"][0][0])  # on disk
    try:
        model, opt, _ = build(seed=7)
        model(torch.randn(4, 8)).sum().backward()
        opt.step()  # live optimizer state: the hot read lands in it in place
        before = {k: v.clone() for k, v in model.state_dict().items()}
        opt_before = {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}
        hot = HotSource(segment, "00000002", {"objects": objects})
        with stops, pytest.warns(FallbackWarning, match="00000002 refused"):
            load_for_resume(RunStore(root, RUN), {"model": model, "optimizer": opt},
                            RngStreams(), data_version="v1", need_cursor=False,
                            tensor_source=hot)
        hot.close()
        assert hot.hits == ["model"] and "optimizer" in hot.touched
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
        assert all(torch.equal(v, opt_before[k])
                   for k, v in opt.state_dict()["state"][0].items())
    finally:
        os.unlink(os.path.join("/dev/shm", segment))


# --- what the daemon accepts, and how it writes -----------------------------------------

@pytest.mark.parametrize("field,value", [
    ("shape", [-4]), ("shape", [4.0]), ("skeleton", msgpack.packb(3)),
    ("rng", [1]), ("lineage", {"id": -1}), ("step", -1)])
def test_submit_the_reader_would_refuse_is_refused_before_writing(field, value):
    from snapd.errors import SnapdError
    from snapd.plan import from_descriptor
    t = {"path": ".w", "dtype": "float32", "shape": [4], "device": "cpu", "offset": 0,
         "nbytes": 16}
    obj = {"name": "model", "type": "T", "skeleton": b"\x80", "metadata": None,
           "tensors": [t]}
    desc = {"run": "r", "step": 1, "lineage": {"id": 0}, "rng": {}, "objects": [obj]}
    target = t if field == "shape" else obj if field == "skeleton" else desc
    target[field] = value
    with pytest.raises(SnapdError, match="malformed"):
        from_descriptor(desc, memoryview(bytearray(64)))


def test_run_tree_and_snapshot_files_are_owner_only(pristine):
    base = os.path.join(pristine, RUN)
    for path in (base, os.path.dirname(snap(pristine)), snap(pristine)):
        assert os.stat(path).st_mode & 0o077 == 0, path
    for name in os.listdir(snap(pristine)):
        assert os.stat(os.path.join(snap(pristine), name)).st_mode & 0o077 == 0, name
    assert os.stat(os.path.join(base, "LATEST")).st_mode & 0o077 == 0
