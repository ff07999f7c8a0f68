"""What one snapshot holds, taken at the step boundary and frozen: the Capture.

``Client.snapshot()`` takes a :class:`Capture` first, before anything is copied:
each tracked object's skeleton and tensor leaves, every RNG stream, the data cursor,
and the run's identity (run, rank, lineage, data version). It is built complete, once,
and never changed after: the staging seam copies its leaves (snapd_client/staging.py,
``Stager``), the hand-off describes it to the daemon (:meth:`Capture.descriptor`), the in-process
writer writes :meth:`Capture.plan_in_memory`, and the committed log record takes its
RNG states and cursor.

The leaves are the live tensors, not copies: a capture is valid until the trainer next
changes them, which is why snapshot() stages (or writes) before it returns, and why
overlap mode defers only the leaves that nothing but ``optimizer.step()`` changes
(:func:`stepped_tensors`), whose pre-hook waits for the copy.

In a job of several ranks the capture is this rank's part: a DTensor leaf is its
local piece with its ``shard`` (snapd_client/state.py), and a leaf another rank
writes (a DDP replica, snapd_client/replicas.py) has ``ref``, that rank: it is not
copied into the arena (no slot bytes, offset 0) and its in-memory data is empty.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, TypeVar

import torch

from snapd.format import dtype_name
from snapd.plan import ObjectPlan, SnapshotPlan, TensorSource, describe, plan_tensor
from snapd.store import SnapshotId
from snapd_client.replicas import local_data_ptr
from snapd_client.state import flatten
from snapd_client.values import type_name

T = TypeVar("T")


@dataclass(frozen=True)
class CapturedObject:
    """One tracked object: its skeleton (the state without tensors) and its tensor
    leaves: ``paths[i]`` in the skeleton holds ``tensors[i]`` (the live tensor, not a
    copy); ``deferrable[i]``: overlap mode may copy it after snapshot() returns, since
    only optimizer.step() changes it; ``shards[i]``: a DTensor piece's place in the
    whole, else None; ``refs[i]``: the rank that writes it when not this one, else
    None. Tuples, not a leaf object each: a snapshot has thousands of leaves, and this
    is built on the training path."""

    name: str
    type: str
    skeleton: bytes
    metadata: Optional[bytes]
    paths: Tuple[str, ...]
    tensors: Tuple[torch.Tensor, ...]
    deferrable: Tuple[bool, ...]
    shards: Tuple[Optional[Dict[str, Any]], ...] = ()
    refs: Tuple[Optional[int], ...] = ()
    # ``frozen[i]``: nothing trains it; ``reuse[i]``: the earlier snapshot of the run
    # whose bytes it still equals, so it is not copied (snapd_client/frozen.py).
    frozen: Tuple[bool, ...] = ()
    reuse: Tuple[Optional[str], ...] = ()

    def __post_init__(self) -> None:
        for name in ("shards", "refs", "reuse"):   # not given: all written here
            if not getattr(self, name):
                object.__setattr__(self, name, (None,) * len(self.paths))
        if not self.frozen:
            object.__setattr__(self, "frozen", (False,) * len(self.paths))


@dataclass(frozen=True)
class Capture:
    """Everything one snapshot holds, as of one step boundary. Read-only throughout:
    fields cannot be assigned, mappings are read-only views of private copies."""

    run: str
    step: int
    rank: int
    lineage: Mapping[str, Any]
    data_version: Optional[str]
    metric: Optional[float]
    rng: Mapping[str, bytes]
    cursor: Optional[Mapping[str, Any]]
    objects: Tuple[CapturedObject, ...]
    # Damaged snapshots restore() refused: the writer may set one aside for this name.
    supersedes: Tuple[str, ...] = ()
    world_size: int = 1
    session: str = "none"   # the attempt this part belongs to (docs/multirank.md)
    base: Optional[Mapping[str, str]] = None   # the base model's reference, if any
    # Every leaf object by object (the order of the arena slot and of the files),
    # which overlap mode may defer, which this rank writes (no ref), and which of
    # those it copies (no reuse either): derived once, at construction.
    tensors: Tuple[torch.Tensor, ...] = field(init=False, repr=False, compare=False)
    deferrable: Tuple[bool, ...] = field(init=False, repr=False, compare=False)
    stored: Tuple[bool, ...] = field(init=False, repr=False, compare=False)
    carried: Tuple[bool, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        frozen = {"lineage": MappingProxyType(dict(self.lineage)),
                  "rng": MappingProxyType(dict(self.rng)),
                  "cursor": None if self.cursor is None
                  else MappingProxyType(dict(self.cursor)),
                  "objects": tuple(self.objects), "supersedes": tuple(self.supersedes)}
        frozen["tensors"] = tuple(t for o in frozen["objects"] for t in o.tensors)
        frozen["deferrable"] = tuple(d for o in frozen["objects"] for d in o.deferrable)
        frozen["stored"] = tuple(r is None for o in frozen["objects"] for r in o.refs)
        # The bytes this snapshot copies: written here, and held by no earlier one.
        frozen["carried"] = tuple(r is None and u is None for o in frozen["objects"]
                                  for r, u in zip(o.refs, o.reuse))
        for name, value in frozen.items():
            object.__setattr__(self, name, value)  # the one write, at construction

    @property
    def sid(self) -> SnapshotId:
        return SnapshotId(int(self.lineage.get("id", 0)), self.step)

    def per_object(self, flat: Sequence[T]) -> List[List[T]]:
        """``flat`` (one item per leaf, in :attr:`tensors` order) split by object."""
        it = iter(flat)
        return [[next(it) for _ in obj.tensors] for obj in self.objects]

    def record_state(self) -> Tuple[Dict[str, bytes], Optional[Dict[str, Any]]]:
        """The RNG states and cursor as plain dicts: what the committed record logs."""
        return dict(self.rng), None if self.cursor is None else dict(self.cursor)

    def plan(self, buffers: Sequence[memoryview]) -> SnapshotPlan:
        """The writer's plan, complete: leaf i's bytes are ``buffers[i]`` (ignored for
        a leaf another rank writes, or one an earlier snapshot holds)."""
        objects = [ObjectPlan(obj.name, obj.type, obj.skeleton,
                              [TensorSource(path, dtype_name(t.dtype), list(t.shape),
                                            data if ref is None and reuse is None
                                            else memoryview(b""),
                                            str(t.device), shard=shard, ref=ref,
                                            reuse=reuse, frozen=frozen)
                               for path, t, data, shard, ref, reuse, frozen in
                               zip(obj.paths, obj.tensors, datas, obj.shards, obj.refs,
                                   obj.reuse, obj.frozen)],
                              obj.metadata)
                   for obj, datas in zip(self.objects, self.per_object(buffers))]
        rng, cursor = self.record_state()
        return SnapshotPlan(run=self.run, step=self.step, lineage=dict(self.lineage),
                            objects=objects, rng=rng, cursor=cursor, metric=self.metric,
                            data_version=self.data_version, rank=self.rank,
                            world_size=self.world_size, session=self.session,
                            supersedes=list(self.supersedes),
                            base=None if self.base is None else dict(self.base))

    def plan_in_memory(self) -> SnapshotPlan:
        """The in-process writer's plan: over the tensors' own bytes (on CPU; copied
        only where needed); a leaf another rank writes gets none. It lives for the
        write only."""
        return self.plan([tensor_bytes(t) if carried else memoryview(b"")
                          for t, carried in zip(self.tensors, self.carried)])

    def descriptor(self, offsets: Sequence[int]) -> Dict[str, Any]:
        """The plan over a staging slot, as the daemon rebuilds it (snapd/plan.py):
        leaf i at ``offsets[i]`` (a leaf another rank writes: offset 0, no bytes). No
        buffer is made: the daemon maps the slot itself."""
        tensors = [[plan_tensor(path, dtype_name(t.dtype), t.shape, str(t.device),
                                off if ref is None and reuse is None else 0,
                                t.numel() * t.element_size(), shard=shard, ref=ref,
                                reuse=reuse, frozen=frozen)
                    for path, t, off, shard, ref, reuse, frozen in
                    zip(obj.paths, obj.tensors, offs, obj.shards, obj.refs, obj.reuse,
                        obj.frozen)]
                   for obj, offs in zip(self.objects, self.per_object(offsets))]
        return describe(self, tensors)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A tensor's elements as raw bytes in C order, on CPU (copied only if needed)."""
    t = t.detach().resolve_conj().resolve_neg()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def capture_object(name: str, obj: Any, defer: Optional[set] = None,
                   rank: int = 0) -> CapturedObject:
    """An object's skeleton and its tensor leaves (the live tensors, not copies; a
    DTensor's local piece). ``rank``: this process's, for the DTensor pieces another
    rank writes (replicated over a mesh dimension); DDP replicas are marked later, by
    :func:`snapd_client.replicas.with_writers`.

    ``defer``: the ``data_ptr()`` of the tensors optimizer.step() changes (see
    :func:`stepped_tensors`), for overlap mode; None leaves every leaf not deferrable.
    """
    state = obj.state_dict()
    flat = flatten(state, name)
    metadata = getattr(state, "_metadata", None)
    if defer is None:
        flags: Iterable[bool] = [False] * len(flat.paths)
    elif isinstance(obj, torch.optim.Optimizer):
        flags = [path.startswith(".state.") for path in flat.paths]
    elif isinstance(obj, torch.nn.Module):
        flags = [t.numel() > 0 and t.data_ptr() in defer for t in flat.tensors]
    else:
        flags = [False] * len(flat.paths)
    return CapturedObject(
        name, type_name(obj), flat.skeleton,
        flatten(dict(metadata), name).skeleton if metadata else None,
        tuple(flat.paths), tuple(flat.tensors), tuple(flags), tuple(flat.shards),
        tuple(None if w is None or w == rank else w for w in flat.writers))


def stepped_tensors(tracked: Mapping[str, Any]) -> set:
    """Overlap mode: the ``data_ptr()`` of every parameter a tracked optimizer steps.

    Those leaves, and the optimizers' state, only ``optimizer.step()`` changes; they
    may be copied after snapshot() returns. Everything else (module buffers change in
    forward; schedulers, scalers and user objects whenever they like) may not. A
    DTensor parameter counts by its local piece (the leaf captured).
    """
    return {local_data_ptr(p) for o in tracked.values() if isinstance(o, torch.optim.Optimizer)
            for g in o.param_groups for p in g["params"]}

