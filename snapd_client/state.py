"""Flatten a live state dict into tensor leaves and a msgpack skeleton.

A tracked object's ``state_dict()`` is a tree of dicts, lists and tuples whose leaves
are tensors or plain values (an optimizer's, a scheduler's, a StatefulDataLoader's).
The skeleton is that tree packed with msgpack, each tensor replaced by an extension
value holding its index in the tensor list. Types msgpack has no word for get their
own extension codes (listed in docs/format.md); anything else is refused with the
path of the leaf, because the only way to store an arbitrary object is pickle, which
snapd never loads.

This is the training side of the skeleton: it walks live objects. The codec itself
(packing, the extension codes, decoding with :func:`unflatten`) is part of the
format and lives in :mod:`snapd.skeleton`, where the operator commands find it.

A DTensor leaf (FSDP2, tensor parallelism) is stored as its local piece
(``to_local()``, a view: no gather) with ``shard``, where the piece lies in the whole
tensor, and ``writer``, the rank that writes it when the piece is replicated over a
mesh dimension (snapd_client/replicas.py). Everything downstream of :func:`flatten`
sees plain local tensors; :func:`tensor_meta` reports a DTensor leaf's whole (global)
shape, which restore checks against: the piece a rank holds depends on the world size.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple

import msgpack
import numpy as np
import torch

from snapd.errors import UnsupportedState
from snapd.format import dtype_name
from snapd.skeleton import (EXT_DEVICE, EXT_DTYPE, EXT_NDARRAY, EXT_NPSCALAR, EXT_ORDERED,
                            EXT_TENSOR, EXT_TUPLE, TENSOR_INDEX, pack)
from snapd_client.replicas import dtensor_piece, dtensor_type

_INT_MIN, _INT_MAX = -(1 << 63), (1 << 64) - 1
_NAMED_DTYPES: Set[torch.dtype] = set()   # dtypes dtype_name() has accepted
_TENSOR_EXTS: List[msgpack.ExtType] = []   # EXT_TENSOR values by index, made once


_TENSOR_EXTS_GROWING = threading.Lock()


def _tensor_ext(index: int) -> msgpack.ExtType:
    """The skeleton's EXT_TENSOR value for tensor ``index`` (immutable, so shared)."""
    if index >= len(_TENSOR_EXTS):
        with _TENSOR_EXTS_GROWING:   # entry i must hold index i
            while len(_TENSOR_EXTS) <= index:
                _TENSOR_EXTS.append(msgpack.ExtType(EXT_TENSOR,
                                                    TENSOR_INDEX.pack(len(_TENSOR_EXTS))))
    return _TENSOR_EXTS[index]


@dataclass
class Flat:
    """One object's state, split: the skeleton bytes, its tensors and their paths.
    For a DTensor leaf ``tensors[i]`` is its local piece, ``shards[i]`` its place in
    the whole ({global_shape, offset}) and ``writers[i]`` the rank writing it; both
    None for a plain tensor. ``leaves[i]`` is the leaf as the state dict holds it
    (the DTensor itself): what a restore takes a sharded tensor's layout from."""

    skeleton: bytes
    tensors: List[torch.Tensor] = field(default_factory=list)
    paths: List[str] = field(default_factory=list)
    shards: List[Optional[Dict[str, List[int]]]] = field(default_factory=list)
    writers: List[Optional[int]] = field(default_factory=list)
    leaves: List[torch.Tensor] = field(default_factory=list)


class _Flattener:
    def __init__(self, name: str) -> None:
        self.name = name
        self.tensors: List[torch.Tensor] = []
        self.paths: List[str] = []
        self.shards: List[Optional[Dict[str, List[int]]]] = []
        self.leaves: List[torch.Tensor] = []
        self.writers: List[Optional[int]] = []
        self.dtensors = dtensor_type()   # once per flatten, not per leaf

    def walk(self, value: Any, path: str) -> Any:
        if isinstance(value, torch.Tensor):
            return self._add(value, path)
        if isinstance(value, np.ndarray):
            index = self._add(torch.from_numpy(value), path).data
            return msgpack.ExtType(EXT_NDARRAY, index)
        if isinstance(value, dict):
            items = [(self._key(k, path), self.walk(v, f"{path}.{k}"))
                     for k, v in value.items()]
            if type(value) is dict:
                return dict(items)
            return msgpack.ExtType(EXT_ORDERED, pack([list(kv) for kv in items]))
        if isinstance(value, list):
            return [self.walk(v, f"{path}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, tuple):
            items = [self.walk(v, f"{path}[{i}]") for i, v in enumerate(value)]
            return msgpack.ExtType(EXT_TUPLE, pack(items))
        return self._plain(value, path)

    def _add(self, tensor: torch.Tensor, path: str) -> bytes:
        # Per tensor, at every snapshot (1344 tensors for a 1 GiB transformer): the
        # checks are cached by dtype, and detach() (a new tensor object) is only paid
        # by a leaf autograd tracks.
        shard = writer = None
        self.leaves.append(tensor)
        if self.dtensors is not None and isinstance(tensor, self.dtensors):
            tensor, shard, writer = dtensor_piece(tensor, f"{self.name}{path}")
        if tensor.layout != torch.strided or tensor.is_quantized:
            raise UnsupportedState(f"{self.name}{path}: {tensor.layout} tensors cannot be saved; "
                                   "convert to dense in state_dict()")
        if tensor.dtype not in _NAMED_DTYPES:
            dtype_name(tensor.dtype)   # raises for a dtype the format has no name for
            _NAMED_DTYPES.add(tensor.dtype)
        self.tensors.append(tensor.detach() if tensor.requires_grad else tensor)
        self.paths.append(path)
        self.shards.append(shard)
        self.writers.append(writer)
        return _tensor_ext(len(self.tensors) - 1)

    def _key(self, key: Any, path: str) -> Any:
        if key is None or isinstance(key, (str, int, float, bool)):
            return key
        raise UnsupportedState(f"{self.name}{path}: dict key {key!r} of type {type(key).__name__} "
                               "cannot be saved; use str or int keys")

    def _plain(self, value: Any, path: str) -> Any:
        if isinstance(value, np.generic):  # before float: np.float64 subclasses float
            return msgpack.ExtType(EXT_NPSCALAR, pack([value.dtype.str, value.tobytes()]))
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


def flatten(state: Any, name: str) -> Flat:
    """Split one state dict; raises UnsupportedState naming the first bad leaf."""
    if not isinstance(state, dict):
        raise UnsupportedState(f"{name}: state_dict() returned a {type(state).__name__}; "
                               "snapd stores a mapping (return a dict)")
    flattener = _Flattener(name)
    skeleton = pack(flattener.walk(state, ""))
    return Flat(skeleton, flattener.tensors, flattener.paths, flattener.shards,
                flattener.writers, flattener.leaves)


def tensor_meta(flat: Flat) -> List[Tuple[str, str, List[int]]]:
    """(path, dtype, shape) of each tensor leaf: what compatibility is checked on.
    A DTensor leaf's shape is the whole tensor's (``shard.global_shape``), not its local
    piece's: a snapshot fits at another world size, where the pieces differ."""
    shards = flat.shards or [None] * len(flat.paths)
    return [(p, dtype_name(t.dtype), list(s["global_shape"]) if s else list(t.shape))
            for p, t, s in zip(flat.paths, flat.tensors, shards)]
