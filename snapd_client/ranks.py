"""Which rank of which job this process is (rank, world size, local rank, session),
and how the ranks exchange bytes when restore makes them agree.

A client of a multi-rank job writes one *part* of each snapshot (docs/multirank.md).
Its rank and the job's world size come from ``torch.distributed`` when a process group
is initialised (the truth the collectives use), else from the variables ``torchrun``
sets (``RANK``, ``WORLD_SIZE``), else a job of one. ``LOCAL_RANK`` is the rank on
this node: the CUDA device it trains on.

The *session* names one attempt of the job. Every part carries it, and the global
commit joins only parts of one session, so that a resumed job recomputing a step, or
the same step at another world size, never mixes its parts with an older attempt's.

Restore runs once, at start, on every rank, so it may use collectives; it uses a group
of its own (gloo, whatever backend the job trains on: NCCL would need the bytes on a
GPU) so that its traffic never interleaves with the job's. Only bytes cross it, as
uint8 tensors with their lengths: never ``*_object`` collectives, which unpickle what
another process sent.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, List, Mapping, Optional, Protocol

import torch

from snapd.errors import InvalidOption


@dataclass(frozen=True)
class RankInfo:
    """This process's place in its job."""

    rank: int
    world_size: int
    local_rank: int

    @property
    def many(self) -> bool:
        """More than one rank: each snapshot is a part, committed globally."""
        return self.world_size > 1


def _env_int(environ: Mapping[str, str], name: str, default: int) -> int:
    raw = environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise InvalidOption(f"environment variable {name}={raw!r} is not an integer; "
                            "torchrun sets it, or unset it for a job of one rank",
                            field=name) from None


def _from_torch() -> Optional[tuple]:
    """(rank, world size) of the default process group, when one is initialised."""
    try:
        import torch.distributed as dist
    except ImportError:   # a torch built without distributed
        return None
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.get_rank(), dist.get_world_size()


def detect(rank: Optional[int] = None, world_size: Optional[int] = None,
           environ: Optional[Mapping[str, str]] = None) -> RankInfo:
    """This process's RankInfo: ``rank``/``world_size`` when given, else from the
    initialised process group, else ``RANK``/``WORLD_SIZE`` (defaults 0 and 1)."""
    environ = os.environ if environ is None else environ
    group = _from_torch()
    if rank is None:
        rank = group[0] if group else _env_int(environ, "RANK", 0)
    if world_size is None:
        world_size = group[1] if group else _env_int(environ, "WORLD_SIZE", 1)
    for name, value in (("rank", rank), ("world_size", world_size)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise InvalidOption(f"Client({name}={value!r}): an int", field=name)
    # A world of one keeps its rank as a plain label (separate one-rank snapshots per
    # rank, as before multi-rank jobs existed); in a larger one it is a place in it.
    if world_size < 1 or rank < 0 or (world_size > 1 and rank >= world_size):
        raise InvalidOption(f"Client(rank={rank}, world_size={world_size}): a rank is "
                            "0 <= rank < world_size and world_size >= 1; check RANK and "
                            "WORLD_SIZE (torchrun sets both)", field="rank")
    return RankInfo(rank, world_size, _env_int(environ, "LOCAL_RANK", 0))


def default_session(environ: Optional[Mapping[str, str]] = None) -> str:
    """The session before restore() agrees on one: torchrun's run id and restart count
    (``TORCHELASTIC_RUN_ID:TORCHELASTIC_RESTART_COUNT``), else ``SNAPD_SESSION``,
    else ``"none"``."""
    environ = os.environ if environ is None else environ
    run_id = environ.get("TORCHELASTIC_RUN_ID")
    restarts = environ.get("TORCHELASTIC_RESTART_COUNT")
    if run_id and restarts is not None:
        return f"{run_id}:{restarts}"
    return environ.get("SNAPD_SESSION") or "none"


# --- the bytes ranks exchange at restore ------------------------------------------

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
