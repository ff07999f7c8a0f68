"""Outcomes: what became of each snapshot a client asked for, and who is told.

A snapshot ends committed, failed or skipped, often on another thread (the daemon's
reply, the stager). The client must still (1) write that end to the state log, (2)
warn the trainer of a failure at its next call rather than lose it in a thread, (3)
at close(), wait for every handle and retry what a lost daemon left staged, and (4)
say in one :class:`~snapd_client.handle.CloseSummary` what became of them all. That
bookkeeping is this module; :class:`~snapd_client.client.Client` holds one
:class:`Outcomes` and calls it at snapshot(), log() and close().
"""

from __future__ import annotations

import os
import warnings
from collections import deque
from typing import Deque, Dict, List, Optional

from snapd.store import RunStore
from snapd_client.handle import CloseSummary, SnapshotHandle, SnapshotWarning
from snapd_client.handoff import Handoff
from snapd_client.lostdaemon import committed_on_disk
from snapd_client.journal import Journal


class Outcomes:
    """The snapshots of one client (one run and rank) and their ends.

    ``handoff`` is the client's daemon conversation, None when it writes in-process.
    ``journal`` is set by the client once it opens its state log; outcomes met
    before (or after it is closed) are counted but not logged.
    """

    def __init__(self, store: RunStore, handoff: Optional[Handoff]) -> None:
        self.store = store
        self.handoff = handoff
        self.journal: Optional[Journal] = None
        self.newest: Optional[SnapshotHandle] = None  # the newest not skipped
        self._handles: List[SnapshotHandle] = []      # those close() may wait for
        self._failures: Deque[SnapshotHandle] = deque()  # failed, to be warned of
        self._by_step: Dict[int, str] = {}   # step -> committed/failed/skipped

    def __len__(self) -> int:
        """How many snapshots have an end known so far."""
        return len(self._by_step)

    def add(self, handle: SnapshotHandle) -> None:
        """A snapshot just handed over: its end is recorded when it comes."""
        handle.add_done_callback(self._record)
        # Only handles close() may still have to wait for are kept; failed ones are
        # warned of from _failures.
        self._handles = [h for h in self._handles if not h.done()] + [handle]
        if not handle.skipped:
            self.newest = handle

    def _record(self, handle: SnapshotHandle) -> None:
        """The lifecycle record of a snapshot; a committed one carries the full RNG
        states and cursor, and the last resume and replay verdict (recovery reads back
        no further than the last commit). A failure is queued to be warned of."""
        state = "skipped" if handle.skipped else "failed" if handle.failed else "committed"
        self._by_step[handle.step] = state
        if state == "failed":
            self._failures.append(handle)
        journal = self.journal
        if journal is None or journal.closed:
            return
        if state == "skipped":
            journal.event("snapshot", event="skipped", step=handle.step)
        elif state == "failed":
            journal.event("snapshot", event="failed", step=handle.step,
                          error=str(handle.error))
        else:
            result = handle.result
            journal.event(
                "snapshot", event="committed", step=handle.step,
                name=os.path.basename(result.path), bytes=result.bytes_written,
                seconds=result.seconds, rng=handle.rng, cursor=handle.cursor,
                last_resume=journal.last_resume, last_replay=journal.verdict)

    def report(self, stacklevel: int = 3) -> None:
        """Warn, at the trainer's own line (``stacklevel``: this function's caller's
        caller), of what failed in the background since its last call: a daemon lost
        (what it lost, what is retried on a new one), a snapshot that did not commit.
        Once per snapshot: a failure wait() already raised is not warned of."""
        notes = self.handoff.take_notes() if self.handoff is not None else []
        while self._failures:
            handle = self._failures.popleft()
            if handle.failed and not handle.warned and not handle.raised:
                handle.warned = True
                notes.append(str(handle.failure()))
        for note in notes:
            warnings.warn(note, SnapshotWarning, stacklevel=stacklevel)

    def settle(self) -> None:
        """Every end known (close()): the handles waited for, what a lost daemon left
        staged retried, and a newest whose end was unknown looked for on disk."""
        newest = self.newest
        self._settle_all()
        self._recheck_unknown(newest)

    def _settle_all(self) -> None:
        """The handles waited for, and what a daemon lost on the way retried on a new
        one (the notes are warned of by report())."""
        for _ in range(3):   # a retry's daemon lost too: once more, then give up
            if self.handoff is not None:
                self.handoff.drain()
            in_flight = self.handoff.in_flight() if self.handoff is not None else []
            for handle in self._handles + in_flight:
                handle.settle()   # a daemon's: bounded by its liveness and the timeout
            if self.handoff is None or not self.handoff.recover():
                return

    def _recheck_unknown(self, newest: Optional[SnapshotHandle]) -> None:
        """The newest snapshot's outcome was unknown (its daemon hung, then maybe went
        on): its committed directory, if there now is one, is the answer."""
        if newest is None or not newest.outcome_unknown or newest.sid is None:
            return
        found = committed_on_disk(self.store, newest.sid)
        if found is not None:
            newest.reopen(None)
            newest.set_result(found)

    def summary(self) -> CloseSummary:
        """The steps by end, each list sorted."""
        ends = list(self._by_step.items())   # callbacks may still add (other threads)
        by = {state: tuple(sorted(s for s, st in ends if st == state))
              for state in ("committed", "failed", "skipped")}
        return CloseSummary(**by)
