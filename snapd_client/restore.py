"""Choose, verify and check a snapshot before any tracked object is touched.

Order of trust: LATEST is a hint, tried first; then every committed snapshot, newest
first. A snapshot that fails verification (a damaged file, a damaged RNG field) is
reported and the next older one is tried; it is never deleted. A snapshot that
verifies but does not fit the program (tracked names, types, shapes, dtypes,
``data_version``, the base model's digest, an RNG stream this process has and it lacks: MissingRngStream)
stops the restore with IncompatibleState: an older snapshot of the same run would
not fit either, and silently starting over would lose the run.

Restore is all or nothing. Per candidate, in this order: (1) the manifest's schema,
its files' types and sizes, its name against its step and lineage (the reader);
(2) every RNG stream against a scratch generator of its kind, the cursor's shape;
(3) the fit with the tracked objects; all before a tracked object, RNG stream or
the cursor is touched. Then (4) the tensors are read and verified, and only then
(5) applied: objects with their own load_state_dict() first, in track order, then
tracked tensors (copied in place), then value homes (values(), track_globals()) last
(:func:`restore_order`). A value home's contents are never checked against the
live ones (its values may not exist yet, or change shape), only its type.

Step 4 reads modules' and optimizers' tensors straight into the live ones only when
something can undo it (docs/format.md, "Restore: the order of checks"): when a
fallback exists (a later candidate passes 1-3), a chunk failing its checksum sends
restore on to it, and it reads every object again, so each ends as that snapshot;
with no fallback the files are read into new memory. A daemon's copy reads in place
regardless; with no fallback a copy of every tracked object's state, the RNG streams
and the cursor is taken first and put back if no snapshot verifies. Apply copies the
state of what was not read in place, and puts it back if an object raises half way.

Restore with overlap (``defer``, one process) moves step 4 for one
part of the state, an optimizer's per-parameter ``state``, to after restore returns;
nothing else changes. Checks 1-3 still cover the deferred optimizers (type, groups,
their file's size and tiling, the skeleton), so what a later read can find wrong is
bytes only, and a chunk failing its checksum there is a damaged snapshot as
at any step 4. What is applied now (5) holds the optimizer's param_groups and an
empty ``state``, all or nothing with the rest. The deferred read goes into new memory,
never into live tensors (nothing can undo a read in place once training runs), and
its result is applied on the trainer's thread before the first update, or never
(snapd_client/overlaprestore.py: a failure is sticky and sets the snapshot aside,
since no fallback can be read into a process that has trained on).
"""

from __future__ import annotations

import copy
import os
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Set, Tuple

import torch

from snapd.errors import CorruptSnapshot, IncompatibleState, SnapdError
from snapd.format import dtype_name
from snapd.logdigests import LoggedDigests
from snapd.signing import Keys
from snapd.reader import SnapshotReader, check_name_matches
from snapd.skeleton import unflatten
from snapd.store import RunStore, SnapshotId
from snapd_client.basemodel import LiveBase, check_same_base
from snapd_client.cursor import check_cursor
from snapd_client.rng import RngStreams
from snapd_client.state import flatten, tensor_meta
from snapd_client.values import TrackedTensor, ValueHome, type_name


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
    before: Optional["Before"] = None  # the tracked state as it was, to put back
    # Objects whose live tensors were read into (or left partly written by a refused
    # snapshot) with no copy of them kept: apply() cannot put these back.
    in_place: Set[str] = field(default_factory=set)
    passed_over: Optional[str] = None  # the newer snapshot verify_steps resumed before
    mode: str = "resume"   # "reshard": saved at another world size (distrestore.py)
    old_world_size: int = 1
    # restore(overlap=True): optimizers whose per-parameter state is not read yet (their
    # ``states`` hold the param_groups and an empty ``state``), and the reader that
    # reads it in the background (snapd_client/overlaprestore.py).
    deferred: Tuple[str, ...] = ()
    reader: Optional[SnapshotReader] = None


