"""Pieces of a saved tensor, and the piece this rank holds now: the overlap arithmetic.

A sharded tensor (a DTensor: FSDP2, tensor parallel) is saved as one entry per rank,
each its local piece at an offset in the global shape (docs/format.md, ``shard``). A
rank restores its piece now, which at another world size overlaps several saved ones:
the overlaps are DCP's (``create_read_items_for_chunk_list``, from the manifests'
shapes and offsets as DCP metadata), the copies are ours. A plain (unsharded) saved
tensor is one piece covering the whole of it, so a snapshot saved without sharding
restores into a sharded model and the other way round.

The piece a rank holds now comes from the live object's DTensor at that path (its
mesh and placements), or, for an optimizer before its first step (it has no state
yet), from the parameter the state belongs to: ``.state.<i>.*`` is parameter ``i`` of
the param groups, in order.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from snapd.errors import CorruptSnapshot
from snapd_client.replicas import is_dtensor

Box = Tuple[Tuple[int, ...], Tuple[int, ...]]  # (offset, shape) in the global tensor
_OPTIMIZER_STATE = re.compile(r"^\.state\.(\d+)\.")


@dataclass(frozen=True)
class Copy:
    """Copy ``lengths`` elements per dimension from saved piece ``piece`` at ``src``
    to the wanted piece at ``dst`` (offsets relative to each piece)."""

    piece: int
    src: Tuple[int, ...]
    dst: Tuple[int, ...]
    lengths: Tuple[int, ...]


def overlaps(name: str, global_shape: Sequence[int], pieces: Sequence[Box],
             want: Box, *, source: str) -> List[Copy]:
    """The copies that fill ``want`` from the saved ``pieces`` (distinct boxes).
    Raises CorruptSnapshot when the pieces leave part of ``want`` uncovered."""
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata,
                                                       TensorProperties,
                                                       TensorStorageMetadata)
    from torch.distributed.checkpoint.planner_helpers import \
        create_read_items_for_chunk_list
    saved = TensorStorageMetadata(
        properties=TensorProperties(), size=torch.Size(global_shape),
        chunks=[ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s))
                for o, s in pieces])
    local = ChunkStorageMetadata(offsets=torch.Size(want[0]), sizes=torch.Size(want[1]))
    copies = [Copy(item.storage_index.index, tuple(item.storage_offsets),
                   tuple(item.dest_offsets), tuple(item.lengths))
              for item in create_read_items_for_chunk_list(name, saved, [local])]
    covered = sum(_numel(c.lengths) for c in copies)
    if covered != _numel(want[1]):
        raise CorruptSnapshot(f"{source}: the saved pieces of {name} cover {covered} of "
                              f"the {_numel(want[1])} elements at offset {list(want[0])} "
                              f"shape {list(want[1])} this rank needs; the parts disagree "
                              "on the tensor's sharding, use an older snapshot",
                              path=source, field=f"{name}.shard")
    return copies


def assemble(shape: Sequence[int], dtype: torch.dtype, data: Sequence[torch.Tensor],
             copies: Sequence[Copy]) -> torch.Tensor:
    """The wanted piece, filled from the saved pieces' ``data`` by ``copies``."""
    out = torch.empty(list(shape), dtype=dtype)
    for c in copies:
        _region(out, c.dst, c.lengths).copy_(_region(data[c.piece], c.src, c.lengths))
    return out


def _region(t: torch.Tensor, offsets: Sequence[int],
            lengths: Sequence[int]) -> torch.Tensor:
    for dim, (o, n) in enumerate(zip(offsets, lengths)):
        t = t.narrow(dim, o, n)
    return t


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def local_box(template: Any) -> Box:
    """The piece of ``template`` (a DTensor) this rank holds: offset and shape."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    shape, offset = compute_local_shape_and_global_offset(
        template.shape, template.device_mesh, template.placements)
    return tuple(offset), tuple(shape)


def as_template(local: torch.Tensor, template: Any) -> Any:
    """``local`` as a DTensor laid out like ``template`` (no collective: every rank
    passes its own piece, and the global shape and stride are given)."""
    from torch.distributed.tensor import DTensor
    device = template.to_local().device
    return DTensor.from_local(local.to(device), template.device_mesh, template.placements,
                              run_check=False, shape=template.shape,
                              stride=template.stride())


def templates(obj: Any, live: Dict[str, torch.Tensor]) -> Dict[str, Any]:
    """The DTensors a restored leaf of ``obj`` takes its layout from, by path: the
    live state's own, and for an optimizer also each parameter's, under the key
    ``param:<i>`` (see :func:`template_for`)."""
    found = {path: t for path, t in live.items() if is_dtensor(t)}
    if isinstance(obj, torch.optim.Optimizer):
        params = [p for g in obj.param_groups for p in g["params"]]
        found.update({f"param:{i}": p for i, p in enumerate(params) if is_dtensor(p)})
    return found


def template_for(path: str, global_shape: Sequence[int],
                 found: Dict[str, Any]) -> Optional[Any]:
    """The live DTensor for ``path``, else, for optimizer state, its parameter's when
    the saved global shape is the parameter's (``step`` counters are not sharded)."""
    if path in found:
        return found[path]
    match = _OPTIMIZER_STATE.match(path)
    param = found.get(f"param:{match.group(1)}") if match else None
    if param is not None and list(param.shape) == list(global_shape):
        return param
    return None
