"""The skeleton codec: a state dict's tree packed as msgpack, and rebuilt from it.

A tracked object's ``state_dict()`` is a tree of dicts, lists and tuples whose leaves
are tensors or plain values. On disk (docs/format.md, "Skeleton extension types") the
tree is one msgpack value, each tensor replaced by an extension value holding its
index in the object's tensor list, and types msgpack has no word for carried by
their own extension codes (``snapd.format.EXT_*``).

Why here and not with the client: the skeleton is part of the snapshot format, and
the operator commands (``verify``, ``diff``, ``export``) decode it without a training
process. The training side, which builds skeletons from live objects, is
``snapd_client/state.py``; it packs with :func:`pack` and :data:`TENSOR_INDEX` below.
Validation of the bytes (depth, lengths) is ``snapd.format.check_skeleton``, run
before any decoder sees them. torch is imported only when a skeleton is decoded.
"""

from __future__ import annotations

import re
import struct
from collections import OrderedDict
from typing import Any, List, Optional

import msgpack
import numpy as np

from snapd import format as fmt
from snapd.errors import CorruptSnapshot
from snapd.format import (EXT_DEVICE, EXT_DTYPE, EXT_NDARRAY, EXT_NPSCALAR, EXT_ORDERED,
                          EXT_TENSOR, EXT_TUPLE, check_skeleton)

__all__ = ["EXT_DEVICE", "EXT_DTYPE", "EXT_NDARRAY", "EXT_NPSCALAR", "EXT_ORDERED",
           "EXT_TENSOR", "EXT_TUPLE", "TENSOR_INDEX", "pack", "unflatten"]

TENSOR_INDEX = struct.Struct("<I")  # the data of EXT_TENSOR and EXT_NDARRAY


def pack(obj: Any) -> bytes:
    """msgpack of a skeleton (or of an extension's inner value), as snapd writes it."""
    return msgpack.packb(obj, use_bin_type=True, strict_types=True)


def unflatten(skeleton: bytes, tensors: Optional[List[Any]], *, source: str) -> Any:
    """Rebuild the state tree from its skeleton and loaded tensors. ``tensors=None``
    gives the tree with None for every tensor: what checks can see before reading.

    The bytes are scanned first (snapd.format.check_skeleton: a map, nesting and
    lengths bounded) so that the decoder below, which recurses once per nested
    extension, never meets a skeleton deep enough to exhaust the C stack."""
    check_skeleton(skeleton, path=source, field="skeleton")

    def index(data: bytes) -> Optional[int]:
        (i,) = TENSOR_INDEX.unpack(data)
        if tensors is None:
            return None
        if i >= len(tensors):
            raise CorruptSnapshot(f"{source}: skeleton names tensor {i} of "
                                  f"{len(tensors)}", path=source, field="skeleton")
        return i

    def hook(code: int, data: bytes) -> Any:
        if code in (EXT_TENSOR, EXT_NDARRAY):
            i = index(data)
            if i is None:
                return None
            return tensors[i] if code == EXT_TENSOR else tensors[i].numpy()
        if code == EXT_TUPLE:
            return tuple(_unpack(data, hook))
        if code == EXT_ORDERED:
            return OrderedDict((k, v) for k, v in _unpack(data, hook))
        if code == EXT_DTYPE:
            return fmt.DTYPES[data.decode()]
        if code == EXT_DEVICE:
            import torch  # only a skeleton that holds a device needs it
            return torch.device(data.decode())
        if code == EXT_NPSCALAR:
            kind, raw = _unpack(data, hook)
            return _np_scalar(kind, raw, source)
        raise CorruptSnapshot(f"{source}: unknown extension code {code} in skeleton",
                              path=source, field="skeleton")

    try:
        return _unpack(skeleton, hook)
    except CorruptSnapshot:
        raise
    except Exception as e:
        raise CorruptSnapshot(f"{source}: skeleton does not decode: {e}", path=source,
                              field="skeleton") from e


# The numpy scalar kinds a state holds: bool, ints, floats, complex, datetimes, by
# their dtype.str. Anything else (objects, records, voids) is refused unread.
_NP_KIND = re.compile(r"^[<>|=](b1|[iu][1248]|f(2|4|8|16)|c(8|16|32)|[mM]8(\[\w+\])?)$")


def _np_scalar(kind: Any, raw: Any, source: str) -> Any:
    dtype = np.dtype(kind) if isinstance(kind, str) and _NP_KIND.match(kind) else None
    if dtype is None or not isinstance(raw, bytes) or len(raw) != dtype.itemsize:
        raise CorruptSnapshot(f"{source}: numpy scalar of kind {kind!r} in the skeleton "
                              "is not one snapd writes", path=source, field="skeleton")
    return np.frombuffer(raw, dtype=dtype)[0]


def _unpack(data: bytes, hook) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False, ext_hook=hook,
                           use_list=True)
