"""Frozen tensors, and which of them are unchanged since a snapshot wrote their bytes.

Fine-tuning trains a small part of a large model: the base is frozen. A frozen
tensor that has not changed since the last snapshot that copied it need not be
copied, staged or written again: the new snapshot refers to the bytes already on
disk (docs/format.md, "Shared files"). This module decides, leaf by leaf, on the
training thread, cheaply, and errs towards copying.

**Frozen** (:func:`trainable_ptrs`, :func:`frozen_flags`): a tensor of a tracked
``nn.Module`` that no tracked optimizer steps and that does not require grad.
Buffers count as frozen: a buffer forward changes (a batch norm's running mean) is
changed in place, which the version check below sees.

**Unchanged** (:class:`Unchanged`): since the snapshot that last copied it (its
*home*), the tensor has the same storage (``data_ptr``), shape, dtype, strides and
offset; the same version counter (every in-place write through the tensor or a view
of it bumps it); and the same *fingerprint*, an xxh3 of up to 16 windows of 4 KiB
spread over its bytes. The fingerprint is what sees a write through ``.data`` (which
has a version counter of its own): ``p.data.add_(x)`` changes every window. A write
through ``.data`` that touches only bytes between the windows is not seen; snapd
documents that limit (docs/operations.md) rather than hash a base on every step.

A home must still be able to hold the bytes: a snapshot whose write failed, or that
was skipped, is no home, and its tensors are copied again. A pending one is: the
daemon writes one run's snapshots in order, and a snapshot that refers to a home
that then fails fails too (its tensors are copied by the next).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import torch
import xxhash

from snapd_client.replicas import local_data_ptr

WINDOW = 4096
WINDOWS = 16


def trainable_ptrs(tracked: Mapping[str, Any]) -> set:
    """The ``data_ptr()`` of every tensor training updates: each parameter of a
    tracked module that requires grad, and each one in a tracked optimizer's groups."""
    ptrs = {local_data_ptr(p) for o in tracked.values()
            if isinstance(o, torch.optim.Optimizer)
            for g in o.param_groups for p in g["params"]}
    ptrs |= {local_data_ptr(p) for o in tracked.values() if isinstance(o, torch.nn.Module)
             for p in o.parameters() if p.requires_grad}
    return ptrs


def frozen_flags(obj: Any, tensors: Sequence[torch.Tensor], trainable: set
                 ) -> Tuple[bool, ...]:
    """Per leaf of ``obj``'s state: frozen (a module's tensor nothing trains)."""
    if not isinstance(obj, torch.nn.Module):
        return (False,) * len(tensors)
    return tuple(t.numel() > 0 and local_data_ptr(t) not in trainable for t in tensors)


def fingerprint(t: torch.Tensor) -> int:
    """xxh3-64 of up to WINDOWS windows of WINDOW bytes spread over ``t``'s bytes
    (all of them when it is smaller), first and last window included. ``t`` is
    contiguous. A CUDA tensor's windows come over in one small copy."""
    flat = t.detach().reshape(-1).view(torch.uint8)
    n = flat.numel()
    starts = [0] if n <= WINDOW * WINDOWS else \
        [i * ((n - WINDOW) // (WINDOWS - 1)) for i in range(WINDOWS - 1)] + [n - WINDOW]
    width = n if len(starts) == 1 else WINDOW
    if flat.device.type != "cpu":   # one gather, one small copy
        flat = torch.cat([flat[s:s + width] for s in starts]).cpu()
        starts = [i * width for i in range(len(starts))]
    view = memoryview(flat.numpy())
    digest = xxhash.xxh3_64()
    for s in starts:
        digest.update(view[s:s + width])
    return digest.intdigest()


@dataclass(frozen=True)
class _Seen:
    """A leaf as it was when its home copied it."""

    ptr: int
    version: int
    layout: Tuple[Any, ...]   # shape, dtype, strides, storage offset, device
    print: int
    home: str                 # the snapshot that holds its bytes
    handle: Any               # that snapshot's handle: a failure unmakes the home


def _layout(t: torch.Tensor) -> Tuple[Any, ...]:
    return (tuple(t.shape), t.dtype, t.stride(), t.storage_offset(), str(t.device))


class Unchanged:
    """Which frozen leaves each snapshot may refer to instead of copying; one per
    client. Keys are (object name, leaf path)."""

    def __init__(self) -> None:
        self._seen: Dict[Tuple[str, str], _Seen] = {}

    def forget(self) -> None:
        """Every leaf is copied by the next snapshot (after a restore, which writes
        the tensors, or when the state's layout changed)."""
        self._seen.clear()

    def homes(self, name: str, paths: Sequence[str], tensors: Sequence[torch.Tensor],
              frozen: Sequence[bool]) -> Tuple[Optional[str], ...]:
        """Per leaf: the snapshot whose bytes it still equals, or None to copy it."""
        return tuple(self._home((name, path), t) if is_frozen else None
                     for path, t, is_frozen in zip(paths, tensors, frozen))

    def _home(self, key: Tuple[str, str], t: torch.Tensor) -> Optional[str]:
        seen = self._seen.get(key)
        if seen is None:
            return None
        handle = seen.handle
        if handle is not None and (handle.failed or handle.skipped):
            del self._seen[key]
            return None
        if not t.is_contiguous() or t.data_ptr() != seen.ptr or \
                t._version != seen.version or _layout(t) != seen.layout or \
                fingerprint(t) != seen.print:
            del self._seen[key]
            return None
        return seen.home

    def copied(self, name: str, paths: Sequence[str], tensors: Sequence[torch.Tensor],
               frozen: Sequence[bool], homes: Sequence[Optional[str]], snapshot: str,
               handle: Any) -> None:
        """Record the frozen leaves ``snapshot`` copies (``homes[i]`` None) as held
        there from now on; the fingerprint is of the bytes copied."""
        for path, t, is_frozen, home in zip(paths, tensors, frozen, homes):
            if not is_frozen or home is not None:
                continue
            if not t.is_contiguous():
                self._seen.pop((name, path), None)
                continue
            self._seen[(name, path)] = _Seen(t.data_ptr(), t._version, _layout(t),
                                             fingerprint(t), snapshot, handle)
