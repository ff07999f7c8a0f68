"""A snapshot's plan: everything it holds, built complete and frozen for the writer.

In the training process a plan's tensors are buffers over the staging arena (or over
CPU tensors, when written in-process). Between processes a plan travels as a
*descriptor*: the same fields, each tensor given by its offset and length in an arena
slot instead of its bytes. The daemon rebuilds the plan over its own mapping of that
slot, so tensor bytes are never copied through the socket.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from snapd import format as fmt
from snapd.errors import CorruptSnapshot, SnapdError
from snapd.format import ITEMSIZES
from snapd.store import SnapshotId


@dataclass(frozen=True)
class TensorSource:
    """One tensor's raw bytes (C order) and what is needed to rebuild it."""

    path: str
    dtype: str
    shape: List[int]
    data: memoryview
    device: str = "cpu"
    # A piece of a sharded tensor: {"global_shape", "offset"} (docs/format.md, v3).
    shard: Optional[Dict[str, List[int]]] = None
    # Replicated, and written by this rank of the job instead: no bytes here.
    ref: Optional[int] = None
    # Unchanged since snapshot ``reuse`` (its name) of this run wrote its bytes: the
    # writer refers to those bytes and gets none here (snapd/sharing.py).
    reuse: Optional[str] = None
    # A module tensor nothing trains (snapd_client/frozen.py): marked in the manifest.
    frozen: bool = False
    # Read once, at construction: still known once the writer released ``data``.
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        nbytes = len(self.data)
        if not self.carried:   # the bytes are elsewhere: the size is the shape's
            nbytes = math.prod(self.shape) * ITEMSIZES[self.dtype]
        object.__setattr__(self, "nbytes", nbytes)

    @property
    def stored(self) -> bool:
        """Whether this rank writes the tensor's bytes (it is not another's to write)."""
        return self.ref is None

    @property
    def carried(self) -> bool:
        """Whether the plan carries the tensor's bytes: this rank writes them and no
        earlier snapshot of the run already holds them."""
        return self.ref is None and self.reuse is None

    def placement(self) -> Dict[str, Any]:
        """The optional manifest keys of the tensor's entry: shard, ref."""
        out: Dict[str, Any] = {}
        if self.shard is not None:
            out["shard"] = {"global_shape": list(self.shard["global_shape"]),
                            "offset": list(self.shard["offset"])}
        if self.ref is not None:
            out["ref"] = self.ref
        if self.frozen:
            out["frozen"] = True
        return out


@dataclass(frozen=True)
class ObjectPlan:
    """One tracked object: its skeleton and its tensors."""

    name: str
    type: str
    skeleton: bytes
    tensors: Sequence[TensorSource] = ()
    metadata: Any = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "tensors", tuple(self.tensors))


@dataclass(frozen=True)
class SnapshotPlan:
    """Everything one snapshot holds, built complete and never changed after.

    The client builds it from its frozen capture (snapd_client/capture.py), over the
    tensors' own bytes or a staging slot; the daemon from a descriptor over its
    mapping of the slot. Whoever built it drops it when the write ends: its buffers
    are views of memory the writer does not own.
    """

    run: str
    step: int
    lineage: Dict[str, Any]
    objects: Sequence[ObjectPlan]
    rng: Dict[str, bytes]
    cursor: Optional[Dict[str, Any]] = None
    metric: Optional[float] = None
    data_version: Optional[str] = None
    rank: int = 0
    world_size: int = 1
    # The attempt this part belongs to: the global commit joins parts of one session.
    session: str = "none"
    # Names of damaged snapshots restore() refused: the writer may move one aside
    # (never delete it) when this snapshot needs its name.
    supersedes: Sequence[str] = ()
    # The base model this state belongs to: {name, revision, digest} (docs/format.md).
    base: Optional[Dict[str, str]] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "objects", tuple(self.objects))
        object.__setattr__(self, "supersedes", tuple(self.supersedes))

    @property
    def sid(self) -> SnapshotId:
        return SnapshotId(int(self.lineage.get("id", 0)), self.step)

    @property
    def nbytes(self) -> int:
        """The bytes this plan carries (tensors another rank writes, and those an
        earlier snapshot holds, are not counted)."""
        return sum(t.nbytes for o in self.objects for t in o.tensors if t.carried)


