"""What happens to the snapshots in flight when the daemon is lost.

A lost daemon does not mean a lost snapshot: it may have died between the commit
(the directory rename) and its ``committed`` event, or be only hung, and finish
later. So each snapshot in flight is first looked for on disk (committed: the handle
succeeds); if absent and the daemon is dead, it did not commit (a new daemon collects
its tmp dir); if absent and the daemon still lives, its outcome is unknown and the
error says so, and that the run's LATEST will tell (:meth:`Recovery.settle`, on the
connection's reader thread).

A snapshot a dead daemon lost is retried (:meth:`Recovery.retry`, on the trainer's
thread, at its next log(), snapshot() or close()): its bytes are still in the slot of
the client's own arena, unchanged, as long as no later snapshot reserved that slot
(``Recovery`` keeps what landed in each slot; reserving a slot drops its entry). They
are copied into a new arena attached to a new daemon and the same plan descriptor is
submitted, oldest first and before any newer snapshot, so the daemon writes them in
the original order and LATEST never moves back (no retry when LATEST already names a
later step). The handle is reopened: the retry's outcome replaces the loss. What was
lost and retried is handed to the Client as notes (``take_notes``), which it warns
with at the trainer's own line.

``Handoff`` (handoff.py) owns the connection, the arena and the slots; it tells a
``Recovery`` what lands in a slot and which slot is reused, hands it the snapshots in
flight when the connection is lost, and, for a retry, lends it a ``Resubmitter``: a
new daemon and the copy into one of its slots.

Restore (:func:`settle_writes`): a daemon serving the root may still be writing a
snapshot of this run and rank that a killed trainer handed off; restore waits for
those writes (bounded) before it chooses a snapshot.
"""

from __future__ import annotations

import itertools
import os
import logging
import threading
import time
import warnings
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Protocol, Tuple

from snapd import protocol as proto
from snapd.format import part_dir_name
from snapd.globalcommit import read_part
from snapd.plan import used_bytes
from snapd.errors import DaemonUnavailable, SnapdError
from snapd.reader import SnapshotReader
from snapd.store import RunStore, SnapshotId
from snapd.writer import CommitResult
from snapd_client.connection import POLL, DaemonConnection
from snapd_client.handle import SETTLE_SECONDS, PartOf, SnapshotHandle
from snapd_client.staging import Arena

logger = logging.getLogger(__name__)


def committed_on_disk(store: RunStore, sid: SnapshotId,
                      part: Optional[PartOf] = None) -> Optional[CommitResult]:
    """The commit of ``sid`` if its directory holds a manifest of that step (the
    rename is the commit; the manifest checksum and file sizes are checked).

    ``part``: a multi-rank snapshot's part (this rank's, of this session): found in
    the committed snapshot (``complete``), or durable under ``.parts-<name>``
    (``complete`` False: the snapshot waits for other ranks)."""
    if part is not None:
        return _part_on_disk(store, sid, part)
    path = store.snapshot_path(sid)
    try:
        manifest = SnapshotReader(path).manifest
    except (SnapdError, OSError):
        return None
    if manifest.get("step") != sid.step:
        return None
    size = sum(f.get("size", 0) for f in manifest.get("files", {}).values())
    return CommitResult(sid, path, size, 0.0)


def _part_on_disk(store: RunStore, sid: SnapshotId, part: PartOf) -> Optional[CommitResult]:
    final = store.snapshot_path(sid)
    # The global commit renames .parts-<name> to <name>: looking at the committed
    # place again after the parts dir sees a part that moved between the two looks.
    for base in (final, store.parts_path(sid), final):
        try:
            manifest, _ = read_part(os.path.join(base, part_dir_name(part.rank)))
        except (SnapdError, OSError):
            continue
        if (manifest.get("step"), manifest.get("rank"), manifest.get("session")) == \
                (sid.step, part.rank, part.session):
            size = sum(f.get("size", 0) for f in manifest.get("files", {}).values())
            return CommitResult(sid, final, size, 0.0, complete=base == final)
    return None


def steps_text(handles: List[SnapshotHandle]) -> str:
    return ", ".join(str(h.step) for h in handles)