def _copy_tree(value: Any, tensors: bool = True) -> Any:
    """A deep copy of a state tree, tensors cloned to CPU (a copy on the device could
    not fit beside a model that fills it); ``tensors=False``: the same tensors, in a
    copy of the structure."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True) if tensors else value
    if isinstance(value, dict):
        out = type(value)() if type(value) in (dict, OrderedDict) else {}
        out.update((k, _copy_tree(v, tensors)) for k, v in value.items())
        if hasattr(value, "_metadata"):
            out._metadata = copy.deepcopy(value._metadata)
        return out
    if isinstance(value, (list, tuple)):
        items = [_copy_tree(v, tensors) for v in value]
        return items if isinstance(value, list) else tuple(items)
    return copy.deepcopy(value)


def _replaces_its_tensors(obj: Any) -> bool:
    """Whether ``obj.load_state_dict`` puts new tensors in place of its own and never
    writes into them: torch's own ``Optimizer.load_state_dict`` does (it keeps the
    loaded tensors), so the tensors it held stay as they were, and keeping them is
    keeping a copy. A module copies into its parameters; anything else may too."""
    return isinstance(obj, torch.optim.Optimizer) and \
        type(obj).load_state_dict is torch.optim.Optimizer.load_state_dict


class Before:
    """Every tracked object's state and the RNG streams as they were, copied before
    restore can write into any of them; :meth:`put_back` returns them there."""

    def __init__(self, tracked: Dict[str, Any], rng: RngStreams,
                 skip: Iterable[str] = (), *, reads_in_place: bool = False) -> None:
        """``skip``: objects not copied (already holding the snapshot's tensors, read
        in place); :meth:`put_back` reports them as not put back. Unless reads will
        land in the live tensors (``reads_in_place``: a daemon's copy), an
        optimizer's tensors are kept, not copied (_replaces_its_tensors): at 1 GiB of
        model and Adam state, two thirds of the copy."""
        skip = set(skip)
        self.states = {name: _copy_tree(obj.state_dict(), reads_in_place
                                        or not _replaces_its_tensors(obj))
                       for name, obj in tracked.items() if name not in skip}
        self.rng_state = rng.capture()
        self.cursor: Optional[Dict[str, Any]] = None

    def put_back(self, tracked: Dict[str, Any], rng: RngStreams, names: Iterable[str],
                 stream: Any = None) -> List[str]:
        """Load the copies back into ``names`` (and the RNG streams, and the cursor when
        ``stream`` is given); returns the names that could not be put back."""
        failed = []
        for name in names:
            if name not in self.states:
                failed.append(name)
                continue
            try:
                tracked[name].load_state_dict(self.states[name])
            except Exception:  # reported by name to the caller, who raises
                failed.append(name)
        rng.restore(self.rng_state)
        if stream is not None and self.cursor is not None:
            try:
                stream.load(self.cursor)
            except Exception:
                failed.append("cursor")
        return failed


def candidates(store: RunStore, at_most: Optional[int] = None) -> List[SnapshotId]:
    """LATEST first (when it names a committed snapshot), then newest to oldest.
    ``at_most`` (``snapd repro``): only the snapshots of steps up to it, newest first,
    whatever LATEST names."""
    if at_most is not None:
        return [sid for sid in reversed(store.committed()) if sid.step <= at_most]
    committed = store.committed()
    order = list(reversed(committed))
    latest = store.read_pointer("LATEST")
    if latest in committed:
        order.remove(latest)
        order.insert(0, latest)
    return order


def verify_pick(order: List[SnapshotId], reached: Optional[int],
                verify_steps: int) -> Optional[SnapshotId]:
    """Option ``verify_steps=k``: the snapshot to resume from instead of ``order[0]``
    (the one a resume would take) so that the replay check has steps to compare.

    Only when ``order[0]`` has no logged step after it (``reached`` is not past it: the
    trainer died right after that snapshot): then the newest snapshot of its lineage
    whose step S has ``order[0].step - k <= S < reached``, so that at least one logged
    step and at most k steps are recomputed. None when there is no such snapshot (they
    are further apart than k, or retention kept none), or nothing to do.
    """
    if verify_steps <= 0 or not order or reached is None or reached > order[0].step:
        return None
    newest = order[0]
    older = [sid for sid in order[1:] if sid.lineage == newest.lineage
             and newest.step - verify_steps <= sid.step < reached]
    return max(older, default=None)


@dataclass
class Pending:
    """A candidate not committed yet (snapd/remote/pendingpull.py): the newest, in a
    tmp dir holding every file but those of the objects in ``later``."""

    sid: SnapshotId
    path: str
    later: Tuple[str, ...]
    # Called when restore refuses it as damaged: keeps it out of the way (it is never
    # committed); returns the sentence that says what became of it.
    refused: Optional[Callable[[], str]] = None


def resume_order(store: RunStore, reached: Optional[int], verify_steps: int,
                 at_most: Optional[int] = None, first: Optional[Pending] = None
                 ) -> Tuple[List[SnapshotId], Optional[SnapshotId]]:
    """The candidates in the order a resume tries them, and the one ``verify_steps``
    put first (None when it did not). ``first``: tried before every committed one."""
    order = candidates(store, at_most)
    if first is not None and (at_most is None or first.sid.step <= at_most):
        order.insert(0, first.sid)
    pick = verify_pick(order, reached, verify_steps)
    if pick is not None:
        order.remove(pick)
        order.insert(0, pick)
    return order, pick


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
            "lineage from these weights", path=source, field="data_version")
    for name in sorted(set(saved) | set(tracked)):
        if name not in saved:
            raise IncompatibleState(f"{source}: no object {name!r} in the snapshot; "
                                    f"it holds {sorted(saved)}. Stop tracking {name!r} or "
                                    "use mode='warm_start'", path=source,
                                    field=f"objects.{name}")
        if name not in tracked:
            raise IncompatibleState(f"{source}: the snapshot holds {name!r}, which is not "
                                    f"tracked now; track it, or use mode='warm_start'",
                                    path=source, field=f"objects.{name}")
        _check_object_fit(name, saved[name], tracked[name], source)


def _check_object_fit(name: str, saved: Dict[str, Any], obj: Any, source: str) -> None:
    if saved.get("type") != type_name(obj):
        raise IncompatibleState(f"{source}: objects.{name}.type is {saved.get('type')} "
                                f"but {name!r} is now a {type_name(obj)}; use "
                                "mode='warm_start' to load weights only",
                                path=source, field=f"objects.{name}.type")
    if isinstance(obj, ValueHome):
        return  # values may not exist yet or change shape: only the type must fit
    have = {t["path"]: (t["dtype"], t["shape"]) for t in saved["tensors"]}
    if isinstance(obj, TrackedTensor):
        _check_tensor_fit(name, have, obj.tensor, source)
        return
    want = _expected_meta(obj, name)
    for path, (dtype, shape) in want.items():
        if path not in have:
            raise IncompatibleState(f"{source}: objects.{name} has no tensor {path!r}; "
                                    "the model's structure changed",
                                    path=source, field=f"objects.{name}{path}")
        if have[path] != (dtype, shape):
            raise IncompatibleState(
                f"{source}: objects.{name}{path} is {have[path][0]}{have[path][1]} in "
                f"the snapshot but {dtype}{shape} now", path=source,
                field=f"objects.{name}{path}")
    if isinstance(obj, torch.nn.Module) and set(have) != set(want):
        extra = sorted(set(have) - set(want))[:3]
        raise IncompatibleState(f"{source}: objects.{name} holds tensors the module "
                                f"lacks: {extra}", path=source, field=f"objects.{name}")


def _check_tensor_fit(name: str, have: Dict[str, Any], tensor: torch.Tensor,
                      source: str) -> None:
    """A tracked tensor is restored in place: the saved one must have its shape."""
    then = have.get(".tensor")
    now = (dtype_name(tensor.dtype), list(tensor.shape))
    if then is None or (then[0], list(then[1])) != now:
        saved = "nothing" if then is None else f"{then[0]}{list(then[1])}"
        raise IncompatibleState(
            f"{source}: objects.{name} is {saved} in the snapshot but {now[0]}{now[1]} "
            f"now; a tracked tensor is restored in place, so track {name!r} with the "
            "saved shape and dtype, or use mode='warm_start'", path=source,
            field=f"objects.{name}")


def restore_order(tracked: Dict[str, Any]) -> List[str]:
    """The order objects are loaded in: objects with their own load_state_dict() as
    tracked, then tracked tensors (in place), then value homes last."""
    rank = {name: 2 if isinstance(obj, ValueHome) else 1 if isinstance(obj, TrackedTensor)
            else 0 for name, obj in tracked.items()}
    return sorted(tracked, key=rank.__getitem__)  # stable: track order within a rank


def live_tensors(obj: Any, name: str) -> Dict[str, torch.Tensor]:
    """The tensors a module or optimizer holds now, by path: restore may read into
    them, since its load_state_dict replaces them anyway. Other objects: none."""
    if not isinstance(obj, (torch.nn.Module, torch.optim.Optimizer)):
        return {}
    flat = flatten(obj.state_dict(), name)
    return dict(zip(flat.paths, flat.leaves))   # a DTensor as itself, not its piece


def _destinations(live: Dict[str, torch.Tensor]
                  ) -> Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor]]:
    """Where the reader may put each tensor: the live CPU tensor itself, or for a live
    CUDA tensor a page-locked host buffer (copied to the device once every object
    verified). The reader uses a destination only where it fits (snapd/reader.py,
    ``destination``): a CUDA tensor that requires grad is not written either."""
    into, device = {}, {}
    for path, t in live.items():
        if type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cuda" \
                and t.is_contiguous() and not t.requires_grad:
            into[path] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            device[path] = t
        else:
            into[path] = t
    return into, device


def _read_states(reader: SnapshotReader, tracked: Dict[str, Any],
                 tensor_source: Optional[TensorProvider] = None, *,
                 in_place: Optional[Set[str]] = None, files_in_place: bool = True
                 ) -> Dict[str, Any]:
    """Every object's state, its tensors read (files in parallel) and verified.

    With ``in_place`` (a set, filled before anything is read with the objects whose
    live tensors may be written), modules' and optimizers' tensors are read into the
    live ones where they fit (by ``tensor_source``; by the files too unless
    ``files_in_place`` is False); their load_state_dict then copies nothing."""
    tensors: Dict[str, List[Any]] = {}
    into: Dict[str, Dict[str, torch.Tensor]] = {}
    device: Dict[str, Dict[str, torch.Tensor]] = {}
    for name, obj in tracked.items():
        live = live_tensors(obj, name) if in_place is not None else {}
        if live and (files_in_place or tensor_source is not None):
            in_place.add(name)
        got = tensor_source(reader, name, live) if tensor_source is not None else None
        if got is not None:
            tensors[name] = got
        elif files_in_place:
            into[name], device[name] = _destinations(live)
    tensors.update(reader.load_objects([n for n in tracked if n not in tensors],
                                       into=into))
    for name, on_device in device.items():
        _to_device(reader.objects[name]["tensors"], tensors[name], into[name], on_device)
    states = {}
    for name in tracked:
        entry = reader.objects[name]
        source = f"{reader.path}/{entry.get('file') or 'manifest.snapd'}"
        state = unflatten(entry["skeleton"], tensors[name], source=source)
        if entry.get("metadata") is not None:
            state._metadata = unflatten(entry["metadata"], [], source=source)
        states[name] = state
    return states


def _to_device(entries: List[Dict[str, Any]], tensors: List[Any],
               host: Dict[str, torch.Tensor], live: Dict[str, torch.Tensor]) -> None:
    """Verified tensors read into page-locked buffers go to their live CUDA tensors."""
    copied = False
    for i, entry in enumerate(entries):
        path = entry["path"]
        if path in live and tensors[i] is host[path]:
            live[path].copy_(tensors[i], non_blocking=True)
            tensors[i], copied = live[path], True
    if copied:
        torch.cuda.synchronize()


def _check_optimizer_groups(name: str, entry: Dict[str, Any], obj: Any,
                            source: str) -> None:
    """From the skeleton alone, before any tensor is read."""
    if not isinstance(obj, torch.optim.Optimizer):
        return
    state = unflatten(entry["skeleton"], None, source=source)
    groups = state.get("param_groups", [])
    if not isinstance(groups, list) or not all(
            isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups):
        raise CorruptSnapshot(f"{source}: field objects.{name}.skeleton param_groups is "
                              "not a list of groups with params; the snapshot is damaged "
                              "or hostile, use an older one", path=source,
                              field=f"objects.{name}.param_groups")
    now = [len(g["params"]) for g in obj.param_groups]
    then = [len(g["params"]) for g in groups]
    if now != then:
        raise IncompatibleState(f"{source}: objects.{name}.param_groups hold {then} "
                                f"parameters, the optimizer now holds {now}",
                                path=source, field=f"objects.{name}.param_groups")


def rng_omitted(omit: Iterable[str]) -> List[str]:
    """The RNG streams named in ``omit`` (as ``rng:<stream>``)."""
    return [o.split(":", 1)[1] for o in omit if o.startswith("rng:")]


def saved_cursor(manifest: Dict[str, Any], source: str) -> Dict[str, Any]:
    """The snapshot's data cursor, which a resume with a batch stream needs."""
    if not isinstance(manifest.get("cursor"), dict):
        raise CorruptSnapshot(f"{source}: field cursor is missing; the data position "
                              "cannot be restored", path=source, field="cursor")
    return manifest["cursor"]


def check_logged(reader: SnapshotReader, logged: Optional[LoggedDigests]) -> None:
    """The manifest's SHA-256 against the one the state log recorded when the
    snapshot was committed (snapd/logdigests.py): a manifest rewritten since, its
    digests made to fit replaced files, is refused as CorruptSnapshot."""
    if logged is None:
        return
    name = os.path.basename(reader.path)
    if SnapshotId.parse(name) is None:   # a pull not committed yet (Pending): its tmp
        lineage = reader.manifest["lineage"].get("id", 0)   # dir, checked against
        name = SnapshotId(lineage, reader.manifest["step"]).name   # the name it pulls
    want = logged.get(name)
    if want is not None and want != reader.manifest_sha256:
        source = os.path.join(reader.path, "manifest.snapd")
        raise CorruptSnapshot(
            f"{source}: SHA-256 {reader.manifest_sha256} differs from the "
            f"manifest_sha256 {want} the state log ({logged.run_dir}/log) recorded "
            f"when {name} was committed: the manifest was rewritten since, so its "
            "digests prove nothing. Treat the snapshot as forged (keep it to "
            "investigate); restore uses an older one", path=source,
            field="manifest_sha256")


def check_signed(reader: SnapshotReader, keys: Optional[Keys]) -> None:
    """With a signing key, the manifest must be signed with an accepted key
    (snapd/signing.py); UntrustedSnapshot, a CorruptSnapshot, otherwise."""
    if keys is not None:
        keys.check(reader.manifest_bytes, what="manifest",
                   path=os.path.join(reader.path, "manifest.snapd"))


def check_candidate(reader: SnapshotReader, tracked: Dict[str, Any], rng: RngStreams,
                     *, data_version: Optional[str], need_cursor: bool,
                     omit: Iterable[str] = (), base: Optional[LiveBase] = None,
                     logged: Optional[LoggedDigests] = None,
                     keys: Optional[Keys] = None) -> None:
    """Every check that needs no tensor: nothing live is touched yet. ``base``: the
    client's base model, whose digest the snapshot's must equal (snapd_client/basemodel.py).
    ``logged``: the manifests' SHA-256s the state log recorded (:func:`check_logged`);
    ``keys``: the client's signing keys (:func:`check_signed`)."""
    source = os.path.join(reader.path, "manifest.snapd")
    check_signed(reader, keys)
    check_name_matches(reader.path, reader.manifest)
    rng.check(reader.manifest["rng"], source=source, omit=rng_omitted(omit))
    if need_cursor:
        check_cursor(saved_cursor(reader.manifest, source), rng, source=source,
                     omit=rng_omitted(omit))
    # Before the fit: a forged manifest is damage (fall back), not a program that
    # no longer fits (which would stop the restore).
    check_logged(reader, logged)
    check_fit(reader.manifest, tracked, source=source, data_version=data_version)
    check_same_base(reader.manifest, base, source)
    for name in tracked:  # every skeleton decodes to a state dict before a tensor is read
        if not isinstance(unflatten(reader.objects[name]["skeleton"], None, source=source),
                          dict):
            raise CorruptSnapshot(f"{source}: field objects.{name}.skeleton is not a map "
                                  "(a state dict); the snapshot is damaged or hostile, use "
                                  "an older one", path=source,
                                  field=f"objects.{name}.skeleton")
        _check_optimizer_groups(name, reader.objects[name], tracked[name], source)


def load_for_resume(store: RunStore, tracked: Dict[str, Any], rng: RngStreams, *,
                    data_version: Optional[str], need_cursor: bool,
                    tensor_source: Optional[TensorProvider] = None,
                    omit: Iterable[str] = (), reached: Optional[int] = None,
                    verify_steps: int = 0, base: Optional[LiveBase] = None,
                    defer: Iterable[str] = (), at_most: Optional[int] = None,
                    logged: Optional[LoggedDigests] = None,
                    keys: Optional[Keys] = None,
                    first: Optional[Pending] = None) -> Optional[Loaded]:
    """The newest snapshot that verifies and fits, fully read; None if the run is new.
    Objects named in ``omit`` are checked but not read (their states are absent);
    ``rng:<stream>`` in it is neither checked nor (by :func:`apply`) restored.
    With ``verify_steps`` (see :func:`verify_pick`) an older snapshot is tried first;
    if it is refused, the usual order follows. Optimizers named in ``defer``
    (``restore(overlap=True)``) are checked like every object, but their per-parameter
    state is left to :func:`read_step_state` (:func:`step_only_names`, ``Loaded.deferred``).
    ``at_most`` (``snapd repro``): the newest snapshot of a step up to it, LATEST aside.
    ``logged``: each manifest is checked against the SHA-256 the log recorded;
    ``keys``: with a signing key, each must be signed with an accepted one.
    ``first``: a pulled snapshot not committed yet, tried first (restore(overlap=True)
    with the remote tier: its ``later`` objects must be the deferred ones).

    Live tensors are read into only when something can undo it (the module
    docstring): a fallback, the next candidate, passes every check that needs no
    tensor, or a copy of the tracked state is kept (``Loaded.before``: taken only for
    a daemon's copy, which reads in place, with no fallback)."""
    refused: Dict[str, str] = {}
    before: Optional[Before] = None
    written: Set[str] = set()   # left partly written by a refused snapshot
    order, pick = resume_order(store, reached, verify_steps, at_most, first)
    fallbacks = _Fallbacks(store, order, lambda r: check_candidate(
        r, tracked, rng, data_version=data_version, need_cursor=need_cursor, omit=omit,
        base=base, logged=logged, keys=keys), first)
    for i, sid in enumerate(order):
        path = fallbacks.path(i)
        in_place: Set[str] = set()
        try:
            reader = fallbacks.reader(i)
            check_candidate(reader, tracked, rng, data_version=data_version,
                            need_cursor=need_cursor, omit=omit, base=base, logged=logged,
                            keys=keys)
            undo = fallbacks.after(i)
            if not undo and before is None and tensor_source is not None:
                # a hot read lands in live tensors
                before = Before(tracked, rng, reads_in_place=True)
            deferred = step_only_names(reader, set(defer) - set(omit))
            if first is not None and sid == first.sid and set(deferred) != set(first.later):
                raise CorruptSnapshot(f"{path}: objects {sorted(first.later)} were left "
                                      f"to arrive later, but {sorted(deferred)} can be; "
                                      "the snapshot is not used", path=path,
                                      field="objects")
            states = _read_states(reader, {n: o for n, o in tracked.items()
                                           if n not in omit and n not in deferred},
                                  tensor_source,
                                  in_place=in_place if undo or before is not None else None,
                                  files_in_place=undo)
            states.update((n, groups_only(reader, n)) for n in deferred)
        except CorruptSnapshot as e:
            written |= in_place
            refused[sid.name] = str(e)
            left = "the refused snapshot is left on disk"
            if first is not None and sid == first.sid and first.refused is not None:
                left = first.refused()
            warnings.warn(f"snapshot {path} refused: {e}; trying an older one "
                          f"({left})", FallbackWarning, stacklevel=3)
            continue
        except BaseException:
            # Any other stop (an older snapshot that does not fit, an interrupt): a
            # newer candidate's read may already have landed in live tensors, and
            # restore is all or nothing.
            _untouched(before, tracked, rng, tensor_source, written | in_place)
            raise
        return Loaded(sid, path, reader.manifest, states, refused, before,
                      in_place=set() if before else in_place | written,
                      passed_over=order[1].name if sid == pick else None,
                      deferred=deferred, reader=reader if deferred else None)
    if refused:
        raise CorruptSnapshot(f"{store.path}: no snapshot verifies; refused: "
                              + "; ".join(f"{n}: {why}" for n, why in refused.items())
                              + ". To start over, use a new run "
                              "name (the damaged snapshots are kept for inspection). "
                              + _untouched(before, tracked, rng, tensor_source, written),
                              path=store.snapshots_path, field="snapshots")
    return None


STATE_PREFIX = ".state."   # an optimizer's per-parameter state, flattened (state.py)


def step_only_names(reader: SnapshotReader, names: Iterable[str]) -> Tuple[str, ...]:
    """Of the optimizers ``names``, those whose tensors are all per-parameter state
    (``state`` of the state dict), which only ``optimizer.step()`` reads: the ones a
    restore with overlap may leave to the background. An optimizer with a tensor in
    its param_groups (a tensor learning rate) or with no tensor at all is read now."""
    return tuple(n for n in sorted(names) if reader.objects[n]["tensors"] and all(
        t["path"].startswith(STATE_PREFIX) for t in reader.objects[n]["tensors"]))


def overlappable(obj: Any) -> bool:
    """An optimizer whose state may arrive after restore returns: torch's own
    ``load_state_dict`` (which may be called again with the rest, and keeps the
    tensors it is given); a subclass that overrides it is read with everything."""
    return isinstance(obj, torch.optim.Optimizer) and _replaces_its_tensors(obj)


def groups_only(reader: SnapshotReader, name: str) -> Dict[str, Any]:
    """An optimizer's saved state dict without its per-parameter state: its
    param_groups (they hold no tensor: :func:`step_only_names`), any other entry, and
    an empty ``state``, decoded from the skeleton alone."""
    source = os.path.join(reader.path, "manifest.snapd")
    saved = unflatten(reader.objects[name]["skeleton"], None, source=source)
    return dict(saved, state={})


def read_step_state(reader: SnapshotReader, names: Iterable[str],
                    tracked: Dict[str, Any],
                    tensor_source: Optional[TensorProvider] = None) -> Dict[str, Any]:
    """The deferred optimizers' full states (step 4 for them): read into new memory,
    never into live tensors, from ``tensor_source`` (the daemon's copy) where it
    serves, else from the files, and verified like any object's. Raises
    CorruptSnapshot naming the file. Runs on a background thread: it touches nothing
    live (snapd_client/overlaprestore.py applies the result on the trainer's)."""
    return _read_states(reader, {n: tracked[n] for n in names}, tensor_source)


class _Fallbacks:
    """The candidates' readers, opened once, and whether a candidate has a fallback:
    a later one that passes every check needing no tensor, with only candidates
    refused as damaged between (an incompatible one stops the restore)."""

    def __init__(self, store: RunStore, order: List[SnapshotId],
                 check: Callable[[SnapshotReader], None],
                 first: Optional[Pending] = None) -> None:
        self.store, self.order, self.check = store, order, check
        self.first = first
        self.readers: Dict[int, SnapshotReader] = {}
        self.verdict: Dict[int, bool] = {}

    def path(self, i: int) -> str:
        if self.first is not None and self.order[i] == self.first.sid:
            return self.first.path
        return self.store.snapshot_path(self.order[i])

    def reader(self, i: int) -> SnapshotReader:
        if i not in self.readers:
            objects = None
            if self.first is not None and self.order[i] == self.first.sid:
                manifest = SnapshotReader(self.first.path, objects=[]).objects
                objects = [n for n in manifest if n not in self.first.later]
            self.readers[i] = SnapshotReader(self.path(i), objects=objects)
        return self.readers[i]

    def after(self, i: int) -> bool:
        for j in range(i + 1, len(self.order)):
            if j not in self.verdict:
                try:
                    self.check(self.reader(j))
                    self.verdict[j] = True
                except CorruptSnapshot:
                    self.verdict[j] = False
                except SnapdError:
                    return False  # restore would stop there: no fallback
            if self.verdict[j]:
                return True
        return False


def _untouched(before: Optional[Before], tracked: Dict[str, Any], rng: RngStreams,
               tensor_source: Optional[TensorProvider], written: Set[str]) -> str:
    """Put back what reads in place wrote into (whether they then verified or not: the
    snapshot they belonged to was refused); the sentence that says so."""
    hot = set(getattr(tensor_source, "touched", None) or ()) \
        | set(getattr(tensor_source, "hits", None) or ())
    served = sorted(hot | written)
    if not served:
        return "Every tracked object is untouched"
    if before is None:
        return (f"{served} were read in place from snapshots that then failed "
                "verification and hold part of them: do not train on with them in this "
                "process")
    failed = before.put_back(tracked, rng, served)
    if failed:
        return (f"The daemon's copy was read into {failed} and they could not be put "
                "back: do not train on with them in this process")
    if hot:
        return (f"Every tracked object is untouched (the daemon's copy read into "
                f"{served} was put back)")
    return f"Every tracked object is untouched ({served}, read in place, were put back)"


def apply(loaded: Loaded, tracked: Dict[str, Any], rng: RngStreams, stream: Any,
          omit: Iterable[str] = ()) -> None:
    """Load every object, the RNG streams and the cursor from ``loaded``: all of them,
    or (when one raises half way) none, the state taken before put back. Objects read
    in place (``loaded.in_place``) already hold the snapshot's tensors and are not
    copied; their load_state_dict finds its own tensors and copies nothing."""
    omit = set(omit)
    before = loaded.before or Before(tracked, rng, skip=loaded.in_place)
    if stream is not None:
        before.cursor = stream.state()
    try:
        for name in restore_order(tracked):
            if name not in omit:
                tracked[name].load_state_dict(loaded.states[name])
        rng.restore(loaded.manifest["rng"],
                    omit=rng_omitted(omit))
        if stream is not None and "cursor" not in omit:
            stream.load(loaded.manifest["cursor"], omit=rng_omitted(omit))
    except Exception as e:
        failed = before.put_back(tracked, rng, list(tracked), stream)
        where = f"{loaded.path}: applying the snapshot failed half way ({e!r})"
        if failed:
            raise SnapdError(f"{where}, and {failed} could not be put back as they were: "
                             "do not train on in this process; restart it",
                             path=loaded.path, field="objects") from e
        raise IncompatibleState(f"{where}; every tracked object, RNG stream and the cursor "
                                "was put back as it was before restore(), untouched. Fix "
                                "the object that raised, or use mode='warm_start'",
                                path=loaded.path, field="objects") from e


DDP_PREFIX = "module."


def ddp_prefix(saved: Iterable[str], live: Iterable[str]) -> Optional[str]:
    """How a module's saved state-dict keys become the live ones: None (as they are),
    ``"strip"`` (saved from a DistributedDataParallel wrapper, ``module.x``, loaded
    into the bare model) or ``"add"`` (the other way round). Decided on the whole key
    set, so a model whose own submodule is called ``module`` is not mistaken."""
    saved, live = set(saved), set(live)
    if saved == live or not saved:
        return None
    if {DDP_PREFIX + k for k in live} == saved:
        return "strip"
    if {DDP_PREFIX + k for k in saved} == live:
        return "add"
    return None


def with_prefix(state: Dict[str, Any], how: Optional[str]) -> Dict[str, Any]:
    """``state`` (a module's state dict) with keys renamed as :func:`ddp_prefix` said,
    its ``_metadata`` (per-submodule versions) renamed alike."""
    if how is None:
        return state
    def rename(key: str, top: str) -> str:
        if how == "strip":
            return key[len(DDP_PREFIX):] if key.startswith(DDP_PREFIX) else \
                ("" if key == top else key)
        return (DDP_PREFIX + key) if key else top
    out = OrderedDict((rename(k, "\0"), v) for k, v in state.items())
    meta = getattr(state, "_metadata", None)
    if meta is not None:
        out._metadata = OrderedDict((rename(k, "module"), v) for k, v in meta.items()
                                    if not (how == "strip" and k == ""))
        if how == "add" and "" in meta:
            out._metadata[""] = meta[""]
    return out


def _module_keys(paths: Iterable[str]) -> List[str]:
    return [p[1:] for p in paths]  # a module's flattened paths are ".<key>"


def load_weights(store: RunStore, modules: Dict[str, torch.nn.Module],
                 base: Optional[LiveBase] = None,
                 keys: Optional[Keys] = None) -> Optional[Loaded]:
    """For warm_start: the newest verifying snapshot's module weights, shape-checked;
    a DistributedDataParallel ``module.`` prefix is added or removed to fit. A base
    digest other than ``base``'s is refused (IncompatibleState), as on resume."""
    for sid in candidates(store):
        path = store.snapshot_path(sid)
        try:
            reader = SnapshotReader(path, objects=list(modules))  # only their files
            check_signed(reader, keys)
            check_name_matches(path, reader.manifest)
            names = [n for n in modules if n in reader.objects]
            source = os.path.join(path, "manifest.snapd")
            check_same_base(reader.manifest, base, source)
            prefixes = {n: _check_weights_fit(n, reader.objects[n], modules[n], source)
                        for n in names}
            states = _read_states(reader, {n: modules[n] for n in names})
            return Loaded(sid, path, reader.manifest,
                          {n: with_prefix(s, prefixes[n]) for n, s in states.items()})
        except CorruptSnapshot as e:
            warnings.warn(f"snapshot {path} refused: {e}; trying an older one",
                          FallbackWarning, stacklevel=3)
    return None


def _check_weights_fit(name: str, saved: Dict[str, Any], module: torch.nn.Module,
                       source: str) -> Optional[str]:
    """The fit of one module's weights, through the DDP prefix when one differs (the
    types then differ too: the wrapper's and the model's); returns the prefix rule."""
    want = _expected_meta(module, name)
    how = ddp_prefix(_module_keys(t["path"] for t in saved["tensors"]), _module_keys(want))
    if how is None:
        _check_object_fit(name, saved, module, source)
        return None
    renamed = dict(saved, type=type_name(module), tensors=[
        dict(t, path="." + next(iter(with_prefix({t["path"][1:]: None}, how))))
        for t in saved["tensors"]])
    _check_object_fit(name, renamed, module, source)
    return how