def plan_tensor(path: str, dtype: str, shape: Any, device: str, offset: int,
                nbytes: int, *, shard: Optional[Dict[str, Any]] = None,
                ref: Optional[int] = None, reuse: Optional[str] = None,
                frozen: bool = False) -> Dict[str, Any]:
    """One tensor of a descriptor: where its bytes lie in the slot, not the bytes.
    ``ref``: another rank writes it; ``reuse``: the snapshot of this run that holds its
    bytes. Either takes no slot bytes (``offset`` is 0)."""
    entry = {"path": path, "dtype": dtype, "shape": list(shape), "device": device,
             "offset": offset, "nbytes": nbytes}
    if shard is not None:
        entry["shard"] = {"global_shape": list(shard["global_shape"]),
                          "offset": list(shard["offset"])}
    if ref is not None:
        entry["ref"] = ref
    if reuse is not None:
        entry["reuse"] = reuse
    if frozen:
        entry["frozen"] = True
    return entry


def describe(plan: Any, tensors: List[List[Dict[str, Any]]]) -> Dict[str, Any]:
    """The descriptor of ``plan`` (the client's Capture: ``Capture.descriptor`` is the
    one encoder), with ``tensors[i]`` the :func:`plan_tensor` entries of object i."""
    objects = [{"name": obj.name, "type": obj.type, "skeleton": obj.skeleton,
                "metadata": obj.metadata, "tensors": entries}
               for obj, entries in zip(plan.objects, tensors)]
    return {"run": plan.run, "step": plan.step, "lineage": dict(plan.lineage),
            "objects": objects, "rng": dict(plan.rng),
            "cursor": None if plan.cursor is None else dict(plan.cursor),
            "metric": plan.metric, "data_version": plan.data_version,
            "rank": plan.rank, "world_size": plan.world_size,
            "session": plan.session, "supersedes": list(plan.supersedes),
            "base": None if plan.base is None else dict(plan.base)}


def check_descriptor(desc: Any) -> None:
    """Refuse a submitted descriptor whose snapshot the reader would refuse: the
    manifest's schema (snapd.format), applied before anything is written."""
    try:
        _check_descriptor_fields(desc)
    except CorruptSnapshot as e:
        raise CorruptSnapshot(f"submitted plan descriptor is malformed, nothing was "
                              f"written: field {e.field} is refused ({e}). The client "
                              "and daemon may be of different snapd versions",
                              field=e.field) from e


def _check_descriptor_fields(desc: Any) -> None:
    where = "descriptor"
    fmt.need(isinstance(desc, dict) and isinstance(desc.get("objects"), list), where,
             "objects", "is not a list")
    fmt.check_header_fields(desc, where)
    fmt.check_lineage(desc.get("lineage"), where)
    fmt.check_rng_map(desc.get("rng"), path=where, field="rng")
    fmt.need(fmt.is_name(desc.get("session", "none")), where, "session", "is not a name")
    fmt.check_base(desc.get("base"), where)
    fmt.need(desc.get("cursor") is None or (isinstance(desc["cursor"], dict) and
             fmt.nests_within(desc["cursor"], fmt.MAX_PLAIN_DEPTH)), where, "cursor",
             "is neither nil nor a map of bounded depth")
    names = set()
    for i, obj in enumerate(desc["objects"]):
        fmt.need(isinstance(obj, dict) and fmt.is_name(obj.get("name"))
                 and obj["name"] not in names, where, f"objects[{i}].name",
                 "is not a unique name")
        names.add(obj["name"])
        field = f"objects.{obj['name']}"
        fmt.need(fmt.is_name(obj.get("type")), where, f"{field}.type", "is not a type name")
        for key in ("skeleton", "metadata"):
            if key == "metadata" and obj.get(key) is None:
                continue
            fmt.need(isinstance(obj.get(key), bytes), where, f"{field}.{key}", "is not bytes")
            fmt.check_skeleton(obj[key], path=where, field=f"{field}.{key}")
        fmt.need(isinstance(obj.get("tensors"), list), where, f"{field}.tensors",
                 "is not a list")
        for j, t in enumerate(obj["tensors"]):
            _check_descriptor_tensor(t, where, f"{field}.tensors[{j}]")
            fmt.check_placement({**t, "chunks": []} if "ref" in t else t, desc, where,
                                f"{field}.tensors[{j}]")
            fmt.need("reuse" not in t or (isinstance(t["reuse"], str) and "ref" not in t
                                          and bool(fmt.SNAPSHOT_NAME.match(t["reuse"]))),
                     where, f"{field}.tensors[{j}].reuse", "is not a snapshot name")


