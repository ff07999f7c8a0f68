"""The handle snapshot() returns: done(), wait(), and a failure re-raised once."""

from __future__ import annotations

import threading
from typing import Any, Callable, Dict, List, Optional

from snapd.errors import DaemonUnavailable, SnapshotFailed
from snapd.store import SnapshotId
from snapd.writer import CommitResult

Waiter = Callable[[threading.Event], None]


class SnapshotHandle:
    """One snapshot in flight. ``wait()`` returns its result or raises its failure.

    A background failure is raised by the first ``wait()`` (or by ``Client.close()``),
    then considered reported: a training loop that checks once is not re-raised at.
    A write that failed is raised as SnapshotFailed from its cause; a daemon that
    died or stopped answering as DaemonUnavailable; when the daemon still runs and
    the snapshot is not on disk yet, ``outcome_unknown`` is True and the message
    says how to find out (the run's LATEST). A skipped snapshot (the previous
    write was still busy and ``on_busy="skip"``) is done at once and waits to None.
    ``stall_seconds`` is how long snapshot() waited for a free staging slot.

    Built complete by whoever takes the snapshot: ``sid`` (where the snapshot lands),
    ``rng`` and ``cursor`` (the state the committed log record carries), ``waiter``
    (a daemon's: a bounded wait that watches its liveness). ``result`` is the
    writer's CommitResult once durable.
    """

    def __init__(self, step: int, *, sid: Optional[SnapshotId] = None,
                 rng: Optional[Dict[str, bytes]] = None,
                 cursor: Optional[Dict[str, Any]] = None,
                 waiter: Optional[Waiter] = None, stall_seconds: float = 0.0) -> None:
        self.step = step
        self.sid = sid
        self.rng = rng
        self.cursor = cursor
        self.stall_seconds = stall_seconds
        self.result: Optional[CommitResult] = None
        self.skipped = False
        self.outcome_unknown = False
        self._waiter = waiter
        self._error: Optional[BaseException] = None
        self._reported = False
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._callbacks: List[Callable[["SnapshotHandle"], None]] = []

    def add_done_callback(self, callback: Callable[["SnapshotHandle"], None]) -> None:
        """Call ``callback(handle)`` once the outcome is known (at once if it is)."""
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(callback)
                return
        callback(self)

    def _finish(self) -> None:
        with self._lock:
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(self)

    def set_result(self, result: CommitResult) -> None:
        self.result = result
        self._finish()

    def set_skipped(self) -> None:
        self.skipped = True
        self._finish()

    def set_error(self, error: BaseException) -> None:
        if not self._event.is_set():  # the first outcome wins; later ones are echoes
            self._error = error
            self._finish()

    def set_unknown(self, error: DaemonUnavailable) -> None:
        """The daemon was lost but may still commit: not known to have failed."""
        if not self._event.is_set():
            self.outcome_unknown = True
            self.set_error(error)

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

    def wait(self, timeout: Optional[float] = None):
        """Block until durable (or failed). Raises SnapshotFailed from the cause.

        Without ``timeout`` a daemon snapshot is waited for as long as the daemon
        lives and answers (bounded by ``Options.timeout`` of silence).
        """
        if timeout is None and self._waiter is not None and not self._event.is_set():
            try:
                self._waiter(self._event)
            except DaemonUnavailable as e:
                self.set_error(e)
        if not self._event.wait(timeout):
            raise TimeoutError(f"snapshot of step {self.step} not durable after "
                               f"{timeout} s")
        if self._error is not None and not self._reported:
            self._reported = True
            if self.outcome_unknown:
                raise DaemonUnavailable(f"snapshot of step {self.step}: outcome unknown: "
                                        f"{self._error}") from self._error
            if isinstance(self._error, DaemonUnavailable):
                raise DaemonUnavailable(f"snapshot of step {self.step} was lost: "
                                        f"{self._error}") from self._error
            raise SnapshotFailed(f"snapshot of step {self.step} failed: "
                                 f"{self._error}") from self._error
        return self.result

    def __repr__(self) -> str:
        state = ("outcome unknown" if self.outcome_unknown else "failed" if self.failed else "skipped" if self.skipped
                 else "durable" if self.done() else "in flight")
        return f"<SnapshotHandle step={self.step} {state}>"
