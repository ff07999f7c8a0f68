"""Hostile snapshot files, judged in processes of their own: a manifest re-signed
with a valid checksum around hostile content, a FIFO as a manifest or as LATEST. Each
case runs in a worker subprocess (tests/hostile_worker.py: a SIGSEGV or a hang fails
the case, not the suite): a new trainer restores and the operator commands run,
everything reported as JSON. The in-process cases are tests/test_hostile.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import msgpack
import pytest

from helpers import private_copy, read_manifest, trained_root, write_manifest_raw
from hostile_worker import RUN, snap, train
from snapd import format as fmt

WORKER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "hostile_worker.py")
TIMEOUT = 120


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
