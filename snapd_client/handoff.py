"""The daemon path of snapshot(): a slot, the hand-off, the events.

A slot of the arena is the client's until ``submit`` and the daemon's until the
``committed``/``failed`` event for it (docs/protocol.md). ``_inflight`` maps each slot
the client cannot use to the handle of the snapshot in it; the reader thread frees
slots as events arrive, and frees them all, failing their handles with
DaemonUnavailable, when the daemon is lost. The next snapshot() then warns, starts a
new daemon and a new arena (the old daemon, if only hung, unlinks the old one when it
notices the dropped connection), and carries on.

A lost daemon does not mean a lost snapshot: it may have died between the commit
(the directory rename) and its ``committed`` event, or be only hung, and finish
later. So each snapshot in flight is first looked for on disk (committed: the handle
succeeds); if absent and the daemon is dead, it did not commit (a new daemon collects
its tmp dir); if absent and the daemon still lives, its outcome is unknown and the
error says so, and that the run's LATEST will tell.

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

import threading
import time
import warnings
from typing import Any, Dict, List, Optional, Tuple

from snapd import protocol as proto
from snapd.errors import DaemonStartFailed, DaemonUnavailable, SnapdError
from snapd.options import SUBMIT_OPTIONS, Options
from snapd.reader import SnapshotReader
from snapd.store import RunStore, SnapshotId
from snapd.writer import CommitResult
from snapd_client.capture import Capture
from snapd_client.connection import POLL, DaemonConnection
from snapd_client.handle import SnapshotHandle
from snapd_client.hot import HotSource
from snapd_client.staging import Arena, Stager, layout, slot_size_for


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
        self._lost: List[int] = []            # steps lost with a daemon, not yet warned
        self._unknown: List[int] = []         # steps a hung daemon may still commit
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
        stall = self._wait_for_room(capture.step, need)
        if stall is None:  # on_busy="skip" and every slot busy
            handle = self._handle(capture, None, 0.0)
            handle.set_skipped()
            return handle
        try:
            conn = self._connect()
        except DaemonStartFailed:
            raise  # no daemon can serve the root: say so now, with its log's path
        except SnapdError as e:
            handle = self._handle(capture, None, stall)
            handle.set_error(e)
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

    def _handle(self, capture: Capture, conn: Optional[DaemonConnection],
                stall: float) -> SnapshotHandle:
        """The handle, complete: where to look should the daemon be lost, the state
        the committed record logs, and a wait that watches the daemon's liveness."""
        rng, cursor = capture.record_state()
        waiter = None if conn is None else \
            (lambda ev: conn.wait_for(ev, f"the commit of step {capture.step}"))
        return SnapshotHandle(capture.step, sid=capture.sid, rng=rng, cursor=cursor,
                              waiter=waiter, stall_seconds=stall)

    def _landed(self, conn: DaemonConnection, slot: int, desc: dict,
                handle: SnapshotHandle, error: Optional[BaseException]) -> None:
        """The stager's thread: every copy is in the slot (or one failed)."""
        if error is not None:
            self._release(slot, handle, error)
        else:
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

    # --- the daemon ------------------------------------------------------------------

    def _connect(self, spawn: bool = True) -> DaemonConnection:
        """The live connection; after a loss, warn, then find (or start) a daemon."""
        if self.conn is not None and self.conn.lost is None:
            return self.conn
        if self.conn is not None:
            self._forget_daemon()
            self.conn = None
        self.conn = DaemonConnection(self.store.root, self.store.run, self.rank,
                                     self.options.timeout, on_event=self._on_event,
                                     on_lost=self._on_lost, spawn=spawn)
        return self.conn

    def _forget_daemon(self) -> None:
        with self._cond:
            lost, self._lost = self._lost, []
            unknown, self._unknown = self._unknown, []
        what = (f"the snapshot(s) of step(s) {', '.join(map(str, lost))} did not commit"
                if lost else "no snapshot was lost")
        if unknown:
            what += (f"; the outcome of step(s) {', '.join(map(str, unknown))} is unknown "
                     f"(the old daemon still runs): {self.store.path}/LATEST will tell")
        warnings.warn(f"the snapd daemon serving {self.store.root} was lost "
                      f"({self.conn.lost}); {what}. Starting a new daemon.",
                      RuntimeWarning, stacklevel=5)
        self.conn.close()
        if self.arena is not None:
            self.arena.close()
            self.arena = None

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
        with self._cond:
            handles, self._inflight = list(self._inflight.values()), {}
            self._cond.notify_all()
        alive = self._daemon_survives()
        for h in handles:
            self._settle_lost(h, error, alive)

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
            (self._unknown if alive else self._lost).append(handle.step)
        if not alive:   # a dead daemon's tmp dir is never published
            handle.set_error(error)
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
