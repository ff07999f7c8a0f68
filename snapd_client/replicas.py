"""Which rank writes each tensor of a multi-rank snapshot, decided without a collective.

A DDP job holds the model and the optimizer state on every rank, bit for bit alike;
writing them from every rank would cost N copies on disk. So a *replicated* leaf is
written by one rank only, and the other ranks' parts hold a ``ref`` entry naming that
rank (docs/format.md, version 3): no bytes staged, none written. Replicated are

1. the parameters of a tracked ``DistributedDataParallel`` module (its buffers too
   when it broadcasts them, ``broadcast_buffers=True``);
2. the state tensors (``.state.*``) of a tracked optimizer whose parameters all
   belong to tracked DDP modules;
3. the local piece of a DTensor replicated over a mesh dimension: written by the
   rank at coordinate 0 on each ``Replicate`` dimension (:func:`dtensor_piece`).

For 1 and 2 every rank computes the same assignment from what it holds alone
(:func:`assign`): the leaves sorted by (-bytes, object, path), each given to the
least-loaded rank so far (ties: the lowest). Nothing here talks to another rank: the
training thread never waits on one. The global commit checks that every ``ref``
resolves (snapd/globalcommit.py), so ranks that disagree (a model wrapped differently
on one rank) get an uncommitted snapshot and an error naming the leaf, never a
snapshot that loses tensors.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from snapd.errors import UnsupportedState

try:  # a torch built without distributed has no DDP
    from torch.nn.parallel import DistributedDataParallel
except ImportError:  # pragma: no cover
    DistributedDataParallel = None  # type: ignore[assignment,misc]


def dtensor_type() -> Optional[type]:
    """The DTensor class if this program imported it, else None. Its module is looked
    up, never imported: a program that made a DTensor imported it, and the import
    costs 0.4 s."""
    module = sys.modules.get("torch.distributed.tensor")
    return None if module is None else module.DTensor


def is_dtensor(value: Any) -> bool:
    """Whether ``value`` is a DTensor (see :func:`dtensor_type`)."""
    cls = dtensor_type()
    return cls is not None and isinstance(value, cls)


# --- DTensor leaves ----------------------------------------------------------------------

def mesh_owner(mesh_ranks: torch.Tensor, coordinate: Sequence[int],
               replicate_dims: Sequence[int]) -> int:
    """The global rank that writes a piece held at ``coordinate`` of a mesh whose
    ranks are ``mesh_ranks``: the same coordinate, 0 on each replicated dimension."""
    owner = list(coordinate)
    for d in replicate_dims:
        owner[d] = 0
    return int(mesh_ranks[tuple(owner)])


def dtensor_piece(dt: Any, where: str) -> Tuple[torch.Tensor, Dict[str, List[int]], int]:
    """A DTensor leaf as this rank stores it: its local piece (a view, no gather),
    ``shard`` ({global_shape, offset} of the piece) and the global rank that writes it.

    A ``Partial`` placement (pending reductions) is refused: its pieces are not the
    tensor's values until reduced."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    mesh, placements = dt.device_mesh, dt.placements
    if any(p.is_partial() for p in placements):
        raise UnsupportedState(f"{where}: a DTensor with a Partial placement "
                               f"({placements}) holds unreduced values; redistribute it "
                               "to Shard or Replicate in state_dict()", field=where)
    _, offset = compute_local_shape_and_global_offset(dt.shape, mesh, placements)
    coordinate = mesh.get_coordinate()
    local = dt.to_local().detach()
    shard = {"global_shape": list(dt.shape), "offset": [int(o) for o in offset]}
    if coordinate is None:   # this rank is not in the mesh: it holds an empty piece
        return local, shard, torch.distributed.get_rank()
    replicated = [d for d, p in enumerate(placements) if p.is_replicate()]
    return local, shard, mesh_owner(mesh.mesh, coordinate, replicated)


def local_data_ptr(t: torch.Tensor) -> int:
    """Where a tensor's (local) bytes start: a DTensor's are its local piece's."""
    return t.to_local().data_ptr() if is_dtensor(t) else t.data_ptr()


# --- DDP replicas: which leaves, and who writes each -------------------------------------

def _ddp_modules(tracked: Mapping[str, Any]) -> Dict[str, Any]:
    if DistributedDataParallel is None:
        return {}
    return {n: o for n, o in tracked.items() if isinstance(o, DistributedDataParallel)}


def _is_zero(optimizer: Any) -> bool:
    """ZeroRedundancyOptimizer shards its state across ranks: never replicated."""
    return type(optimizer).__name__ == "ZeroRedundancyOptimizer"


def replicated_leaves(tracked: Mapping[str, Any], objects: Sequence[Any]) -> List[bool]:
    """One flag per leaf of ``objects`` (captured objects: ``name``, ``paths``,
    ``tensors``, in order): whether it is a DDP replica (cases 1 and 2 above)."""
    ddp = _ddp_modules(tracked)
    if not ddp:
        return [False for obj in objects for _ in obj.paths]
    params = {id(p) for m in ddp.values() for p in m.parameters()}
    ptrs: Dict[str, set] = {}
    for name, module in ddp.items():
        held = list(module.parameters()) + \
            (list(module.buffers()) if module.broadcast_buffers else [])
        ptrs[name] = {t.data_ptr() for t in held if t.numel()}
    flags: List[bool] = []
    for obj in objects:
        live = tracked.get(obj.name)
        if obj.name in ptrs:
            flags += [t.numel() > 0 and t.data_ptr() in ptrs[obj.name] for t in obj.tensors]
        elif isinstance(live, torch.optim.Optimizer) and not _is_zero(live) and \
                all(id(p) in params for g in live.param_groups for p in g["params"]):
            flags += [path.startswith(".state.") for path in obj.paths]
        else:
            flags += [False] * len(obj.paths)
    return flags


def assign(items: Sequence[Tuple[int, str, str]], world_size: int) -> Dict[Tuple[str, str], int]:
    """The writer of each replicated leaf ``(nbytes, object, path)``: sorted by
    (-nbytes, object, path), each to the least-loaded rank (ties: the lowest)."""
    loads = [0] * world_size
    owners: Dict[Tuple[str, str], int] = {}
    for nbytes, obj, path in sorted(items, key=lambda i: (-i[0], i[1], i[2])):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        loads[rank] += nbytes
        owners[(obj, path)] = rank
    return owners


def with_writers(tracked: Mapping[str, Any], objects: Sequence[Any], rank: int,
                 world_size: int) -> Tuple[Any, ...]:
    """``objects`` with each leaf's ``refs`` set: None where this rank writes it, else
    the rank that does. A job of one rank writes everything."""
    if world_size <= 1:
        return tuple(dataclasses.replace(o, refs=(None,) * len(o.paths)) for o in objects)
    flags = iter(replicated_leaves(tracked, objects))
    marked = [(obj, [next(flags) for _ in obj.paths]) for obj in objects]
    owners = assign([(t.numel() * t.element_size(), obj.name, path)
                     for obj, fl in marked
                     for path, t, f in zip(obj.paths, obj.tensors, fl) if f], world_size)
    out = []
    for obj, fl in marked:
        refs = []
        for path, f, ref in zip(obj.paths, fl, obj.refs):   # ref: a DTensor's, or None
            writer = owners[(obj.name, path)] if f else ref
            refs.append(None if writer is None or writer == rank else writer)
        out.append(dataclasses.replace(obj, refs=tuple(refs)))
    return tuple(out)
