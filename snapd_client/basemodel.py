"""The base model a fine-tuning run trains on: its reference, and snapd's own digest.

A fine-tuned adapter or head means nothing without the exact base weights it was
trained over, and a model name (``"llama-3-8b"``) or a hub revision may later point
at other weights. So the user names the base (:class:`Base`: a name and a revision
string, both free text) and snapd adds a digest it computes itself from the live
frozen tensors (:func:`base_digest`). Every manifest carries ``{name, revision,
digest}`` (docs/format.md, "Base model"); restore and warm start refuse a snapshot
whose base digest differs from the live one (:func:`check_same_base`), naming both
revisions: resuming an adapter over other base weights trains something else.

**The digest** is xxh3-128 (32 lowercase hex digits) over every frozen tensor leaf
of the tracked modules (:mod:`snapd_client.frozen`'s rule: a module tensor no
tracked optimizer steps and that does not require grad), sorted by (object name,
state-dict path); per leaf, each field length-prefixed (little-endian u64): the
path (``.layer.weight``, UTF-8, without the object's name, so renaming the tracked
object keeps the digest), the dtype name, the shape, then the raw bytes in C order.
A CUDA tensor is copied to the CPU 64 MiB at a time.

**Cost**: one pass over the base's bytes (about 0.1 s per GiB of CPU tensors on
this project's machine; a CUDA base is bounded by the copy to the host), at ``track()`` (or the ``track()`` after
``Client(base=...)``) and again at ``restore()``, which compares. Never per
snapshot: a snapshot carries the value computed at track() or restore(), so load the
base weights before ``track(..., base=...)``.

In a job of many ranks each rank digests its own pieces (a DTensor's local shard),
and only a one-rank restore compares.
"""

from __future__ import annotations

import logging
import struct
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

import torch
import xxhash

from snapd.errors import IncompatibleState, InvalidOption
from snapd.format import dtype_name
from snapd_client.frozen import frozen_flags, trainable_ptrs
from snapd_client.state import flatten

logger = logging.getLogger(__name__)

MAX_FIELD = 1024        # characters of a name or a revision (format.MAX_NAME)
PIECE = 64 << 20        # bytes of a CUDA tensor copied to the host at a time
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class Base:
    """The base model's reference, as the user names it: ``name`` (``"llama-3-8b"``)
    and ``revision`` (a hub commit, a tag, a file's hash): non-empty strings of at
    most 1024 characters. snapd adds the digest."""

    name: str
    revision: str

    def __post_init__(self) -> None:
        for field in ("name", "revision"):
            value = getattr(self, field)
            if not isinstance(value, str) or not value or len(value) > MAX_FIELD:
                raise InvalidOption(f"base {field}={value!r}: a non-empty string of at "
                                    f"most {MAX_FIELD} characters (the base model's "
                                    f"{field})", field=f"base.{field}")

    @classmethod
    def of(cls, value: Any) -> "Base":
        """A :class:`Base`, a ``{"name", "revision"}`` dict, or a ``(name, revision)``
        tuple, as a Base."""
        if isinstance(value, Base):
            return value
        if isinstance(value, Mapping):
            extra = sorted(set(value) - {"name", "revision"})
            if extra:
                raise InvalidOption(f"base={dict(value)!r}: unknown field {extra[0]!r}; "
                                    "give name and revision (snapd computes the digest)",
                                    field=f"base.{extra[0]}")
            return cls(value.get("name"), value.get("revision"))
        if isinstance(value, tuple) and len(value) == 2:
            return cls(*value)
        raise InvalidOption(f"base={value!r}: give Base(name, revision), a dict with "
                            "name and revision, or a (name, revision) tuple (base is "
                            "reserved for the base model: track an object of that name "
                            "under another)", field="base")

    def label(self) -> str:
        return f"{self.name}@{self.revision}"


