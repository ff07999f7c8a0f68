"""The daemon path of snapshot(): a slot, the hand-off, the events.

A slot of the arena is the client's until ``submit`` and the daemon's until the
``committed``/``failed`` event for it (docs/protocol.md). ``_inflight`` maps each slot
the client cannot use to the handle of the snapshot in it; the reader thread frees
slots as events arrive, and frees them all, settling their handles, when the daemon
is lost.

A lost daemon does not mean a lost snapshot: what happens to the snapshots in
flight then (found on disk, retried from the staged bytes, or unknown) is
lostdaemon.py's ``Recovery``. The hand-off tells it what lands whole in a slot and
which slot is reused, hands it the handles in flight when the connection is lost,
and lends it, for a retry, a new daemon and a slot (``connect``, ``resubmit``).

The copy into the slot is the stager's (``Stager`` in staging.py: copy order, the
CUDA fence, overlap mode's background copy); the hand-off reserves the slot, gives it
to the stager with the capture, and submits once the stager says every copy has
landed. In overlap mode the client's optimizer step pre-hook calls
``Handoff.stager.synchronize()``, so no update starts before its copy is done.

The hot copy is a slot of the arena: with ``hot_restore`` (and one rank) the arena
has one slot more than ``Options.slots``, and the slot of the latest commit is
*kept* (``_kept``): the daemon holds it as the run's hot copy from before its
``committed`` event until the next commit's, and the client stages into the others
meanwhile. /dev/shm thus holds the state twice (once without ``hot_restore``).

Warm-up (:meth:`Handoff.warm_up`, from ``track()`` and ``restore()``), so that the
first snapshot() costs what later ones do: on the trainer's own thread, the daemon is
connected (started when none serves the root) and an arena for the tracked state's
bytes is created and attached; its pages are faulted in on a short-lived thread
(prefault.py) that calls nothing but ``madvise``, is paused while the process forks
(a DataLoader's workers) and while a restore runs, and is finished by the first
snapshot(). Nothing else runs off the trainer's thread: the sizes come from the
capture ``track()`` takes there. A daemon that could not be started is raised by the
first snapshot(), as it would have been without the warm-up; any other failure, the
first snapshot() meets again itself and reports as usual. A restarted trainer whose
daemon still holds the earlier trainer's arena (its hot copy) gets its own arena
only after ``restore()`` let that one go (``hot_release``): never both at once.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional, Tuple

from snapd import protocol as proto
from snapd.cpulanes import current_cpu
from snapd.errors import (DaemonStartFailed, DaemonUnavailable, InsufficientSpace,
                          OptionMismatch, ProtocolMismatch, SnapdError)
from snapd.names import SHM_DIR
from snapd.options import SUBMIT_OPTIONS, Options
from snapd.plan import used_bytes
from snapd.store import RunStore, SnapshotId
from snapd.writer import CommitResult
from snapd_client.capture import Capture
from snapd_client.connection import POLL, DaemonConnection
from snapd_client.handle import SnapshotHandle, part_of
from snapd_client.lostdaemon import Recovery, Staged, wait_for_writes
from snapd_client.staging import Arena, Stager, layout, slot_size_for

logger = logging.getLogger(__name__)


class Handoff:
    """One client's link to the daemon: connection, arena, slots, in-flight handles."""

    def __init__(self, store: RunStore, rank: int, options: Options,
                 world_size: int = 1, given: Optional[Dict[str, Any]] = None,
                 signing_key_id: Optional[str] = None) -> None:
        self.store, self.rank, self.options = store, rank, options
        self.given = given   # the daemon-wide options the client was given (hello)
        self.signing_key_id = signing_key_id   # the id of its signing key (hello)
        # The committed slot serves as the hot copy; a multi-rank job restores from
        # the files only, so its arena has no slot to spare.
        self.hot = bool(options.hot_restore) and world_size == 1
        self.conn: Optional[DaemonConnection] = None
        self.arena: Optional[Arena] = None
        self.skipped: List[int] = []          # steps skipped by on_busy="skip"
        self._inflight: dict = {}             # slot -> SnapshotHandle
        self._kept: Optional[int] = None      # the latest commit's slot: the hot copy
        self._cond = threading.Condition()    # reentrant: _lose may run inside a wait
        self._warm_error: Optional[BaseException] = None   # see _join_warm_up
        self._closing = False                 # close() began: no more warm-up
        self.recovery = Recovery(store, self._cond)  # what a lost daemon takes with it
        self.stager = Stager(options.mode)    # copy order, fence, overlap thread
        # The CPU the latest snapshot() was called on, sent with each submit (the
        # stager's thread may send it): the daemon keeps its hashing off that CPU.
        self.trainer_cpu: Optional[int] = None

    # --- snapshot ------------------------------------------------------------------

    def snapshot(self, capture: Capture) -> SnapshotHandle:
        """Stage ``capture``'s leaves into a free slot; hand the slot off.

        Daemon trouble is reported through the handle, never raised, except a daemon
        that cannot be started at all (DaemonStartFailed) or that refuses this client
        (OptionMismatch, ProtocolMismatch): no snapshot can be taken.
        """
        self.trainer_cpu = current_cpu()   # the daemon's hashing keeps off it
        self.stager.synchronize()
        self._join_warm_up()
        offsets, need = layout(capture.tensors, capture.carried)  # copied bytes only
        try:
            conn, stall = self._room(capture.step, need)
        except (DaemonStartFailed, OptionMismatch, ProtocolMismatch):
            raise  # no daemon can serve the root: say so now, with what to do
        except SnapdError as e:
            handle = self._handle(capture, None, 0.0)
            handle.set_error(e)
            return handle
        if stall is None:  # on_busy="skip" and every slot busy
            handle = self._handle(capture, None, 0.0)
            handle.set_skipped()
            return handle
        handle = self._handle(capture, conn, stall)
        handle.staged_bytes = need
        try:
            slot = self._reserve(conn, need, handle)
        except SnapdError as e:
            handle.set_error(e)
            return handle
        try:
            desc = capture.descriptor(offsets)   # the plan over the slot
            self.stager.stage(self.arena, slot, capture.tensors, offsets,
                              capture.deferrable,
                              lambda error: self._landed(conn, slot, desc, handle, error),
                              capture.carried)
        except Exception as e:  # the slot is ours again; the handle reports why
            self._release(slot, handle, e)
        return handle

    def _room(self, step: int, need: int) -> Tuple[DaemonConnection, Optional[float]]:
        """A live connection (after a loss: the lost snapshots' retries go first, and
        take slots) and the seconds waited for a free slot (None: skip this step)."""
        stall = 0.0
        for _ in range(3):   # a daemon lost again while we waited: once more
            conn = self.connect()
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
                              waiter=waiter, stall_seconds=stall, part=part_of(capture))

    def _landed(self, conn: DaemonConnection, slot: int, desc: dict,
                handle: SnapshotHandle, error: Optional[BaseException]) -> None:
        """The stager's thread: every copy is in the slot (or one failed)."""
        if error is not None:
            self._release(slot, handle, error)
            return
        self.recovery.landed(slot, handle, desc)
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
                                                  for k in SUBMIT_OPTIONS},
                                           self.trainer_cpu), refused)
        except Exception as e:  # the handle reports it; the trainer carries on
            if isinstance(e, DaemonUnavailable) and conn.lost is not None:
                self.recovery.unsent(handle)
            self._release(slot, handle, e)

    # --- slots -----------------------------------------------------------------------

    def _has_room(self, need: int) -> bool:
        if self.arena is None or need > self.arena.slot_bytes:
            return not self._inflight  # a new arena replaces this one once idle
        # At most Options.slots in flight; the kept slot is the hot copy's.
        return len(self._inflight) < self.options.slots and \
            len(self._inflight) + (self._kept is not None) < self.arena.slots

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
                    pass  # the loss freed every slot; connect() starts a new daemon
            return time.monotonic() - start

    def _reserve(self, conn: DaemonConnection, need: int, handle: SnapshotHandle) -> int:
        """A free slot of an arena large enough, attached to the daemon."""
        if self.arena is None or need > self.arena.slot_bytes:
            self._new_arena(conn, need)
        with self._cond:
            kept = set() if self._kept is None else {self._kept}
            slot = min(set(range(self.arena.slots)) - set(self._inflight) - kept)
            busy = bool(self._inflight)
        # A warm-up's pages: what is left of this slot's is faulted in now.
        if not self.arena.ready(slot):
            if busy:   # another slot is in use: this arena cannot be replaced now
                raise InsufficientSpace(
                    f"{self.arena.path}: the pages of staging slot {slot} could not be "
                    f"allocated; this snapshot is not taken, and the arena is made "
                    f"again once the snapshots in flight end. Free space in {SHM_DIR} "
                    "or use slots=1", path=self.arena.path, field="slots")
            self._new_arena(conn, need)   # allocated here, or raised
            slot = 0
        with self._cond:
            self._inflight[slot] = handle
            self.recovery.reserved(slot)
        return slot

    @property
    def staging_settled(self) -> bool:
        """The staging arena is made and faulted in whole: the next snapshot's stall
        is a steady one (what the cadence's first snapshot or probe must measure)."""
        return self.arena is not None and self.arena.faulted_in

    def _new_arena(self, conn: DaemonConnection, need: int,
                   background: bool = False) -> None:
        """Replace the (idle) arena with one whose slots hold ``need`` bytes, attached
        to the daemon; hot: a slot more, for the latest commit."""
        old, self.arena = self.arena, None
        with self._cond:
            self._kept = None   # the daemon holds the old arena's slot until the next commit
        if old is not None:
            old.close()  # idle (see _has_room); the daemon drops its mapping too
        self.recovery.arena_dropped()
        arena = Arena(slot_size_for(need), self.options.slots + self.hot,
                      self.options.copy_threads, background=background)
        try:
            conn.request(proto.Attach(self.store.run, self.rank, arena.name,
                                      arena.size, arena.slots, hot=self.hot))
        except BaseException:
            arena.close()
            raise
        self.arena = arena

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

    def connect(self, spawn: bool = True) -> DaemonConnection:
        """The live connection; after a loss, recover (retries on a new daemon), then
        find (or start) a daemon."""
        if self.conn is not None and self.conn.lost is None:
            return self.conn
        if self.conn is not None:
            self._recover()
        if self.conn is None:
            self.recovery.connecting()
            self.conn = DaemonConnection(self.store.root, self.store.run, self.rank,
                                         self.options.timeout, on_event=self._on_event,
                                         on_lost=self._on_lost, spawn=spawn,
                                         options=self.options, given=self.given,
                                         signing_key_id=self.signing_key_id)
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
        return self.recovery.take_notes()

    def _recover(self) -> None:
        """The trainer's thread, once the daemon is lost: drop it and its arena, after
        resubmitting to a new daemon what it lost whose bytes are still staged."""
        old, arena = self.conn, self.arena
        loss = self.recovery.collect(self.stager.drain)  # every copy has landed
        self.arena, self.conn = None, None
        old.close()
        self.recovery.retry(loss, old, arena, self)

    def resubmit(self, conn: DaemonConnection, staged: Staged, need: int,
                 old: Arena) -> None:
        """A retry: the bytes staged in ``old`` before the loss, unchanged, copied into
        a slot of a new arena attached to ``conn``'s daemon, and the same plan."""
        handle, desc = staged.handle, staged.desc
        handle.reopen(self._waiter(conn, handle.step))
        try:
            slot = self._reserve(conn, need, handle)
            n = used_bytes(desc)
            self.arena.view(slot, 0, n).copy_(old.view(staged.slot, 0, n))
        except BaseException as e:
            handle.set_error(e)
            raise
        self.recovery.landed(slot, handle, desc)
        self._submit(conn, slot, desc, handle)

    def _on_event(self, event) -> None:
        """Reader thread: a committed/failed event frees its slot."""
        with self._cond:
            handle = self._inflight.get(event.slot)
        if handle is None or handle.step != event.step:
            return  # not ours (or already failed locally): nothing to free
        if isinstance(event, proto.Committed):
            if self.hot:   # the daemon now holds this slot, and let go of the last
                with self._cond:
                    self._kept = event.slot
            sid = SnapshotId.parse(event.name)
            # complete False: a part, durable; the snapshot waits for other ranks.
            result = CommitResult(sid, self.store.snapshot_path(sid) if sid else event.name,
                                  event.bytes, event.seconds, complete=event.complete,
                                  manifest_sha256=event.manifest_sha256)
            self._release(event.slot, handle, result=result)
        else:
            self._release(event.slot, handle, event.exception())

    def _on_lost(self, error: DaemonUnavailable) -> None:
        """Reader thread: the daemon is lost; every slot is free, and what was in
        flight is settled (committed, lost or unknown: see Recovery.settle)."""
        with self._cond:
            handles, self._inflight = list(self._inflight.values()), {}
            self._kept = None   # nobody holds a slot of it now
            self._cond.notify_all()
        self.recovery.settle(handles, error, self.conn)

    # --- restore and shutdown ----------------------------------------------------------

    def settle_writes(self) -> Tuple[List[int], float]:
        """Wait for the daemon's writes of this run and rank (see wait_for_writes)."""
        try:
            conn = self.connect(spawn=False)
            return wait_for_writes(conn, self.store.run, self.rank, self.options.timeout)
        except SnapdError:
            return [], 0.0   # no daemon, or none that answers: restore reads the files

    def reach(self) -> None:
        """Connect to a daemon already serving the root, if one does (a read-only
        client's track(): its restore then asks at once); never starts one."""
        try:
            self.connect(spawn=False)
        except SnapdError:
            pass   # none serves: restore reads the files

    def release_hot(self) -> None:
        """After this client restored: the daemon lets go of the copy it held for an
        earlier client of the run and rank (that client's arena leaves /dev/shm)."""
        try:
            self.connect(spawn=False).request(proto.HotRelease(self.store.run, self.rank))
        except SnapdError as e:   # the copy then goes at the first commit, as before
            logger.debug("run %s: the daemon did not release the old hot copy: %s",
                         self.store.run, e)

    def drain(self) -> None:
        """Finish every staging copy and submit started (submits are bounded)."""
        self.stager.drain()

    # --- warm-up -----------------------------------------------------------------------

    def warm_up(self, need: Optional[int]) -> None:
        """Ready the first snapshot: on the calling thread, the daemon connected
        (started when none serves the root) and an arena for ``need`` bytes (None:
        not yet) created and attached; its pages are faulted in on prefault.py's
        thread (see the module's docstring). Never raises (see _join_warm_up)."""
        if self._closing:
            return
        self._warm_error = None
        try:
            conn = self.connect()
            if need is None:
                return
            if self.arena is not None and need <= self.arena.slot_bytes:
                self.arena.fault_in(background=True)   # resumed, if a restore paused it
                return
            with self._cond:
                busy = bool(self._inflight)
            if busy or (self.arena is None and self._held_by_daemon(conn)):
                return   # replaced once idle / made by restore(), after hot_release
            self._new_arena(conn, need, background=True)
        except DaemonStartFailed as e:   # no snapshot can be taken: the first says so
            self._warm_error = e
        except Exception as e:   # the first snapshot meets it again, and reports it
            logger.debug("run %s: the warm-up failed (%r); the first snapshot does "
                         "its work", self.store.run, e)

    def _held_by_daemon(self, conn: DaemonConnection) -> bool:
        """The daemon holds a hot copy of this run and rank (an earlier trainer's
        arena): a restart's arena waits for restore() to let it go, so that /dev/shm
        never holds both (4x the state)."""
        if not self.hot:
            return False
        reply = conn.request(proto.HotGet(self.store.run, self.rank))
        return bool(getattr(reply, "shm", None))

    def _join_warm_up(self) -> None:
        """Raise the DaemonStartFailed the warm-up met (the snapshot would meet it
        again, after as long a wait); once."""
        error, self._warm_error = self._warm_error, None
        if error is not None:
            raise error

    @contextmanager
    def paused(self) -> Iterator[None]:
        """No faulting in of the arena while this runs (a restore has the CPUs and
        the memory bandwidth); it goes on after."""
        if self.arena is not None:
            self.arena.pause_fault_in()
        try:
            yield
        finally:
            if self.arena is not None and not self.arena.closed:
                self.arena.fault_in(background=True)

    def close(self) -> None:
        """Unlink the arena and hang up (after the handles are resolved)."""
        self._closing = True   # no warm-up from here
        self.drain()
        if self.arena is not None:
            self.arena.close()
            self.arena = None
        if self.conn is not None:
            self.conn.close()
