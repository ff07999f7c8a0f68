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
all arrive. Each rank measures its own step time and stall, and follows rank 0's
interval, which travels without a collective: at each taken snapshot rank 0 puts its
interval in steps in the job's store (the key-value store torch.distributed already
runs for the process group; a set, which waits for no rank), and every other rank reads
it at its first call after that snapshot, before deciding. By then it is there in any
loop whose steps exchange gradients: that rank's step after the snapshot took part in a
collective that rank 0 joined only after its snapshot() returned. A follower's
``cadence`` record, whose interval is rank 0's, is logged then, one call late. The
first snapshot has no interval measured yet (one step), so a job of many ranks takes a
second snapshot at its next call, whose interval is a measured one.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import time
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence

from snapd.errors import DistributedNotReady
from snapd.options import Options
from snapd_client.cadence import Cadence, Decision
from snapd_client.handle import SnapshotHandle

# Each client of a process draws the next number for its keys (:func:`scope`), so a
# second client of the same run and session in one job never reads the first one's.
# Every rank makes the same clients in the same order (one program on every rank), so
# the numbers match.
_CLIENTS = itertools.count()


def scope(run: str, session: Callable[[], str]) -> Callable[[], str]:
    """What names one client's attempt of ``run`` in the store: the run, the session
    (restore() may replace it, hence a callable) and the client's number."""
    number = next(_CLIENTS)
    return lambda: f"{run}/{session()}/{number}"


class CadenceWarning(UserWarning):
    """``every="auto"`` cannot meet ``max_loss`` under its lower bounds (the overhead
    budget, the writer's pace); warned once, at the trainer's line, with both
    figures and what to change."""


class JobStore(Protocol):
    """What the ranks' agreement needs of torch.distributed's key-value store (a fake
    in unit tests)."""

    def set(self, key: str, value: str) -> None: ...

    def get(self, key: str) -> bytes: ...

    def check(self, keys: List[str]) -> bool: ...

    def wait(self, keys: List[str], timeout: datetime.timedelta) -> None: ...


