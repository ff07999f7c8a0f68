"""Choose, verify and check a snapshot before any tracked object is touched.

Order of trust: LATEST is a hint, tried first; then every committed snapshot, newest
first. A snapshot that fails verification (a damaged file, a missing RNG field) is
reported and the next older one is tried; it is never deleted. A snapshot that
verifies but does not fit the program (tracked names, types, shapes, dtypes,
``data_version``) stops the restore with IncompatibleState: an older snapshot of the
same run would not fit either, and silently starting over would lose the run.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional

import torch

from snapd.errors import CorruptSnapshot, IncompatibleState
from snapd.reader import SnapshotReader
from snapd.store import RunStore, SnapshotId
from snapd_client.rng import RngStreams
from snapd_client.state import flatten, tensor_meta, unflatten


# Tensors of one object from elsewhere than the files (the daemon's hot copy), or
# None to read the files. The source must verify them against the manifest. It is
# given the tensors the live object holds now, by path, and may read into them; one
# that did so and then failed verification lists the object in its ``touched``.
TensorProvider = Callable[[SnapshotReader, str, Dict[str, torch.Tensor]],
                          Optional[List[torch.Tensor]]]


class FallbackWarning(UserWarning):
    """A snapshot was refused as damaged and an older one is used instead."""


@dataclass
class Loaded:
    """A verified snapshot whose states are ready to be applied."""

    sid: SnapshotId
    path: str
    manifest: Dict[str, Any]
    states: Dict[str, Any]
    refused: Dict[str, str] = field(default_factory=dict)  # newer, damaged: name -> why


def type_name(obj: Any) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def candidates(store: RunStore) -> List[SnapshotId]:
    """LATEST first (when it names a committed snapshot), then newest to oldest."""
    committed = store.committed()
    order = list(reversed(committed))
    latest = store.read_pointer("LATEST")
    if latest in committed:
        order.remove(latest)
        order.insert(0, latest)
    return order


def _expected_meta(obj: Any, name: str):
    return {p: (d, s) for p, d, s in tensor_meta(flatten(obj.state_dict(), name))}


def check_fit(manifest: Dict[str, Any], tracked: Dict[str, Any], *, source: str,
              data_version: Optional[str]) -> None:
    """Refuse, naming the field, a snapshot that does not fit the tracked objects."""
    saved = manifest["objects"]
    if manifest.get("data_version") != data_version:
        raise IncompatibleState(
            f"{source}: field data_version is {manifest.get('data_version')!r} but this "
            f"run uses {data_version!r}. Resuming on other data is not the same run: "
            "pass the old data_version, or restore(mode='warm_start') to start a new "
            "lineage from these weights", field="data_version")
    for name in sorted(set(saved) | set(tracked)):
        if name not in saved:
            raise IncompatibleState(f"{source}: no object {name!r} in the snapshot; "
                                    f"it holds {sorted(saved)}. Stop tracking {name!r} or "
                                    "use mode='warm_start'", field=f"objects.{name}")
        if name not in tracked:
            raise IncompatibleState(f"{source}: the snapshot holds {name!r}, which is not "
                                    f"tracked now; track it, or use mode='warm_start'",
                                    field=f"objects.{name}")
        _check_object_fit(name, saved[name], tracked[name], source)


def _check_object_fit(name: str, saved: Dict[str, Any], obj: Any, source: str) -> None:
    if saved.get("type") != type_name(obj):
        raise IncompatibleState(f"{source}: objects.{name}.type is {saved.get('type')} "
                                f"but {name!r} is now a {type_name(obj)}; use "
                                "mode='warm_start' to load weights only",
                                field=f"objects.{name}.type")
    have = {t["path"]: (t["dtype"], t["shape"]) for t in saved["tensors"]}
    want = _expected_meta(obj, name)
    for path, (dtype, shape) in want.items():
        if path not in have:
            raise IncompatibleState(f"{source}: objects.{name} has no tensor {path!r}; "
                                    "the model's structure changed",
                                    field=f"objects.{name}{path}")
        if have[path] != (dtype, shape):
            raise IncompatibleState(
                f"{source}: objects.{name}{path} is {have[path][0]}{have[path][1]} in "
                f"the snapshot but {dtype}{shape} now", field=f"objects.{name}{path}")
    if isinstance(obj, torch.nn.Module) and set(have) != set(want):
        extra = sorted(set(have) - set(want))[:3]
        raise IncompatibleState(f"{source}: objects.{name} holds tensors the module "
                                f"lacks: {extra}", field=f"objects.{name}")


def _live_tensors(obj: Any, name: str) -> Dict[str, torch.Tensor]:
    """The tensors a module or optimizer holds now, by path: restore may read into
    them, since its load_state_dict replaces them anyway. Other objects: none."""
    if not isinstance(obj, (torch.nn.Module, torch.optim.Optimizer)):
        return {}
    flat = flatten(obj.state_dict(), name)
    return dict(zip(flat.paths, flat.tensors))


def _read_states(reader: SnapshotReader, tracked: Dict[str, Any],
                 tensor_source: Optional[TensorProvider] = None) -> Dict[str, Any]:
    states = {}
    for name, obj in tracked.items():
        entry = reader.objects[name]
        source = f"{reader.path}/{entry.get('file') or 'manifest.snapd'}"
        tensors = None
        if tensor_source is not None:
            tensors = tensor_source(reader, name, _live_tensors(obj, name))
        if tensors is None:
            tensors = reader.load_object(name)
        state = unflatten(entry["skeleton"], tensors, source=source)
        if entry.get("metadata") is not None:
            state._metadata = unflatten(entry["metadata"], [], source=source)
        states[name] = state
    return states


def _check_optimizer_groups(name: str, entry: Dict[str, Any], obj: Any,
                            source: str) -> None:
    """From the skeleton alone, before any tensor is read."""
    if not isinstance(obj, torch.optim.Optimizer):
        return
    state = unflatten(entry["skeleton"], None, source=source)
    now = [len(g["params"]) for g in obj.param_groups]
    then = [len(g["params"]) for g in state.get("param_groups", [])]
    if now != then:
        raise IncompatibleState(f"{source}: objects.{name}.param_groups hold {then} "
                                f"parameters, the optimizer now holds {now}",
                                field=f"objects.{name}.param_groups")


def load_for_resume(store: RunStore, tracked: Dict[str, Any], rng: RngStreams, *,
                    data_version: Optional[str], need_cursor: bool,
                    tensor_source: Optional[TensorProvider] = None,
                    omit: Iterable[str] = ()) -> Optional[Loaded]:
    """The newest snapshot that verifies and fits, fully read; None if the run is new.
    Objects named in ``omit`` are checked but not read (their states are absent)."""
    refused: Dict[str, str] = {}
    for sid in candidates(store):
        path = store.snapshot_path(sid)
        try:
            reader = SnapshotReader(path)
            source = os.path.join(path, "manifest.snapd")
            rng.check(reader.manifest["rng"], source=source)
            if need_cursor and not isinstance(reader.manifest.get("cursor"), dict):
                raise CorruptSnapshot(f"{source}: field cursor is missing; the data "
                                      "position cannot be restored", path=source,
                                      field="cursor")
            check_fit(reader.manifest, tracked, source=source, data_version=data_version)
            for name, obj in tracked.items():
                _check_optimizer_groups(name, reader.objects[name], obj, source)
            states = _read_states(reader, {n: o for n, o in tracked.items()
                                           if n not in omit}, tensor_source)
        except CorruptSnapshot as e:
            refused[sid.name] = str(e)
            warnings.warn(f"snapshot {path} refused: {e}; trying an older one "
                          "(the refused snapshot is left on disk)", FallbackWarning,
                          stacklevel=3)
            continue
        return Loaded(sid, path, reader.manifest, states, refused)
    if refused:
        touched = getattr(tensor_source, "touched", None)
        raise CorruptSnapshot(f"{store.path}: no snapshot verifies; refused: "
                              + "; ".join(f"{n}: {why}" for n, why in refused.items())
                              + ". To start over, use a new run "
                              "name (the damaged snapshots are kept for inspection)"
                              + (f". The daemon's copy was read into {sorted(touched)} "
                                 "before it failed its checksum: do not train on with "
                                 "them in this process" if touched else ""),
                              path=store.snapshots_path, field="snapshots")
    return None


def load_weights(store: RunStore, modules: Dict[str, torch.nn.Module]) -> Optional[Loaded]:
    """For warm_start: the newest verifying snapshot's module weights, shape-checked."""
    for sid in candidates(store):
        path = store.snapshot_path(sid)
        try:
            reader = SnapshotReader(path)
            names = [n for n in modules if n in reader.objects]
            for n in names:
                _check_object_fit(n, reader.objects[n], modules[n],
                                  os.path.join(path, "manifest.snapd"))
            return Loaded(sid, path, reader.manifest,
                          _read_states(reader, {n: modules[n] for n in names}))
        except CorruptSnapshot as e:
            warnings.warn(f"snapshot {path} refused: {e}; trying an older one",
                          FallbackWarning, stacklevel=3)
    return None