def _check_descriptor_tensor(t: Any, where: str, field: str) -> None:
    fmt.need(isinstance(t, dict) and isinstance(t.get("path"), str), where,
             f"{field}.path", "is not a string")
    fmt.need(isinstance(t.get("dtype"), str) and t["dtype"] in ITEMSIZES, where,
             f"{field}.dtype", "is not a known dtype")
    shape = t.get("shape")
    fmt.need(isinstance(shape, list) and len(shape) <= fmt.MAX_DIMS
             and all(fmt.is_uint(n) for n in shape), where, f"{field}.shape",
             "is not a list of sizes")
    fmt.need(fmt.is_uint(t.get("offset")) and fmt.is_uint(t.get("nbytes")), where,
             f"{field}.offset", "is not a byte count")
    fmt.need(t.get("device", "cpu") is None or fmt.is_name(t.get("device", "cpu")),
             where, f"{field}.device", "is not a device name")


def used_bytes(desc: Dict[str, Any]) -> int:
    """How much of a slot a plan descriptor uses: the end of its last tensor."""
    return max((t["offset"] + t["nbytes"] for o in desc["objects"]
                for t in o["tensors"] if "ref" not in t and "reuse" not in t), default=0)


def tensor_extent(t: Dict[str, Any], size: int) -> Tuple[int, int]:
    """(start, end) of a descriptor tensor within a ``size``-byte slot, checked."""
    if t["dtype"] not in ITEMSIZES:
        raise SnapdError(f"descriptor: tensor {t['path']!r} has unknown dtype")
    nbytes = math.prod(t["shape"]) * ITEMSIZES[t["dtype"]]
    start, end = t["offset"], t["offset"] + t["nbytes"]
    if nbytes != t["nbytes"] or start < 0 or end > size:
        raise SnapdError(f"descriptor: tensor {t['path']!r} lies outside its "
                         f"{size}-byte slot or disagrees with its shape")
    return start, end


def from_descriptor(desc: Dict[str, Any], slot: memoryview) -> SnapshotPlan:
    """Rebuild a plan over a mapped slot; every field is checked first (the schema a
    reader applies) and every offset bounds-checked."""
    check_descriptor(desc)
    objects = []
    for obj in desc["objects"]:
        tensors = []
        for t in obj["tensors"]:
            ref, reuse = t.get("ref"), t.get("reuse")
            start, end = (0, 0) if ref is not None or reuse is not None \
                else tensor_extent(t, len(slot))
            tensors.append(TensorSource(t["path"], t["dtype"], list(t["shape"]),
                                        slot[start:end], t.get("device", "cpu"),
                                        shard=t.get("shard"), ref=ref, reuse=reuse,
                                        frozen=t.get("frozen") is True))
        objects.append(ObjectPlan(obj["name"], obj["type"], obj["skeleton"], tensors,
                                  obj.get("metadata")))
    return SnapshotPlan(desc["run"], desc["step"], desc["lineage"], objects, desc["rng"],
                        desc.get("cursor"), desc.get("metric"), desc.get("data_version"),
                        desc.get("rank", 0), desc.get("world_size", 1),
                        desc.get("session", "none"),
                        [str(n) for n in desc.get("supersedes") or []], desc.get("base"))