# --- restore: the writes a killed trainer handed off -----------------------------------

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
    (none is started); ([], 0.0) when none does or it stops answering.

    It says hello as a tool (no run): a client of the run that hangs up with ``bye``
    tells the daemon that nobody will restart from the run's hot copy, which a
    crashed trainer's restart is about to read."""
    try:
        conn = DaemonConnection(store.root, "", rank, timeout, spawn=False)
    except SnapdError:
        return [], 0.0
    try:
        return wait_for_writes(conn, store.run, rank, timeout)
    except SnapdError:
        return [], 0.0   # the daemon went away: what it committed is on disk
    finally:
        conn.close()


# --- the loss ----------------------------------------------------------------------------

class Staged(NamedTuple):
    """What landed whole in a slot, kept until the slot is reserved again."""
    seq: int                  # submission order
    slot: int
    handle: SnapshotHandle
    desc: dict


class Loss(NamedTuple):
    """What a lost daemon left, taken once the reader thread and the stager are done."""
    lost: List[SnapshotHandle]      # a dead daemon's: did not commit
    unknown: List[SnapshotHandle]   # a hung daemon's: may still commit
    staged: Dict[int, Staged]       # slot -> bytes still whole in the old arena


class Resubmitter(Protocol):
    """What a retry needs of the hand-off (``Handoff`` is one)."""

    def connect(self) -> DaemonConnection:
        """The live connection: a new daemon, found or started."""

    def resubmit(self, conn: DaemonConnection, staged: Staged, need: int,
                 old: Arena) -> None:
        """Reopen ``staged.handle``, copy its bytes from ``old`` into a free slot of
        an arena of ``need``-byte slots, and submit the same plan."""


