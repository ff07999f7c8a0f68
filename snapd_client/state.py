"""Flatten a state dict into tensor leaves and a msgpack skeleton, and back.

A tracked object's ``state_dict()`` is a tree of dicts, lists and tuples whose leaves
are tensors or plain values (an optimizer's, a scheduler's, a StatefulDataLoader's).
The skeleton is that tree packed with msgpack, each tensor replaced by an extension
value holding its index in the tensor list. Types msgpack has no word for get their
own extension codes (listed in docs/format.md); anything else is refused with the
path of the leaf, because the only way to store an arbitrary object is pickle, which
snapd never loads.
"""

from __future__ import annotations

import re
import struct
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

import msgpack
import numpy as np
import torch

from snapd.errors import CorruptSnapshot, UnsupportedState
from snapd.format import DTYPES, check_skeleton, dtype_name

EXT_TENSOR = 1     # u32 index into the object's tensor list
EXT_TUPLE = 2      # msgpack array of the items
EXT_DTYPE = 3      # dtype name, utf-8
EXT_NDARRAY = 4    # u32 index; the tensor comes back as a numpy array
EXT_NPSCALAR = 5   # msgpack [dtype name, raw bytes]
EXT_DEVICE = 6     # device string, utf-8
EXT_ORDERED = 7    # msgpack array of [key, value] pairs (OrderedDict, order kept)

_INDEX = struct.Struct("<I")
_INT_MIN, _INT_MAX = -(1 << 63), (1 << 64) - 1


@dataclass
class Flat:
    """One object's state, split: the skeleton bytes, its tensors and their paths."""

    skeleton: bytes
    tensors: List[torch.Tensor] = field(default_factory=list)
    paths: List[str] = field(default_factory=list)


class _Flattener:
    def __init__(self, name: str) -> None:
        self.name = name
        self.tensors: List[torch.Tensor] = []
        self.paths: List[str] = []

    def walk(self, value: Any, path: str) -> Any:
        if isinstance(value, torch.Tensor):
            return msgpack.ExtType(EXT_TENSOR, self._add(value, path))
        if isinstance(value, np.ndarray):
            return msgpack.ExtType(EXT_NDARRAY, self._add(torch.from_numpy(value), path))
        if isinstance(value, dict):
            items = [(self._key(k, path), self.walk(v, f"{path}.{k}"))
                     for k, v in value.items()]
            if type(value) is dict:
                return dict(items)
            return msgpack.ExtType(EXT_ORDERED, _pack([list(kv) for kv in items]))
        if isinstance(value, list):
            return [self.walk(v, f"{path}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, tuple):
            items = [self.walk(v, f"{path}[{i}]") for i, v in enumerate(value)]
            return msgpack.ExtType(EXT_TUPLE, _pack(items))
        return self._plain(value, path)

    def _add(self, tensor: torch.Tensor, path: str) -> bytes:
        if tensor.layout != torch.strided or tensor.is_quantized:
            raise UnsupportedState(f"{self.name}{path}: {tensor.layout} tensors cannot be saved; "
                                   "convert to dense in state_dict()")
        dtype_name(tensor.dtype)
        self.tensors.append(tensor.detach())
        self.paths.append(path)
        return _INDEX.pack(len(self.tensors) - 1)

    def _key(self, key: Any, path: str) -> Any:
        if key is None or isinstance(key, (str, int, float, bool)):
            return key
        raise UnsupportedState(f"{self.name}{path}: dict key {key!r} of type {type(key).__name__} "
                               "cannot be saved; use str or int keys")

    def _plain(self, value: Any, path: str) -> Any:
        if isinstance(value, np.generic):  # before float: np.float64 subclasses float
            return msgpack.ExtType(EXT_NPSCALAR, _pack([value.dtype.str, value.tobytes()]))
        if value is None or type(value) in (bool, float, str, bytes):
            return value
        if isinstance(value, int):
            if not _INT_MIN <= value <= _INT_MAX:
                raise UnsupportedState(f"{self.name}{path}: integer {value} exceeds 64 bits")
            return int(value)  # an IntEnum is stored as its value
        if isinstance(value, torch.dtype):
            return msgpack.ExtType(EXT_DTYPE, dtype_name(value).encode())
        if isinstance(value, torch.device):
            return msgpack.ExtType(EXT_DEVICE, str(value).encode())
        raise UnsupportedState(
            f"{self.name}{path}: a {type(value).__module__}.{type(value).__qualname__} "
            "cannot be stored without pickle, which snapd never loads. Return plain "
            "values (numbers, strings, lists, dicts, tensors) from state_dict()")


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True, strict_types=True)


def flatten(state: Any, name: str) -> Flat:
    """Split one state dict; raises UnsupportedState naming the first bad leaf."""
    if not isinstance(state, dict):
        raise UnsupportedState(f"{name}: state_dict() returned a {type(state).__name__}; "
                               "snapd stores a mapping (return a dict)")
    flattener = _Flattener(name)
    skeleton = _pack(flattener.walk(state, ""))
    return Flat(skeleton, flattener.tensors, flattener.paths)


def unflatten(skeleton: bytes, tensors: Optional[List[torch.Tensor]], *,
              source: str) -> Any:
    """Rebuild the state tree from its skeleton and loaded tensors. ``tensors=None``
    gives the tree with None for every tensor: what checks can see before reading.

    The bytes are scanned first (snapd.format.check_skeleton: a map, nesting and
    lengths bounded) so that the decoder below, which recurses once per nested
    extension, never meets a skeleton deep enough to exhaust the C stack."""
    check_skeleton(skeleton, path=source, field="skeleton")

    def index(data: bytes) -> Optional[int]:
        (i,) = _INDEX.unpack(data)
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
            return DTYPES[data.decode()]
        if code == EXT_DEVICE:
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


def tensor_meta(flat: Flat) -> List[Tuple[str, str, List[int]]]:
    """(path, dtype, shape) of each tensor leaf: what compatibility is checked on."""
    return [(p, dtype_name(t.dtype), list(t.shape)) for p, t in zip(flat.paths, flat.tensors)]
