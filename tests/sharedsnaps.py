"""Runs whose snapshots share tensor files (format v4 ``shared``/``src``), made by
hand for the tests of snapd/keepshared.py and the commands that show sharing.

A plain snapshot is written by the writer (objects ``model`` and ``opt``, each with
its own tensor file); a sharing one is the same manifest with ``model``'s entries
moved to ``src`` form, reading the earlier snapshot's ``model.tensors``, and ``opt``'s
file copied: what the writer's reuse produces, committed by the same rename.
"""

from __future__ import annotations

import copy
import os
import shutil
import time
from typing import Dict, List

import torch

from snapd import format as fmt
from snapd import sharing
from snapd.options import Options
from snapd.plan import ObjectPlan, SnapshotPlan, TensorSource
from snapd.reader import SnapshotReader
from snapd.safefiles import read_manifest_bytes
from snapd.store import RunStore, SnapshotId
from snapd.writer import write_snapshot

RUN = "r"
MODEL_FILE = "model.tensors"


def _source(path: str, value: float, n: int) -> TensorSource:
    data = torch.full((n,), value)
    return TensorSource(path, "float32", [n], memoryview(data.numpy()).cast("B"))


def write_plain(store: RunStore, step: int) -> str:
    """A snapshot of ``model`` (two tensors) and ``opt`` (one), by the writer."""
    plan = SnapshotPlan(store.run, step, {"id": 0, "mode": "fresh", "parent": None},
                        [ObjectPlan("model", "test.M", b"\x90",
                                    [_source("w", float(step), 4096),
                                     _source("b", -float(step), 64)]),
                         ObjectPlan("opt", "test.O", b"\x90",
                                    [_source("m", step / 2, 256)])],
                        rng={}, metric=float(step))
    return write_snapshot(store, plan, Options()).path


def manifest_of(path: str) -> Dict:
    return fmt.decode_manifest(read_manifest_bytes(path), path=path)


def write_sharing(store: RunStore, step: int, source_step: int) -> str:
    """Snapshot ``step``: ``model`` read from snapshot ``source_step``'s file (every
    entry ``src``, no file of its own), ``opt`` its own copy; committed by rename."""
    source = store.snapshot_path(SnapshotId(0, source_step))
    m = copy.deepcopy(manifest_of(source))
    src_name = SnapshotId(0, source_step).name
    shared = _shared_of(m, src_name, source)
    m.update(step=step, metric=float(step), shared=shared)
    model = m["objects"]["model"]
    if model["file"] is not None:
        m["files"].pop(model["file"])
        model["file"] = None
    for t in model["tensors"]:
        t.setdefault("src", 0)
    tmp = os.path.join(store.snapshots_path, f".tmp-hand-{step}")
    os.mkdir(tmp, 0o700)
    for name in m["files"]:
        shutil.copyfile(os.path.join(source, name), os.path.join(tmp, name))
    with open(os.path.join(tmp, fmt.MANIFEST_NAME), "wb") as f:
        f.write(fmt.encode_manifest(m))
    final = store.snapshot_path(SnapshotId(0, step))
    os.rename(tmp, final)
    store.write_pointer("LATEST", SnapshotId(0, step))
    return final


def _shared_of(m: Dict, src_name: str, source: str) -> List[Dict]:
    """``shared`` of a snapshot that reads ``source``'s model file; when ``source``
    itself reads it from an earlier one, the same earlier file."""
    if m.get("shared"):
        return m["shared"]
    size = os.path.getsize(os.path.join(source, MODEL_FILE))
    return [{"snapshot": src_name, "file": MODEL_FILE, "size": size,
             "format": fmt.FORMAT_VERSION}]


def resolved(store: RunStore) -> Dict[str, Dict[str, bytes]]:
    """Every committed snapshot's references, located as a reader finds them, and
    their bytes (raises CorruptSnapshot when one is found nowhere)."""
    found = {}
    for sid in store.committed():
        m = manifest_of(store.snapshot_path(sid))
        found[sid.name] = {f"{s}/{f}": _read(sharing.locate(store.path, s, f,
                                                             wanted_by=sid.name))
                           for s, f in sharing.references(m)}
    return found


def verify_all(store: RunStore) -> List[str]:
    """Every committed snapshot read whole through the reader, every checksum checked
    (shared chunks where the reader finds them); their names."""
    names = []
    for sid in store.committed():
        SnapshotReader(store.snapshot_path(sid)).verify()
        names.append(sid.name)
    return names


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def age(*paths: str) -> None:
    """Make files two hours old: older than keepshared.SWEEP_MIN_AGE_S, which spares
    a younger unreferenced file (a pull's, perhaps) from the sweep."""
    old = time.time() - 7200
    for path in paths:
        os.utime(path, (old, old), follow_symlinks=False)


def tree(path: str) -> List[str]:
    """Every entry under ``path``, relative, sorted: to show that nothing changed."""
    entries = []
    for dirpath, dirs, files in os.walk(path):
        for name in dirs + files:
            entries.append(os.path.relpath(os.path.join(dirpath, name), path))
    return sorted(entries)
