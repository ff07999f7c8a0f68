"""The collectives a multi-rank restore agrees with: bytes over a private gloo group.

Restore runs once, at start, on every rank, so it may use collectives; it uses a group
of its own (gloo, whatever backend the job trains on: NCCL would need the bytes on a
GPU) so that its traffic never interleaves with the job's. Only bytes cross it, as
uint8 tensors with their lengths: never ``*_object`` collectives, which unpickle what
another process sent.
"""

from __future__ import annotations

from typing import Any, List, Optional, Protocol

import torch


class Collective(Protocol):
    """What restore needs from the ranks: the real group, or a fake in unit tests."""

    rank: int
    world_size: int

    def broadcast_bytes(self, data: Optional[bytes], src: int = 0) -> bytes: ...

    def allgather_bytes(self, data: bytes) -> List[bytes]: ...


class GlooGroup:
    """A private gloo group over every rank of the default process group. Every rank
    must create it (``new_group`` is itself collective), in the same order.

    It is never destroyed by snapd: it lives until the job's
    ``dist.destroy_process_group()`` (or its exit). Destroying it right after the last
    exchange aborted a rank now and then (``terminate called without an active
    exception``, gloo tearing down pairs its peers were still closing)."""

    def __init__(self) -> None:
        import torch.distributed as dist
        self._dist = dist
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.group: Any = dist.new_group(backend="gloo")

    def broadcast_bytes(self, data: Optional[bytes], src: int = 0) -> bytes:
        """``data`` from rank ``src`` on every rank (others pass None)."""
        length = torch.tensor([len(data) if self.rank == src else 0], dtype=torch.int64)
        self._dist.broadcast(length, src=src, group=self.group)
        buf = _as_tensor(data) if self.rank == src else \
            torch.empty(int(length.item()), dtype=torch.uint8)
        if buf.numel():
            self._dist.broadcast(buf, src=src, group=self.group)
        return bytes(buf.numpy())

    def allgather_bytes(self, data: bytes) -> List[bytes]:
        """Every rank's ``data``, in rank order, on every rank."""
        lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        self._dist.all_gather(lengths, torch.tensor([len(data)], dtype=torch.int64),
                              group=self.group)
        sizes = [int(n.item()) for n in lengths]
        # all_gather needs equal sizes: pad to the longest, cut back after.
        longest = max(sizes)
        mine = torch.zeros(longest, dtype=torch.uint8)
        mine[:len(data)] = _as_tensor(data)
        out = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world_size)]
        if longest:
            self._dist.all_gather(out, mine, group=self.group)
        return [bytes(t[:n].numpy()) for t, n in zip(out, sizes)]


def _as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else \
        torch.empty(0, dtype=torch.uint8)