class Recovery:
    """One hand-off's book of what a lost daemon takes with it, and its retries.

    ``lock`` is the hand-off's (it guards the slots too): the book changes as the
    slots do, on the trainer's, the stager's and the reader's threads.
    """

    def __init__(self, store: RunStore, lock: threading.Condition) -> None:
        self.store = store
        self._lock = lock
        self._staged: Dict[int, Staged] = {}  # slot -> what landed whole in it
        self._seq = itertools.count()
        self._lost: List[SnapshotHandle] = []     # lost with a dead daemon, not yet told
        self._unknown: List[SnapshotHandle] = []  # a hung daemon may still commit these
        self._notes: List[str] = []           # what the trainer is told at its next call
        self._settled = threading.Event()     # settle() is done with the lost conn's

    # --- the slots, as the hand-off changes them ----------------------------------------

    def landed(self, slot: int, handle: SnapshotHandle, desc: dict) -> None:
        """Whole in the slot: retryable should the daemon be lost."""
        with self._lock:
            self._staged[slot] = Staged(next(self._seq), slot, handle, desc)

    def reserved(self, slot: int) -> None:
        """The slot's bytes are about to change."""
        with self._lock:
            self._staged.pop(slot, None)

    def arena_dropped(self) -> None:
        """Every slot's bytes are gone with the arena."""
        with self._lock:
            self._staged = {}

    def unsent(self, handle: SnapshotHandle) -> None:
        """Lost before its submit was sent: retried like the rest."""
        with self._lock:
            if handle not in self._lost and handle not in self._unknown:
                self._lost.append(handle)

    def connecting(self) -> None:
        """A new connection: its loss, if any, is settled afresh."""
        self._settled = threading.Event()

    # --- the reader thread: settle what was in flight -----------------------------------

    def settle(self, handles: List[SnapshotHandle], error: DaemonUnavailable,
               conn: Optional[DaemonConnection]) -> None:
        """Each snapshot in flight on the lost ``conn``: committed, lost, or unknown."""
        try:
            alive = daemon_survives(conn)
            for h in handles:
                self._settle_one(h, error, alive, conn)
        finally:
            self._settled.set()

    def _settle_one(self, handle: SnapshotHandle, error: DaemonUnavailable,
                    alive: bool, conn: Optional[DaemonConnection]) -> None:
        sid = handle.sid
        result = committed_on_disk(self.store, sid, handle.part) if sid is not None \
            else None
        if result is not None:   # committed before the event could be sent
            handle.set_result(result)
            return
        with self._lock:
            (self._unknown if alive else self._lost).append(handle)
        if not alive:   # a dead daemon's tmp dir is never published
            handle.set_error(DaemonUnavailable(
                f"{error}; step {handle.step} did not commit. The next log(), snapshot() "
                "or close() retries it on a new daemon if its staged bytes are whole"))
            return
        where = self.store.snapshot_path(sid) if sid is not None else self.store.path
        handle.set_unknown(DaemonUnavailable(
            f"{error}. The daemon (pid {conn.daemon_pid}) still runs and may yet "
            f"commit step {handle.step}: its outcome is unknown. "
            f"{self.store.path}/LATEST will tell (`snapd ls --root {self.store.root}`): "
            f"the step is durable once {where} exists"))

    # --- the trainer's thread: retry, then tell ------------------------------------------

    def collect(self, drain: Callable[[], None]) -> Loss:
        """What the loss left, once the reader thread has settled it and ``drain``
        has landed every copy into the old arena."""
        # The reader thread settles what was in flight (0.5 s grace for a dying
        # daemon) right after it marks the connection lost: let it finish.
        self._settled.wait(SETTLE_SECONDS)
        drain()
        with self._lock:
            loss = Loss(self._lost, self._unknown, self._staged)
            self._lost, self._unknown, self._staged = [], [], {}
        for h in loss.lost + loss.unknown:
            h.warned = True   # the note tells of them; a retry resets it
        return loss

    def retry(self, loss: Loss, old: DaemonConnection, arena: Optional[Arena],
              target: Resubmitter) -> None:
        """Resubmit through ``target`` what ``loss`` lost whose bytes are still whole
        in ``arena`` (then closed), and note what happened for the trainer."""
        retried: List[SnapshotHandle] = []
        conn, error = None, None
        try:
            retries = self._retryable(loss)
            if retries and arena is not None:
                conn = target.connect()   # finds or starts a new daemon
                need = max(used_bytes(s.desc) for s in retries)
                for s in retries:
                    target.resubmit(conn, s, need, arena)
                    retried.append(s.handle)
        except SnapdError as e:   # those not resubmitted stay lost; the note says why
            error = e
        finally:
            if arena is not None:
                arena.close()
        note = self._loss_note(old, loss, retried, conn, error)
        if loss.lost or loss.unknown:
            self._notes.append(note)
        else:   # nothing was lost: worth a line, not a warning
            logger.info(f"{note}; the next snapshot() connects to a new one")

    def take_notes(self) -> List[str]:
        """What the trainer is to be told now, and not again."""
        notes, self._notes = self._notes, []
        return notes

    def _retryable(self, loss: Loss) -> List[Staged]:
        """The lost snapshots still whole in their slot, in submission order; none
        older than what LATEST names (a retry must not move LATEST back)."""
        latest = self.store.read_pointer("LATEST")
        return sorted((s for s in loss.staged.values()
                       if any(s.handle is h for h in loss.lost) and s.handle.failed
                       and (latest is None or latest.step <= s.handle.step)),
                      key=lambda s: s.seq)

    def _loss_note(self, old: DaemonConnection, loss: Loss, retried: List[SnapshotHandle],
                   new: Optional[DaemonConnection], error: Optional[BaseException]) -> str:
        gone = [h for h in loss.lost if not any(h is r for r in retried)]
        what = []
        if retried:
            what.append(f"step(s) {steps_text(retried)} did not commit and are retried "
                        f"on a new daemon (pid {new.daemon_pid}) from the bytes still "
                        "staged")
        if gone:
            why = f"the retry failed: {error}" if error is not None else \
                "their staged bytes were no longer whole, or a later snapshot is committed"
            what.append(f"step(s) {steps_text(gone)} did not commit ({why})")
        if loss.unknown:
            what.append(f"the outcome of step(s) {steps_text(loss.unknown)} is unknown "
                        f"(the old daemon still runs): {self.store.path}/LATEST will tell")
        return (f"the snapd daemon serving {self.store.root} was lost ({old.lost}); "
                f"{'; '.join(what) or 'no snapshot was in flight'}")


def daemon_survives(conn: Optional[DaemonConnection], grace: float = 0.5) -> bool:
    """Whether the lost daemon still runs. A killed one may close its socket an
    instant before it turns into a zombie: look again for ``grace`` seconds."""
    if conn is None:
        return False
    deadline = time.monotonic() + grace
    while conn.daemon_alive():
        if time.monotonic() > deadline:
            return True
        time.sleep(0.05)
    return False
