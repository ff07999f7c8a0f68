"""When ``snapshot(step)`` takes a snapshot: at every call, every N steps, or as often
as it pays (``every="auto"``: the cadence, snapd_client/cadence.py).

A call that takes none returns at once a handle that is done, not failed and not
``taken``: nothing is copied, nothing sent to the daemon, nothing logged, so that a
loop may call ``snapshot(step)`` at every step and leave the choice here.

Under "auto" each taken snapshot feeds the cadence back: the stall it cost the loop,
and, once durable, the seconds from the call to durability (through the handle's done
callback, on whichever thread learns of it); the cadence times the steps run
meanwhile itself (the slowdown the daemon's writing causes is part of the cost). It also logs one ``cadence`` record
(docs/format.md, "Records"): the decision it was taken under, with the stall and the
step time measured, which is what ``snapd status`` and ``snapd watch`` show.

The mean time between failures is learned from the run itself: every resume record
carries the times of the run's resumes so far (snapd_client/journal.py), and the
newest one, written by restore(), is the cadence's ``history``. The cadence is made at
the first ``snapshot()`` call, after restore() has written it.

Many ranks: every rank must take the same steps, or a snapshot's parts would never
all arrive. Each rank measures its own step time and stall; at each taken snapshot
rank 0's interval in steps crosses a private gloo group in one small broadcast
(snapd_client/ranks.py) and every rank follows it until the next. The first snapshot
has no interval measured yet (one step), so a job of many ranks takes a second
snapshot at its next call, whose interval is a measured one.
"""

from __future__ import annotations

import dataclasses
import struct
import time
from typing import Any, Callable, Dict, Optional, Sequence

from snapd.errors import DistributedNotReady
from snapd.options import Options
from snapd_client.cadence import Cadence, Decision
from snapd_client.handle import SnapshotHandle
from snapd_client.ranks import Collective, GlooGroup

_INTERVAL = struct.Struct("<q")   # rank 0's interval in steps, as broadcast


class CadenceWarning(UserWarning):
    """``every="auto"`` cannot meet ``max_loss`` under its lower bounds (the overhead
    budget, the writer's pace); warned once, at the trainer's line, with both
    figures and what to change."""


def process_group(world_size: int) -> Collective:
    """The private gloo group over the job's ranks (made by every rank at the same
    call: the job's first taken snapshot)."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        raise DistributedNotReady(
            f"snapshot(): every='auto' with WORLD_SIZE={world_size}: the ranks follow "
            "rank 0's interval, sent over torch.distributed, which has no process "
            "group; call dist.init_process_group first, or give every=N",
            field="every")
    return GlooGroup()


class Schedule:
    """Decides, per ``snapshot(step)`` call, whether it takes a snapshot.

    ``history``: called once, at the first decision under "auto": the wall times of
    the run's resumes. ``collective``: called once, at the first taken snapshot of a
    job of many ranks under "auto": the ranks' group (a fake in unit tests).
    ``clock``: monotonic seconds, the cadence's (injected by tests). ``settled``:
    whether a snapshot now would cost a steady one (the staging arena faulted in
    whole), so that the cadence's probe measures that and not the set-up.
    """

    def __init__(self, options: Options, *, rank: int = 0, world_size: int = 1,
                 history: Callable[[], Sequence[float]] = tuple,
                 collective: Optional[Callable[[], Collective]] = None,
                 clock: Callable[[], float] = time.monotonic,
                 settled: Callable[[], bool] = lambda: True) -> None:
        self.options = options
        self._settled = settled
        self.rank, self.world_size = rank, world_size
        self._history = history
        self._collective_factory = collective or (lambda: process_group(world_size))
        self._collective: Optional[Collective] = None
        self.clock = clock
        self.cadence: Optional[Cadence] = None   # "auto": made at the first call
        self.decision: Optional[Decision] = None  # "auto": the newest call's

    @property
    def auto(self) -> bool:
        return self.options.every == "auto"

    def decide(self, step: int) -> bool:
        """Whether this call takes a snapshot."""
        every = self.options.every
        if every is None:
            return True
        if every != "auto":
            return step % every == 0
        if self.cadence is None:
            o = self.options
            self.cadence = Cadence(overhead=o.overhead, max_loss=o.max_loss, mtbf=o.mtbf,
                                   history=tuple(self._history()), clock=self.clock)
        self.decision = self.cadence.decide(step, settled=self._settled())
        return self.decision.take

    def agree(self) -> None:
        """Many ranks under "auto": rank 0's interval in steps, to every rank, applied.
        Called at every taken snapshot, on every rank, at the same call."""
        if not self.auto or self.world_size < 2:
            return
        if self._collective is None:
            self._collective = self._collective_factory()
        mine = _INTERVAL.pack(self.decision.interval_steps) if self.rank == 0 else None
        agreed = _INTERVAL.unpack(self._collective.broadcast_bytes(mine, src=0))[0]
        self.cadence.set_interval_steps(agreed)
        # The interval this rank acts on is rank 0's: that is what its record says.
        self.decision = dataclasses.replace(self.decision, interval_steps=agreed)

    def taken(self, handle: SnapshotHandle, stall_s: float,
              called_at: float) -> Optional[Dict[str, Any]]:
        """A snapshot was taken (``called_at``: ``clock()`` when snapshot() was called;
        ``stall_s``: how long the call kept the loop): the cadence fed back, and the
        fields of its ``cadence`` record. None unless "auto"."""
        if not self.auto:
            return None
        cadence = self.cadence
        cadence.taken(handle.step, stall_s)

        def durable(h: SnapshotHandle) -> None:
            # A failed or skipped snapshot never became durable: it says nothing of
            # the writer's pace. A retry's commit is reported when it comes.
            if h.result is not None and not h.failed and not h.skipped:
                cadence.durable(h.step, self.clock() - called_at)

        handle.add_done_callback(durable)
        fields = dataclasses.asdict(self.decision)
        del fields["take"]   # always true here
        return {"step": handle.step, **fields, "stall_s": stall_s,
                "step_s": cadence.step_s}

    def warning(self) -> Optional[str]:
        """Once: why max_loss cannot be met (the cadence's sentence)."""
        return self.cadence.warning() if self.cadence is not None else None
