"""The daemon path of snapshot(): a slot, the hand-off, the events.

A slot of the arena is the client's until ``submit`` and the daemon's until the
``committed``/``failed`` event for it (docs/protocol.md). ``_inflight`` maps each slot
the client cannot use to the handle of the snapshot in it; the reader thread frees
slots as events arrive, and frees them all, settling their handles, when the daemon
is lost.

A lost daemon does not mean a lost snapshot: it may have died between the commit
(the directory rename) and its ``committed`` event, or be only hung, and finish
later. So each snapshot in flight is first looked for on disk (committed: the handle
succeeds); if absent and the daemon is dead, it did not commit (a new daemon collects
its tmp dir); if absent and the daemon still lives, its outcome is unknown and the
error says so, and that the run's LATEST will tell.

A snapshot a dead daemon lost is retried (``_recover``, on the trainer's thread, at
its next log(), snapshot() or close()): its bytes are still in the slot of the
client's own arena, unchanged, as long as no later snapshot reserved that slot
(``_staged`` keeps what landed in each slot; reserving a slot drops its entry). They
are copied into a new arena attached to a new daemon and the same plan descriptor is
submitted, oldest first and before any newer snapshot, so the daemon writes them in
the original order and LATEST never moves back (no retry when LATEST already names a
later step). The handle is reopened: the retry's outcome replaces the loss. What was
lost and retried is handed to the Client as notes (``take_notes``), which it warns
with at the trainer's own line.

Restore (:func:`settle_writes`): a daemon serving the root may still be writing a
snapshot of this run and rank that a killed trainer handed off; restore waits for
those writes (bounded) before it chooses a snapshot.

The copy into the slot is the stager's (``Stager`` in staging.py: copy order, the
CUDA fence, overlap mode's background copy); the hand-off reserves the slot, gives it
to the stager with the capture, and submits once the stager says every copy has
landed. In overlap mode the client's optimizer step pre-hook calls
``Handoff.stager.synchronize()``, so no update starts before its copy is done.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import warnings
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

from snapd import protocol as proto
from snapd.errors import DaemonStartFailed, DaemonUnavailable, SnapdError
from snapd.options import SUBMIT_OPTIONS, Options
from snapd.reader import SnapshotReader
from snapd.store import RunStore, SnapshotId
from snapd.writer import CommitResult
from snapd_client.capture import Capture
from snapd_client.connection import POLL, DaemonConnection
from snapd_client.handle import SETTLE_SECONDS, SnapshotHandle
from snapd_client.hot import HotSource
from snapd_client.staging import Arena, Stager, layout, slot_size_for

logger = logging.getLogger(__name__)


def committed_on_disk(store: RunStore, sid: SnapshotId) -> Optional[CommitResult]:
    """The commit of ``sid`` if its directory holds a manifest of that step (the
    rename is the commit; the manifest checksum and file sizes are checked)."""
    path = store.snapshot_path(sid)
    try:
        manifest = SnapshotReader(path).manifest
    except (SnapdError, OSError):
        return None
    if manifest.get("step") != sid.step:
        return None
    size = sum(f.get("size", 0) for f in manifest.get("files", {}).values())
    return CommitResult(sid, path, size, 0.0)


def used_bytes(desc: dict) -> int:
    """The bytes of a slot a plan descriptor's tensors lie in (from the slot's start)."""
    return max((t["offset"] + t["nbytes"] for obj in desc["objects"]
                for t in obj["tensors"]), default=0)


def steps_text(handles: List[SnapshotHandle]) -> str:
    return ", ".join(str(h.step) for h in handles)


class Staged(NamedTuple):
    """What landed whole in a slot, kept until the slot is reserved again."""
    seq: int                  # submission order
    slot: int
    handle: SnapshotHandle
    desc: dict


def _writing(status: Dict[str, Any], run: str, rank: int) -> set:
    return {w.get("step") for w in status.get("in_flight", [])
            if w.get("run") == run and w.get("rank") == rank}


def wait_for_writes(conn: DaemonConnection, run: str, rank: int,
                    timeout: float) -> Tuple[List[int], float]:
    """Wait until none of the writes of ``run``/``rank`` in flight now is; returns
    their steps and the seconds waited. Writes submitted meanwhile (a live run beside
    a read-only reader) are not waited for. Past ``timeout``: a warning, and the
    caller restores from what is committed."""
    start = time.monotonic()
    first = _writing(conn.request(proto.Status()).status, run, rank)
    pending = set(first)
    while pending:
        if time.monotonic() - start > timeout:
            warnings.warn(
                f"the daemon serving {conn.root} is still writing step(s) "
                f"{sorted(pending)} of run {run!r} rank {rank} after {timeout} s; "
                "restoring from what is committed now (a later snapshot of the same "
                "step and lineage is accepted as the committed one)", RuntimeWarning,
                stacklevel=4)
            break
        time.sleep(POLL)
        pending &= _writing(conn.request(proto.Status()).status, run, rank)
    return sorted(first), time.monotonic() - start


def settle_writes(store: RunStore, rank: int, timeout: float) -> Tuple[List[int], float]:
    """wait_for_writes through a connection of its own, if a daemon serves the root
    (none is started); ([], 0.0) when none does or it stops answering."""
    try:
        conn = DaemonConnection(store.root, store.run, rank, timeout, spawn=False)
    except SnapdError:
        return [], 0.0
    try:
        return wait_for_writes(conn, store.run, rank, timeout)
    except SnapdError:
        return [], 0.0   # the daemon went away: what it committed is on disk
    finally:
        conn.close()


class Handoff:
    """One client's link to the daemon: connection, arena, slots, in-flight handles."""

    def __init__(self, store: RunStore, rank: int, options: Options) -> None:
        self.store, self.rank, self.options = store, rank, options
        self.conn: Optional[DaemonConnection] = None
        self.arena: Optional[Arena] = None
        self.skipped: List[int] = []          # steps skipped by on_busy="skip"
        self._inflight: dict = {}             # slot -> SnapshotHandle
        self._staged: Dict[int, Staged] = {}  # slot -> what landed whole in it
        self._seq = itertools.count()
        self._lost: List[SnapshotHandle] = []     # lost with a dead daemon, not yet told
        self._unknown: List[SnapshotHandle] = []  # a hung daemon may still commit these
        self._notes: List[str] = []           # what the trainer is told at its next call
        self._loss_settled = threading.Event()  # _on_lost has settled the lost conn's
        self._cond = threading.Condition()    # reentrant: _lose may run inside a wait
        self.stager = Stager(options.mode)    # copy order, fence, overlap thread

    # --- snapshot ------------------------------------------------------------------

    def snapshot(self, capture: Capture) -> SnapshotHandle:
        """Stage ``capture``'s leaves into a free slot; hand the slot off.

        Daemon trouble is reported through the handle, never raised, except a daemon
        that cannot be started at all (DaemonStartFailed: no snapshot can be taken).
        """
        self.stager.synchronize()
        offsets, need = layout(capture.tensors)
        try:
            conn, stall = self._room(capture.step, need)
        except DaemonStartFailed:
            raise  # no daemon can serve the root: say so now, with its log's path
        except SnapdError as e:
            handle = self._handle(capture, None, 0.0)
            handle.set_error(e)
            return handle
        if stall is None:  # on_busy="skip" and every slot busy
            handle = self._handle(capture, None, 0.0)
            handle.set_skipped()
            return handle
        handle = self._handle(capture, conn, stall)
        try:
            slot = self._reserve(conn, need, handle)
        except SnapdError as e:
            handle.set_error(e)
            return handle
        try:
            desc = capture.descriptor(offsets)   # the plan over the slot
            self.stager.stage(self.arena, slot, capture.tensors, offsets,
                              capture.deferrable,
                              lambda error: self._landed(conn, slot, desc, handle, error))
        except Exception as e:  # the slot is ours again; the handle reports why
            self._release(slot, handle, e)
        return handle

    def _room(self, step: int, need: int) -> Tuple[DaemonConnection, Optional[float]]:
        """A live connection (after a loss: the lost snapshots' retries go first, and
        take slots) and the seconds waited for a free slot (None: skip this step)."""
        stall = 0.0
        for _ in range(3):   # a daemon lost again while we waited: once more
            conn = self._connect()
            waited = self._wait_for_room(step, need)
            if waited is None:
                return conn, None
            stall += waited
            if conn.lost is None:
                break
        return conn, stall

    def _waiter(self, conn: DaemonConnection, step: int):
        return lambda ev: conn.wait_for(ev, f"the commit of step {step}")

    def _handle(self, capture: Capture, conn: Optional[DaemonConnection],
                stall: float) -> SnapshotHandle:
        """The handle, complete: where to look should the daemon be lost, the state
        the committed record logs, and a wait that watches the daemon's liveness."""
        rng, cursor = capture.record_state()
        waiter = None if conn is None else self._waiter(conn, capture.step)
        return SnapshotHandle(capture.step, sid=capture.sid, rng=rng, cursor=cursor,
                              waiter=waiter, stall_seconds=stall)

    def _landed(self, conn: DaemonConnection, slot: int, desc: dict,
                handle: SnapshotHandle, error: Optional[BaseException]) -> None:
        """The stager's thread: every copy is in the slot (or one failed)."""
        if error is not None:
            self._release(slot, handle, error)
            return
        with self._cond:   # whole in the slot: retryable should the daemon be lost
            self._staged[slot] = Staged(next(self._seq), slot, handle, desc)
        self._submit(conn, slot, desc, handle)

    def _submit(self, conn: DaemonConnection, slot: int, desc: dict,
                handle: SnapshotHandle) -> None:
        def refused(reply: Any) -> None:
            if isinstance(reply, proto.Error):
                self._release(slot, handle, reply.exception())

        # Not waited for: the trainer goes on while the daemon accepts; a refusal
        # reaches the handle, and a lost daemon fails every snapshot in flight.
        try:
            conn.send_request(proto.Submit(self.store.run, self.rank, handle.step, slot,
                                           desc, {k: getattr(self.options, k)
                                                  for k in SUBMIT_OPTIONS}), refused)
        except Exception as e:  # the handle reports it; the trainer carries on
            if isinstance(e, DaemonUnavailable) and conn.lost is not None:
                with self._cond:   # lost before it was sent: retried like the rest
                    if handle not in self._lost and handle not in self._unknown:
                        self._lost.append(handle)
            self._release(slot, handle, e)

    # --- slots -----------------------------------------------------------------------

    def _has_room(self, need: int) -> bool:
        if self.arena is None or need > self.arena.slot_bytes:
            return not self._inflight  # a new arena replaces this one once idle
        return len(self._inflight) < self.arena.slots

    def _wait_for_room(self, step: int, need: int) -> Optional[float]:
        """Backpressure: wait for a slot and return the seconds waited (the stall),
        or None when ``on_busy="skip"`` skips this step."""
        with self._cond:
            if self._has_room(need):
                return 0.0
            if self.options.on_busy == "skip":
                self.skipped.append(step)
                return None
            start = time.monotonic()
            while not self._has_room(need):
                self._cond.wait(POLL)
                try:
                    if self.conn is not None:
                        self.conn.check("a free staging slot", start)
                except DaemonUnavailable:
                    pass  # the loss freed every slot; _connect starts a new daemon
            return time.monotonic() - start

    def _reserve(self, conn: DaemonConnection, need: int, handle: SnapshotHandle) -> int:
        """A free slot of an arena large enough, attached to the daemon."""
        if self.arena is None or need > self.arena.slot_bytes:
            old, self.arena = self.arena, None
            if old is not None:
                old.close()  # idle (see _has_room); the daemon drops its mapping too
            with self._cond:
                self._staged = {}   # those bytes are gone with it
            arena = Arena(slot_size_for(need), self.options.slots,
                          self.options.copy_threads)
            try:
                conn.request(proto.Attach(self.store.run, self.rank, arena.name,
                                          arena.size, arena.slots))
            except BaseException:
                arena.close()
                raise
            self.arena = arena
        with self._cond:
            slot = min(set(range(self.arena.slots)) - set(self._inflight))
            self._inflight[slot] = handle
            self._staged.pop(slot, None)   # its bytes are about to change
        return slot

    def _release(self, slot: int, handle: SnapshotHandle,
                 error: Optional[BaseException] = None, result=None) -> None:
        with self._cond:
            if self._inflight.get(slot) is handle:
                del self._inflight[slot]
                self._cond.notify_all()
        if error is not None:
            handle.set_error(error)
        else:
            handle.set_result(result)

    def in_flight(self) -> List[SnapshotHandle]:
        """The handles whose slot the daemon holds (retries included)."""
        with self._cond:
            return list(self._inflight.values())

    # --- the daemon ------------------------------------------------------------------

    def _connect(self, spawn: bool = True) -> DaemonConnection:
        """The live connection; after a loss, recover (retries on a new daemon), then
        find (or start) a daemon."""
        if self.conn is not None and self.conn.lost is None:
            return self.conn
        if self.conn is not None:
            self._recover()
        if self.conn is None:
            self._loss_settled = threading.Event()
            self.conn = DaemonConnection(self.store.root, self.store.run, self.rank,
                                         self.options.timeout, on_event=self._on_event,
                                         on_lost=self._on_lost, spawn=spawn)
        return self.conn

    def recover(self) -> bool:
        """If the daemon was lost: recover now (the retries are in flight after it);
        whether it was. What to tell the trainer waits for take_notes()."""
        if self.conn is None or self.conn.lost is None:
            return False
        self._recover()
        return True

    def take_notes(self) -> List[str]:
        """What the trainer is to be told now (the Client warns with each): a daemon
        lost since its last call, what it lost and what was retried. Recovers first."""
        self.recover()
        notes, self._notes = self._notes, []
        return notes

    def _recover(self) -> None:
        """The trainer's thread, once the daemon is lost: drop it and its arena, after
        resubmitting to a new daemon what it lost whose bytes are still staged."""
        old = self.conn
        # The reader thread settles what was in flight (0.5 s grace for a dying
        # daemon) right after it marks the connection lost: let it finish.
        self._loss_settled.wait(SETTLE_SECONDS)
        self.stager.drain()   # every copy into the old arena has landed, landed() ran
        with self._cond:
            lost, self._lost = self._lost, []
            unknown, self._unknown = self._unknown, []
            staged, self._staged = self._staged, {}
        for h in lost + unknown:
            h.warned = True   # the note below tells of them; a retry resets it
        arena, self.arena, self.conn = self.arena, None, None
        old.close()
        retried: List[SnapshotHandle] = []
        error = None
        try:
            self._retry(self._retryable(lost, staged), arena, retried)
        except SnapdError as e:   # those not resubmitted stay lost; the note says why
            error = e
        finally:
            if arena is not None:
                arena.close()
        note = self._loss_note(old, lost, unknown, retried, error)
        if lost or unknown:
            self._notes.append(note)
        else:   # nothing was lost: worth a line, not a warning
            logger.info(f"{note}; the next snapshot() connects to a new one")

    def _retryable(self, lost: List[SnapshotHandle],
                   staged: Dict[int, Staged]) -> List[Staged]:
        """The lost snapshots still whole in their slot, in submission order; none
        older than what LATEST names (a retry must not move LATEST back)."""
        latest = self.store.read_pointer("LATEST")
        return sorted((s for s in staged.values()
                       if any(s.handle is h for h in lost) and s.handle.failed
                       and (latest is None or latest.step <= s.handle.step)),
                      key=lambda s: s.seq)

    def _retry(self, retries: List[Staged], old: Optional[Arena],
               retried: List[SnapshotHandle]) -> None:
        """Copy each lost snapshot's bytes into a new arena, attached to a new daemon,
        and submit the same plan: the bytes staged before the loss, unchanged."""
        if not retries or old is None:
            return
        conn = self._connect()   # self.conn is None: finds or starts a daemon
        need = max(used_bytes(s.desc) for s in retries)
        for s in retries:
            s.handle.reopen(self._waiter(conn, s.handle.step))
            try:
                slot = self._reserve(conn, need, s.handle)
                n = used_bytes(s.desc)
                self.arena.view(slot, 0, n).copy_(old.view(s.slot, 0, n))
            except BaseException as e:
                s.handle.set_error(e)
                raise
            with self._cond:
                self._staged[slot] = Staged(next(self._seq), slot, s.handle, s.desc)
            retried.append(s.handle)
            self._submit(conn, slot, s.desc, s.handle)

    def _loss_note(self, old: DaemonConnection, lost: List[SnapshotHandle],
                   unknown: List[SnapshotHandle], retried: List[SnapshotHandle],
                   error: Optional[BaseException]) -> str:
        gone = [h for h in lost if not any(h is r for r in retried)]
        what = []
        if retried:
            what.append(f"step(s) {steps_text(retried)} did not commit and are retried "
                        f"on a new daemon (pid {self.conn.daemon_pid}) from the bytes "
                        "still staged")
        if gone:
            why = f"the retry failed: {error}" if error is not None else \
                "their staged bytes were no longer whole, or a later snapshot is committed"
            what.append(f"step(s) {steps_text(gone)} did not commit ({why})")
        if unknown:
            what.append(f"the outcome of step(s) {steps_text(unknown)} is unknown (the "
                        f"old daemon still runs): {self.store.path}/LATEST will tell")
        return (f"the snapd daemon serving {self.store.root} was lost ({old.lost}); "
                f"{'; '.join(what) or 'no snapshot was in flight'}")

    def _on_event(self, event) -> None:
        """Reader thread: a committed/failed event frees its slot."""
        with self._cond:
            handle = self._inflight.get(event.slot)
        if handle is None or handle.step != event.step:
            return  # not ours (or already failed locally): nothing to free
        if isinstance(event, proto.Committed):
            sid = SnapshotId.parse(event.name)
            result = CommitResult(sid, self.store.snapshot_path(sid) if sid else event.name,
                                  event.bytes, event.seconds)
            self._release(event.slot, handle, result=result)
        else:
            self._release(event.slot, handle, event.exception())

    def _on_lost(self, error: DaemonUnavailable) -> None:
        try:
            with self._cond:
                handles, self._inflight = list(self._inflight.values()), {}
                self._cond.notify_all()
            alive = self._daemon_survives()
            for h in handles:
                self._settle_lost(h, error, alive)
        finally:
            self._loss_settled.set()

    def _daemon_survives(self, grace: float = 0.5) -> bool:
        """Whether the lost daemon still runs. A killed one may close its socket an
        instant before it turns into a zombie: look again for ``grace`` seconds."""
        conn = self.conn
        if conn is None:
            return False
        deadline = time.monotonic() + grace
        while conn.daemon_alive():
            if time.monotonic() > deadline:
                return True
            time.sleep(0.05)
        return False

    def _settle_lost(self, handle: SnapshotHandle, error: DaemonUnavailable,
                     alive: bool) -> None:
        """A snapshot in flight when the daemon was lost: committed, lost, or unknown."""
        sid = handle.sid
        result = committed_on_disk(self.store, sid) if sid is not None else None
        if result is not None:   # committed before the event could be sent
            handle.set_result(result)
            return
        with self._cond:
            (self._unknown if alive else self._lost).append(handle)
        if not alive:   # a dead daemon's tmp dir is never published
            handle.set_error(DaemonUnavailable(
                f"{error}; step {handle.step} did not commit. The next log(), snapshot() "
                "or close() retries it on a new daemon if its staged bytes are whole"))
            return
        where = self.store.snapshot_path(sid) if sid is not None else self.store.path
        handle.set_unknown(DaemonUnavailable(
            f"{error}. The daemon (pid {self.conn.daemon_pid}) still runs and may yet "
            f"commit step {handle.step}: its outcome is unknown. "
            f"{self.store.path}/LATEST will tell (`snapd ls --root {self.store.root}`): "
            f"the step is durable once {where} exists"))

    # --- restore and shutdown ----------------------------------------------------------

    def settle_writes(self) -> Tuple[List[int], float]:
        """Wait for the daemon's writes of this run and rank (see wait_for_writes)."""
        try:
            conn = self._connect(spawn=False)
            return wait_for_writes(conn, self.store.run, self.rank, self.options.timeout)
        except SnapdError:
            return [], 0.0   # no daemon, or none that answers: restore reads the files

    def hot_source(self) -> Optional[HotSource]:
        """The daemon's held copy of this run, if a daemon already serves the root."""
        try:
            reply = self._connect(spawn=False).request(proto.HotGet(self.store.run,
                                                                    self.rank))
        except SnapdError:
            return None  # no daemon (or none that answers): restore reads the files
        if not reply.shm or not reply.snapshot or not isinstance(reply.plan, dict):
            return None
        return HotSource(reply.shm, reply.snapshot, reply.plan)

    def drain(self) -> None:
        """Finish every staging copy and submit started (submits are bounded)."""
        self.stager.drain()

    def close(self) -> None:
        """Unlink the arena and hang up (after the handles are resolved)."""
        self.drain()
        if self.arena is not None:
            self.arena.close()
            self.arena = None
        if self.conn is not None:
            self.conn.close()