def _field(h: Any, data: bytes) -> None:
    h.update(_U64.pack(len(data)))
    h.update(data)


def _feed_bytes(h: Any, t: torch.Tensor) -> None:
    """The tensor's raw bytes in C order, a piece at a time (a CUDA piece copied)."""
    t = t.detach().resolve_conj().resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    h.update(_U64.pack(t.numel() * t.element_size()))
    if t.numel() == 0:
        return
    flat = t.reshape(-1).view(torch.uint8)
    for start in range(0, flat.numel(), PIECE):
        piece = flat[start:start + PIECE]
        if piece.device.type != "cpu":
            piece = piece.cpu()
        h.update(memoryview(piece.numpy()))


def base_digest(leaves: Iterable[Tuple[str, torch.Tensor]]) -> str:
    """xxh3-128 (32 hex digits) of ``(path, tensor)`` leaves, in the order given:
    path, dtype name, shape and raw bytes of each (module docstring)."""
    h = xxhash.xxh3_128()
    for path, t in leaves:
        _field(h, path.encode("utf-8"))
        _field(h, dtype_name(t.dtype).encode("ascii"))
        _field(h, b"".join(_U64.pack(int(d)) for d in t.shape))
        _feed_bytes(h, t)
    return h.hexdigest()


def frozen_leaves(tracked: Mapping[str, Any]) -> List[Tuple[str, torch.Tensor]]:
    """The frozen tensor leaves of the tracked modules as ``(path, tensor)``, sorted
    by (object name, path): what :func:`base_digest` covers."""
    trainable = trainable_ptrs(tracked)
    found = []
    for name in sorted(tracked):
        obj = tracked[name]
        if not isinstance(obj, torch.nn.Module):
            continue
        flat = flatten(obj.state_dict(), name)
        flags = frozen_flags(obj, flat.tensors, trainable)
        found += sorted(((path, t) for path, t, frozen in
                         zip(flat.paths, flat.tensors, flags) if frozen),
                        key=lambda leaf: leaf[0])
    return found


class LiveBase:
    """The base a client was given, and its digest over the client's tracked objects
    (``tracked`` is the client's own dict: objects tracked later count), computed
    when first asked for and kept until :meth:`forget`."""

    def __init__(self, ref: Base, tracked: Mapping[str, Any]) -> None:
        self.ref = ref
        self._tracked = tracked
        self._digest: Optional[str] = None

    def forget(self) -> None:
        """The next :meth:`record` digests again (objects tracked, weights loaded)."""
        self._digest = None

    def record(self) -> Dict[str, str]:
        """``{name, revision, digest}``: what a manifest carries."""
        if self._digest is None:
            self._digest = base_digest(frozen_leaves(self._tracked))
        return {"name": self.ref.name, "revision": self.ref.revision,
                "digest": self._digest}


def _label(base: Mapping[str, Any]) -> str:
    return f"{base.get('name')}@{base.get('revision')} (digest {base.get('digest')})"


def check_same_base(manifest: Mapping[str, Any], live: Optional[LiveBase], source: str) -> None:
    """Refuse (IncompatibleState, field ``base``) a snapshot whose base digest is not
    the live base's. A snapshot without a base, or a client without one, passes (the
    latter said in an info line): there is nothing to compare."""
    saved = manifest.get("base")
    if saved is None:
        return
    if live is None:
        logger.info(f"{source}: the snapshot was trained on base {_label(saved)}; this "
                    "client names no base (Client(..., base=...)), so it is not compared")
        return
    now = live.record()
    if saved.get("digest") == now["digest"]:
        return
    raise IncompatibleState(
        f"{source}: field base is {_label(saved)} but the live base is {_label(now)}: "
        "other frozen weights. The snapshot's trainable state was trained over its base "
        f"and means something else over another: load the base revision "
        f"{saved.get('revision')!r} of {saved.get('name')!r} before restore(), or start "
        "a new run on this base", path=source, field="base")