def job_store(world_size: int) -> JobStore:
    """The store of the job's default process group: the one its ranks met through."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        raise DistributedNotReady(
            f"snapshot(): every='auto' with WORLD_SIZE={world_size}: the ranks follow "
            "rank 0's interval, which travels through torch.distributed's store, and "
            "there is no process group; call dist.init_process_group first, or give "
            "every=N", field="every")
    from torch.distributed import distributed_c10d
    return distributed_c10d._get_default_store()


class Schedule:
    """Decides, per ``snapshot(step)`` call, whether it takes a snapshot.

    ``history``: called once, at the first decision under "auto": the wall times of
    the run's resumes. ``store``: called once, when a job of many ranks under "auto"
    first needs it: the job's key-value store (a fake in unit tests); ``scope``: what
    names this client's attempt of the run there (:func:`scope`: the same on every
    rank).
    ``clock``: monotonic seconds, the cadence's (injected by tests). ``settled``:
    whether a snapshot now would cost a steady one (the staging arena made and faulted
    in whole), so that the cadence's first snapshot (one rank, no ``max_loss``) or
    else its probe measures that and not the set-up.
    """

    def __init__(self, options: Options, *, rank: int = 0, world_size: int = 1,
                 history: Callable[[], Sequence[float]] = tuple,
                 store: Optional[Callable[[], JobStore]] = None,
                 scope: Callable[[], str] = lambda: "run",
                 clock: Callable[[], float] = time.monotonic,
                 settled: Callable[[], bool] = lambda: True,
                 wait_s: float = 300.0) -> None:
        self.options = options
        self._settled = settled
        self.rank, self.world_size = rank, world_size
        self._history = history
        self._store_factory = store or (lambda: job_store(world_size))
        self._store: Optional[JobStore] = None
        self._scope = scope
        self._wait_s = wait_s   # how long a follower waits for rank 0's interval
        self.clock = clock
        self.cadence: Optional[Cadence] = None   # "auto": made at the first call
        self.decision: Optional[Decision] = None  # "auto": the newest call's
        # A follower (rank > 0, many ranks): the step of its newest snapshot whose
        # interval (rank 0's) it has not read yet, and that snapshot's record.
        self._unread: Optional[int] = None
        self._record: Optional[Dict[str, Any]] = None
        self._late: List[Dict[str, Any]] = []

    @property
    def auto(self) -> bool:
        return self.options.every == "auto"

    @property
    def many(self) -> bool:
        return self.auto and self.world_size > 1

    def decide(self, step: int) -> bool:
        """Whether this call takes a snapshot."""
        every = self.options.every
        if every is None:
            return True
        if every != "auto":
            return step % every == 0
        if self.cadence is None:
            o = self.options
            # The first waits for steady staging memory, unless the ranks must agree
            # on its step (each learns its own memory's state at its own time) or
            # max_loss is set (the wait would be training at risk before any snapshot).
            self.cadence = Cadence(overhead=o.overhead, max_loss=o.max_loss, mtbf=o.mtbf,
                                   history=tuple(self._history()), clock=self.clock,
                                   first_waits=not self.many and o.max_loss is None)
        if self._unread is not None and step > self._unread:
            self._follow(step, wait=True)
        self.decision = self.cadence.decide(step, settled=self._settled())
        return self.decision.take

    def publish(self, step: int) -> None:
        """Many ranks under "auto", at every taken snapshot, on every rank: rank 0 puts
        its interval in the store and acts on it; every other rank reads it at its
        next call (:meth:`decide`)."""
        if not self.many:
            return
        store = self._job_store()   # every rank: no process group is refused here
        if self.rank == 0:
            store.set(self._key(step), str(self.decision.interval_steps))
            self.cadence.set_interval_steps(self.decision.interval_steps)
        else:
            self._unread = step

    def late_records(self) -> List[Dict[str, Any]]:
        """A follower's ``cadence`` records whose interval (rank 0's) is known now; each
        once."""
        late, self._late = self._late, []
        return late

    def close(self) -> List[Dict[str, Any]]:
        """At close: a follower's last record, if rank 0's interval is there already
        (nothing is waited for)."""
        if self._unread is not None:
            try:
                self._follow(self._unread, wait=False)
            except Exception:   # the process group already destroyed: no record
                pass
        return self.late_records()

    def _follow(self, step: int, wait: bool) -> None:
        """Rank 0's interval after its snapshot of ``self._unread``, applied; the
        record of that snapshot completed with it."""
        taken_at, key = self._unread, self._key(self._unread)
        store = self._job_store()
        if wait:
            try:
                store.wait([key], datetime.timedelta(seconds=self._wait_s))
            except RuntimeError as e:   # the store's timeout (DistStoreError)
                raise DistributedNotReady(
                    f"snapshot({step}) on rank {self.rank}: every='auto' waited "
                    f"{self._wait_s:g} s for rank 0's interval after the snapshot of "
                    f"step {taken_at} (key {key!r} of torch.distributed's store), and it "
                    f"never came ({e}); rank 0 did not take that snapshot: every rank "
                    "must call snapshot(step) at the same steps", field="every") from e
        elif not store.check([key]):
            return
        agreed = int(store.get(key))
        self._unread = None
        self.cadence.set_interval_steps(agreed)
        if self._record is not None:
            # The interval this rank acts on is rank 0's: that is what its record says.
            self._late.append({**self._record, "interval_steps": agreed})
            self._record = None

    def _job_store(self) -> JobStore:
        if self._store is None:
            self._store = self._store_factory()
        return self._store

    def _key(self, step: int) -> str:
        return f"snapd/cadence/{self._scope()}/{step}"

    def taken(self, handle: SnapshotHandle, stall_s: float,
              called_at: float) -> Optional[Dict[str, Any]]:
        """A snapshot was taken (``called_at``: ``clock()`` when snapshot() was called;
        ``stall_s``: how long the call kept the loop): the cadence fed back, and the
        fields of its ``cadence`` record. None unless "auto", and None on a follower,
        whose record waits for rank 0's interval (:meth:`late_records`)."""
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
        record = {"step": handle.step, **fields, "stall_s": stall_s,
                  "step_s": cadence.step_s}
        if self.many and self.rank != 0:
            self._record = record   # logged once rank 0's interval is read
            return None
        return record

    def warning(self) -> Optional[str]:
        """Once: why max_loss cannot be met (the cadence's sentence)."""
        return self.cadence.warning() if self.cadence is not None else None
