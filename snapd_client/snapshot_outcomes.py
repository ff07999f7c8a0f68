"""Outcomes: what became of each snapshot a client asked for, and who is told.

A snapshot ends committed, failed or skipped, often on another thread (the daemon's
reply, the stager). The client must still (1) write that end to the state log, (2)
warn the trainer of a failure at its next call rather than lose it in a thread, (3)
at close(), wait for every handle and retry what a lost daemon left staged, and (4)
say in one :class:`~snapd_client.handle.CloseSummary` what became of them all. That
bookkeeping is this module; :class:`~snapd_client.client.Client` holds one
:class:`Outcomes` and calls it at snapshot(), log() and close().

In a job of many ranks a durable part is not a committed snapshot: the log records
event ``part`` when this rank's part is durable, and ``committed`` (the record
recovery reads) only once ``<run>/snapshots/<name>`` exists, which is looked for by a
stat while parts are pending, at snapshot(), log() and close() (no collective:
another rank's writer commits, through the shared root; with node-local roots the
commit is remote, and the daemon marks it with ``<run>/snapshots/.remote-<name>``,
docs/remote.md "Many nodes"). close() waits for the
newest snapshot's global commit at most ``Options.global_commit_timeout``.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from collections import deque
from typing import Deque, Dict, List, Optional

from snapd.errors import IncompleteSnapshot
from snapd.format import part_dir_name
from snapd.globalcommit import read_part
from snapd.remote.parts import remote_committed
from snapd.store import RunStore, SnapshotId
from snapd_client.handle import CloseSummary, SnapshotHandle, SnapshotWarning

POLL = 0.05   # seconds between looks for a global commit at close()
from snapd_client.handoff import Handoff
from snapd_client.lostdaemon import committed_on_disk
from snapd_client.journal import Journal


class Outcomes:
    """The snapshots of one client (one run and rank) and their ends.

    ``handoff`` is the client's daemon conversation, None when it writes in-process.
    ``journal`` is set by the client once it opens its state log; outcomes met
    before (or after it is closed) are counted but not logged.
    ``global_timeout``: close()'s longest wait for the newest part's global commit.
    """

    def __init__(self, store: RunStore, handoff: Optional[Handoff],
                 global_timeout: float = 30.0) -> None:
        self.store = store
        self.handoff = handoff
        self.global_timeout = global_timeout
        self.journal: Optional[Journal] = None
        self.newest: Optional[SnapshotHandle] = None  # the newest not skipped
        self._handles: List[SnapshotHandle] = []      # those close() may wait for
        self._failures: Deque[SnapshotHandle] = deque()  # failed, to be warned of
        self._by_step: Dict[int, str] = {}   # step -> committed/failed/skipped/...
        self._parts: Dict[int, SnapshotHandle] = {}   # durable parts, not yet global
        self._parts_lock = threading.Lock()   # _record runs on the daemon's reader

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
        if state == "committed" and handle.part is not None and \
                not handle.result.complete:
            state = "part"   # durable; committed once the other ranks' parts are
            with self._parts_lock:
                self._parts[handle.step] = handle
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
        elif state == "part":
            result = handle.result
            journal.event("snapshot", event="part", step=handle.step,
                          name=os.path.basename(result.path), bytes=result.bytes_written,
                          seconds=result.seconds)
        else:
            self._log_committed(handle)

    def _log_committed(self, handle: SnapshotHandle) -> None:
        journal = self.journal
        if journal is not None and not journal.closed:
            result = handle.result
            journal.event(
                "snapshot", event="committed", step=handle.step,
                name=os.path.basename(result.path), bytes=result.bytes_written,
                seconds=result.seconds, rng=handle.rng, cursor=handle.cursor,
                last_resume=journal.last_resume, last_replay=journal.verdict,
                **({"manifest_sha256": result.manifest_sha256}
                   if result.manifest_sha256 else {}))

    def report(self, stacklevel: int = 3) -> None:
        """Warn, at the trainer's own line (``stacklevel``: this function's caller's
        caller), of what failed in the background since its last call: a daemon lost
        (what it lost, what is retried on a new one), a snapshot that did not commit.
        Once per snapshot: a failure wait() already raised is not warned of. Parts
        pending a global commit are looked for on disk first."""
        if self._parts:   # else nothing to look for (read unlocked: the next call sees it)
            self.check_parts()
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
        found = committed_on_disk(self.store, newest.sid, newest.part)
        if found is not None:
            newest.reopen(None)
            newest.set_result(found)

    def summary(self) -> CloseSummary:
        """The steps by end, each list sorted (a part still pending counts as
        incomplete)."""
        ends = [(s, "incomplete" if st == "part" else st)
                for s, st in list(self._by_step.items())]  # callbacks may still add
        by = {state: tuple(sorted(s for s, st in ends if st == state))
              for state in ("committed", "failed", "skipped", "incomplete")}
        return CloseSummary(**by)

    # --- many ranks: parts waiting for their global commit ---------------------------

    def check_parts(self) -> None:
        """Each pending part whose snapshot is now committed globally (its directory
        exists: the rename is the commit) gets its ``committed`` record. Once a newer
        one is, older ones still pending never will be (retention removes their
        parts): they count as incomplete."""
        with self._parts_lock:
            pending = sorted(self._parts.items())
        newest_done = None
        for step, handle in reversed(pending):
            if newest_done is None and committed_globally(self.store, handle.sid):
                newest_done = step
            if newest_done is not None and (step == newest_done or committed_globally(
                    self.store, handle.sid)):
                self._global_done(handle)
        if newest_done is not None:
            with self._parts_lock:
                for step in [s for s in self._parts if s < newest_done]:
                    del self._parts[step]   # superseded: stays "part", i.e. incomplete

    def _global_done(self, handle: SnapshotHandle) -> None:
        with self._parts_lock:
            if self._parts.pop(handle.step, None) is None:
                return
        handle.result.complete = True
        self._by_step[handle.step] = "committed"
        self._log_committed(handle)

    def await_global_commit(self, newest: Optional[SnapshotHandle]
                            ) -> Optional[IncompleteSnapshot]:
        """close(): wait at most ``global_timeout`` for the newest snapshot's global
        commit; the error naming the missing ranks if it did not come (None if it
        did, or the newest is no pending part)."""
        deadline = time.monotonic() + self.global_timeout
        while True:
            self.check_parts()
            with self._parts_lock:
                waiting = newest is not None and newest.step in self._parts
            if not waiting or time.monotonic() >= deadline:
                break
            time.sleep(POLL)   # no event to wait on: another rank's writer commits
        with self._parts_lock:
            self._parts.clear()   # what is still pending stays incomplete
        return self._incomplete_error(newest) if waiting else None

    def _incomplete_error(self, handle: SnapshotHandle) -> IncompleteSnapshot:
        part, sid = handle.part, handle.sid
        parts_dir = self.store.parts_path(sid)
        missing = [r for r in range(part.world_size) if not _has_part(parts_dir, r, part.session)]
        return IncompleteSnapshot(
            f"snapshot {sid.name} (step {handle.step}) of run {self.store.run!r} was not "
            f"committed globally within {self.global_timeout:g} s: rank(s) "
            f"{', '.join(map(str, missing)) or 'none'} of {part.world_size} have no part of "
            f"session {part.session!r} in {parts_dir} (rank {part.rank}'s is durable). It "
            "is never restored: the job resumes from its last global commit. Check that "
            f"every rank called snapshot({handle.step}); if one is only slow, raise "
            "global_commit_timeout (SNAPD_GLOBAL_COMMIT_TIMEOUT)",
            path=parts_dir, field="parts")


def committed_globally(store: RunStore, sid: SnapshotId) -> bool:
    """Whether multi-rank snapshot ``sid`` is committed: its directory on this root
    (the rename is the commit), or, on a node-local root, the marker the daemon
    writes once it sees the remote commit (snapd/remote/parts.py)."""
    return os.path.isdir(store.snapshot_path(sid)) or remote_committed(store, sid)


def _has_part(parts_dir: str, rank: int, session: str) -> bool:
    """Whether ``parts_dir`` holds a durable part of ``rank`` of ``session``."""
    try:
        manifest, _ = read_part(os.path.join(parts_dir, part_dir_name(rank)))
    except (OSError, ValueError):   # absent, or damaged (CorruptSnapshot)
        return False
    return manifest.get("session") == session
