"""The handle snapshot() returns: done(), wait(), and a failure re-raised once; the
warning a background failure is reported with, and what close() returns."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

from snapd.errors import DaemonUnavailable, SnapshotFailed
from snapd.store import SnapshotId
from snapd.writer import CommitResult

Waiter = Callable[[threading.Event], None]

class PartOf(NamedTuple):
    """A snapshot of a multi-rank job as this client writes it: its rank's part, of
    one session (the attempt of the job)."""
    rank: int
    session: str
    world_size: int


def part_of(capture: Any) -> Optional[PartOf]:
    """The part a capture is, None for a job of one rank (a whole snapshot)."""
    return PartOf(capture.rank, capture.session, capture.world_size) \
        if capture.world_size > 1 else None


# How long wait() gives the hand-off, once the daemon is known lost, to settle the
# snapshot (committed on disk, lost, or unknown) before it calls it lost itself.
SETTLE_SECONDS = 10.0


class SnapshotWarning(RuntimeWarning):
    """A snapshot failed in the background (a lost daemon, a failed write): warned at
    the trainer's next ``log()``/``snapshot()`` (or ``close()``), at the trainer's own
    line, once per snapshot; and what snapd did about it (a retry on a new daemon)."""


@dataclass(frozen=True)
class CloseSummary:
    """What ``Client.close()`` returns: the steps of this client's snapshots by
    outcome (a snapshot retried after a lost daemon counts by its retry's outcome;
    an outcome still unknown counts as failed). ``incomplete``: many ranks only,
    parts of this rank that are durable but whose snapshot was not committed
    globally (other ranks' parts missing); never restored."""

    committed: Tuple[int, ...] = ()
    failed: Tuple[int, ...] = ()
    skipped: Tuple[int, ...] = ()
    incomplete: Tuple[int, ...] = ()

    @property
    def newest_committed(self) -> Optional[int]:
        return max(self.committed, default=None)

    def __str__(self) -> str:
        def steps(xs: Tuple[int, ...]) -> str:   # the last five at most
            if not xs:
                return ""
            shown = ("…, " if len(xs) > 5 else "") + ", ".join(map(str, xs[-5:]))
            return f" (step{'s' if len(xs) > 1 else ''} {shown})"
        text = (f"{len(self.committed)} committed{steps(self.committed)}, "
                f"{len(self.failed)} failed{steps(self.failed)}, "
                f"{len(self.skipped)} skipped{steps(self.skipped)}")
        if self.incomplete:   # many ranks only: the line stays as it was otherwise
            text += f", {len(self.incomplete)} incomplete{steps(self.incomplete)}"
        return text


class SnapshotHandle:
    """One snapshot in flight. ``wait()`` returns its result or raises its failure.

    A background failure is raised by the first ``wait()`` (or by ``Client.close()``
    when this is the newest snapshot), then considered reported: a training loop
    that checks once is not re-raised at. Unwaited, it is warned about
    (``SnapshotWarning``) at the trainer's next ``log()``/``snapshot()``.
    A write that failed is raised as SnapshotFailed from its cause; a daemon that
    died or stopped answering as DaemonUnavailable; when the daemon still runs and
    the snapshot is not on disk yet, ``outcome_unknown`` is True and the message
    says how to find out (the run's LATEST). A skipped snapshot (the previous
    write was still busy and ``on_busy="skip"``) is done at once and waits to None.
    ``stall_seconds`` is how long snapshot() waited for a free staging slot.

    A call that took no snapshot (``every``: not a step it takes, docs/operations.md
    "Snapshot cadence") returns a handle built by :meth:`not_taken`: ``taken`` False,
    done, not failed, ``wait()`` None; nothing was copied or logged for it.

    A snapshot lost with a dead daemon whose bytes are still staged is retried on a
    new daemon (handoff.py): ``reopen()`` puts the handle back in flight, and the
    retry's outcome replaces the loss (done callbacks run again with it).

    Built complete by whoever takes the snapshot: ``sid`` (where the snapshot lands),
    ``rng`` and ``cursor`` (the state the committed log record carries), ``waiter``
    (a daemon's: a bounded wait that watches its liveness). ``result`` is the
    writer's CommitResult once durable. ``part``: in a job of many ranks, which part
    this is (:class:`PartOf`); its result's ``complete`` says whether the snapshot
    is committed globally yet (the client's Outcomes looks on disk until it is).
    """

    def __init__(self, step: int, *, sid: Optional[SnapshotId] = None,
                 rng: Optional[Dict[str, bytes]] = None,
                 cursor: Optional[Dict[str, Any]] = None,
                 waiter: Optional[Waiter] = None, stall_seconds: float = 0.0,
                 part: Optional[PartOf] = None) -> None:
        self.step = step
        self.sid = sid
        self.part = part
        self.rng = rng
        self.cursor = cursor
        self.stall_seconds = stall_seconds
        # The tensor bytes this snapshot copied out of the live state (staged, or
        # handed to the in-process writer); frozen tensors an earlier snapshot holds
        # are not copied (snapd_client/frozen.py).
        self.staged_bytes = 0
        self.result: Optional[CommitResult] = None
        self.taken = True          # False: this call took no snapshot (not_taken)
        self.skipped = False
        self.outcome_unknown = False
        self.warned = False        # a SnapshotWarning told the trainer of this failure
        self.retries = 0           # times resubmitted to a new daemon after a loss
        self._waiter = waiter
        self._error: Optional[BaseException] = None
        self._reported = False     # wait() raised this failure
        self._settled = False      # an outcome is set (its callbacks may still run)
        self._event = threading.Event()   # set once the outcome's callbacks have run
        self._lock = threading.Lock()
        self._callbacks: List[Callable[["SnapshotHandle"], None]] = []

    @classmethod
    def not_taken(cls, step: int) -> "SnapshotHandle":
        """The handle of a call that took no snapshot: done at once, nothing to wait
        for, no outcome to record. Made for nearly every call under ``every``, so it
        shares one event, set for good, and one lock with every other (nothing ever
        reopens it), instead of making its own."""
        handle = cls.__new__(cls)
        handle.__dict__.update(_NOT_TAKEN)
        handle.step, handle._callbacks = step, []
        return handle

    def add_done_callback(self, callback: Callable[["SnapshotHandle"], None]) -> None:
        """Call ``callback(handle)`` on each outcome (at once if one is known): once,
        or again after a retry."""
        with self._lock:
            self._callbacks.append(callback)
            if not self._event.is_set():
                return   # _finish runs it
        callback(self)

    def _settle_once(self) -> bool:
        """Claim the outcome: False when one is already set (later ones are echoes)."""
        with self._lock:
            if self._settled:
                return False
            self._settled = True
            return True

    def _finish(self) -> None:
        """Run the callbacks (the log's record of the outcome), then wake the waiters:
        whoever wait() returns to finds the outcome recorded."""
        ran = 0
        while True:
            with self._lock:
                callbacks = self._callbacks[ran:]
                if not callbacks:
                    self._event.set()
                    return
            for callback in callbacks:
                callback(self)
            ran += len(callbacks)

    def set_result(self, result: CommitResult) -> None:
        """Durable. Wins over a loss already set: the disk is the truth."""
        with self._lock:
            self._settled = True
            self.result, self._error, self.outcome_unknown = result, None, False
        self._finish()

    def set_skipped(self) -> None:
        if self._settle_once():
            self.skipped = True
            self._finish()

    def set_error(self, error: BaseException) -> None:
        if self._settle_once():
            self._error = error
            self._finish()

    def set_unknown(self, error: DaemonUnavailable) -> None:
        """The daemon was lost but may still commit: not known to have failed."""
        if self._settle_once():
            self.outcome_unknown = True
            self._error = error
            self._finish()

    def reopen(self, waiter: Optional[Waiter]) -> None:
        """In flight again: a retry of this lost snapshot (its staged bytes, resubmitted
        to a new daemon, whose ``waiter`` watches it). Its outcome replaces the loss."""
        if not self.taken:   # its event is every not-taken handle's
            raise RuntimeError(f"snapshot handle of step {self.step}: no snapshot was "
                               "taken, so there is none to retry")
        with self._lock:
            self._error, self.result, self.outcome_unknown = None, None, False
            self._reported = self.warned = self._settled = False
            self._waiter = waiter
            self.retries += 1
            self._event.clear()

    @property
    def error(self) -> Optional[BaseException]:
        """The background failure, if any (wait() raises it once)."""
        return self._error

    def done(self) -> bool:
        return self._event.is_set()

    @property
    def failed(self) -> bool:
        return self._error is not None

    @property
    def pending(self) -> bool:
        """Still in flight, or failed without the failure having been reported."""
        return not self.done() or (self.failed and not self._reported)

    @property
    def raised(self) -> bool:
        """wait() has raised this failure to the trainer."""
        return self._reported

    def settle(self, timeout: Optional[float] = None) -> bool:
        """Block as wait() does, raising nothing; whether the outcome is known."""
        if timeout is None and self._waiter is not None and not self._event.is_set():
            try:
                self._waiter(self._event)
            except DaemonUnavailable as e:
                # The hand-off settles every snapshot in flight when the daemon is
                # lost (committed on disk, lost, unknown, retried later): let it.
                if not self._event.wait(SETTLE_SECONDS):
                    self.set_error(e)
        return self._event.wait(timeout)

    def wait(self, timeout: Optional[float] = None):
        """Block until durable (or failed). Raises SnapshotFailed from the cause.

        Without ``timeout`` a daemon snapshot is waited for as long as the daemon
        lives and answers (bounded by ``Options.timeout`` of silence).
        """
        if not self.settle(timeout):
            raise TimeoutError(f"snapshot of step {self.step} not durable after "
                               f"{timeout} s")
        if self._error is not None and not self._reported:
            self._reported = True
            raise self.failure()
        return self.result

    def failure(self) -> BaseException:
        """The exception wait() raises for this snapshot's failure (its cause chained)."""
        error = self._error
        if self.outcome_unknown:
            e: BaseException = DaemonUnavailable(
                f"snapshot of step {self.step}: outcome unknown: {error}")
        elif isinstance(error, DaemonUnavailable):
            e = DaemonUnavailable(f"snapshot of step {self.step} was lost: {error}")
        else:
            e = SnapshotFailed(f"snapshot of step {self.step} failed: {error}")
        e.__cause__ = error
        return e

    def __repr__(self) -> str:
        state = ("not taken" if not self.taken else
                 "outcome unknown" if self.outcome_unknown else "failed" if self.failed
                 else "skipped" if self.skipped else "durable" if self.done()
                 else "in flight")
        return f"<SnapshotHandle step={self.step} {state}>"


def _not_taken_fields() -> Dict[str, Any]:
    """A not-taken handle's attributes but its step and callbacks: those of a handle
    made the ordinary way, settled, with a shared event and lock."""
    model = SnapshotHandle(0)
    model.taken, model._settled = False, True
    model._event.set()
    fields = dict(model.__dict__)
    del fields["step"], fields["_callbacks"]
    return fields


_NOT_TAKEN = _not_taken_fields()
