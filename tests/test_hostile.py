"""Hostile snapshot files: refused, named, fallen back from; never a crash or a hang.

One real run (a model, AdamW and a data cursor; snapshots at steps 1 and 2) is
trained once per module. Each case copies it and makes step 2 hostile: a manifest
re-signed with a valid checksum around hostile content, a FIFO, a link. Then, in
one subprocess per case (a SIGSEGV or a hang fails the case, not the suite), a new
trainer restores and the operator commands run; everything is reported as JSON.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import msgpack
import pytest
import torch

from helpers import flip_byte, private_copy, read_manifest, trained_root, write_manifest_raw
from snapd import format as fmt
from snapd.errors import CorruptSnapshot, IncompatibleState
from snapd.reader import SnapshotReader
from snapd_client import Client, FallbackWarning

from hostile_worker import RUN, build

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "hostile_worker.py")
TIMEOUT = 120


def train(root: str) -> None:
    model, opt, loader = build()
    client = Client(root, RUN, data_version="v1", daemon=False)
    client.track(model=model, optimizer=opt)
    batches = client.batches(loader)
    for step in (1, 2):
        x = next(batches).float().reshape(-1, 1).expand(-1, 8)
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
        client.snapshot(step).wait()
    client.close()


def run_workers(jobs: list, workers: int = 2) -> dict:
    """Each (root, "all"|"cli"|"restore") in a worker subprocess, ``workers`` at once;
    a job whose worker died or hung before reporting it gets ``{"died": why}``."""
    shares = [jobs[i::workers] for i in range(workers)]
    env = {**os.environ, "SNAPD_DAEMON": "0"}
    procs = [subprocess.Popen([sys.executable, WORKER] + [f"{r}:{w}" for r, w in share],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env) for share in shares if share]
    results = {}
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=TIMEOUT)
            why = f"worker exited with {proc.returncode}: {err[-1500:]}"
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            why = "hung (killed after the timeout)"
        for line in out.splitlines():
            if line.startswith("{"):
                record = json.loads(line)
                results[record["root"]] = record
        for root, _what in jobs:
            results.setdefault(root, {"died": why})
    return results


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return trained_root(tmp_path_factory, "hostile", train)


@pytest.fixture
def root(pristine, tmp_path):
    return private_copy(pristine, tmp_path)


def snap(root: str, name: str = "00000002") -> str:
    return os.path.join(root, RUN, "snapshots", name)


# --- hostile manifests: valid checksum, hostile content ------------------------------

def nested_tuples(depth: int) -> bytes:
    value = 1
    for _ in range(depth):
        value = msgpack.ExtType(2, msgpack.packb([value]))
    return msgpack.packb({"state": value})


def set_tensor_field(m, key, value):
    m["objects"]["model"]["tensors"][0][key] = value


def huge_zstd_chunk(m):
    """A fresh optimizer has no shape to check against: declare 4 TiB in one chunk."""
    t = m["objects"]["optimizer"]["tensors"][0]
    t["shape"], t["nbytes"] = [1 << 40], 4 << 40
    t["chunks"] = [[t["chunks"][0][0], t["chunks"][0][1], 4 << 40, "zstd",
                    t["chunks"][0][4]]] + [[c[0], c[1], 0, "zstd", c[4]]
                                           for c in t["chunks"][1:]]


HOSTILE = {
    "skeleton_200_deep": lambda m: m["objects"]["model"].update(skeleton=nested_tuples(200)),
    "skeleton_100_deep": lambda m: m["objects"]["optimizer"].update(
        skeleton=nested_tuples(100)),
    "dtype_list": lambda m: set_tensor_field(m, "dtype", ["float32"]),
    "path_list": lambda m: set_tensor_field(m, "path", [".0.weight"]),
    "file_list": lambda m: m["objects"]["model"].update(file=["model.tensors"]),
    "lineage_int": lambda m: m.update(lineage=7),
    "rng_short": lambda m: m["rng"].update(python=m["rng"]["python"][:-8]),
    "rng_not_map": lambda m: m.update(rng=[1, 2]),
    "cursor_garbage": lambda m: m.update(cursor={"epoch": "x", "index": -1}),
    "zstd_4tib": huge_zstd_chunk,
    "created_extension": lambda m: m.update(created=msgpack.Timestamp(0, 5)),
    "step_not_name": lambda m: m.update(step=1),
    "shape_negative": lambda m: set_tensor_field(m, "shape", [-16, -8]),
    "skeleton_int": lambda m: m["objects"]["model"].update(skeleton=msgpack.packb(5)),
}


@pytest.fixture(scope="module")
def hostile_results(pristine, tmp_path_factory):
    """Every case: its own copy of the run, step 2 made hostile and re-signed."""
    roots = {}
    for case, damage in HOSTILE.items():
        root = str(tmp_path_factory.mktemp(case) / "root")
        shutil.copytree(pristine, root)
        m = read_manifest(snap(root))
        damage(m)
        write_manifest_raw(snap(root), m)  # re-signed: the checksum holds
        roots[case] = root
    results = run_workers([(root, "all") for root in roots.values()])
    return {case: results[root] for case, root in roots.items()}


@pytest.mark.integration
@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_manifest_is_refused_by_restore_and_falls_back(hostile_results, case):
    out = hostile_results[case]
    assert "died" not in out, out.get("died")
    restored = out["restore"]
    assert restored.get("step") == 1, restored
    assert restored["model_is_good"]
    assert any("00000002" in w and "refused" in w for w in restored["warnings"]), restored


# What only a training process can judge (its streams' state lengths, its cursor) is
# refused at restore; the commands check the snapshot's own structure.
PROCESS_CHECKED = ("rng_short", "cursor_garbage")


@pytest.mark.integration
@pytest.mark.parametrize("case", sorted(set(HOSTILE) - set(PROCESS_CHECKED)))
def test_hostile_manifest_gives_every_command_an_error_not_a_traceback(hostile_results,
                                                                      case):
    out = hostile_results[case]
    assert "died" not in out, out.get("died")
    for command, result in out["cli"].items():
        assert result["exception"] is None, (command, result)
        if case == "step_not_name" and command in ("ls", "inspect", "diff", "export"):
            continue  # a renamed snapshot is still readable on its own
        assert result["code"] == 1, (command, result)
        assert "00000002" in result["output"], (command, result)


# --- files that are not what their names say ------------------------------------------

def plant_fifo(directory: str) -> None:
    os.unlink(os.path.join(directory, fmt.MANIFEST_NAME))
    os.mkfifo(os.path.join(directory, fmt.MANIFEST_NAME))


@pytest.mark.integration
def test_fifo_manifest_hangs_nothing(pristine, tmp_path):
    """A FIFO as the latest snapshot's manifest, and as an older one's (verify --all
    and ls read every snapshot): every reader refuses it at once."""
    jobs = []
    for which in ("00000002", "00000001"):
        root = str(tmp_path / which / "root")
        shutil.copytree(pristine, root)
        plant_fifo(snap(root, which))
        jobs.append((root, "all" if which == "00000002" else "cli"))
    results = run_workers(jobs)
    for root, what in jobs:
        out = results[root]
        assert "died" not in out, out["died"]
        if what == "all":
            assert out["restore"].get("step") == 1 and out["restore"]["model_is_good"]
        for command in ("verify_all", "ls"):
            result = out["cli"][command]
            assert result["exception"] is None and result["code"] == 1, (command, result)
            assert "not a regular file" in result["output"], (command, result)
        for command in ("verify", "inspect", "diff", "export"):
            result = out["cli"][command]
            assert result["exception"] is None, (command, result)
            if what == "all":
                assert result["code"] == 1 and "not a regular file" in result["output"]


@pytest.mark.integration
def test_fifo_latest_pointer_is_ignored_not_waited_on(root):
    os.unlink(os.path.join(root, RUN, "LATEST"))
    os.mkfifo(os.path.join(root, RUN, "LATEST"))
    script = ("import sys; from snapd.store import RunStore; "
              f"print(RunStore(sys.argv[1], {RUN!r}).read_pointer('LATEST'))")
    try:  # in a subprocess: a reader that waits on the FIFO fails this test only
        proc = subprocess.run([sys.executable, "-c", script, root], capture_output=True,
                              text=True, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("reading a FIFO named LATEST hung")
    assert proc.returncode == 0 and proc.stdout.strip() == "None", proc.stderr


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
    from snapd_client.hot import HotSource
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
