"""Restore with overlap from the remote tier: the optimizer's files arrive after restore.

On a node with nothing newer locally, ``restore(overlap=True)`` of one rank with
``remote`` set pulls the newest remote commit in two halves
(snapd/remote/pendingpull.py): the record, the manifest and every file but the
deferred optimizers' (the objects :func:`later_objects` names, as
``restore.step_only_names`` does for a local snapshot) are downloaded and verified
before restore reads them (``restore.Pending``, tried first); the deferred files are
downloaded by the background thread of snapd_client/overlaprestore.py, whose ``read``
is a :class:`RemoteStepState`:

1. the rest of the pull: the optimizers' files downloaded into the same tmp dir,
   under its own ``remote_timeout`` (a silent store is RemoteUnavailable, not a
   thread that never ends);
2. the optimizers' state read from them into new memory, every checksum verified as
   it is read (``read_step_state``);
3. only then the snapshot committed locally, by the one publish() rule, LATEST moved.

The first ``optimizer.step()`` waits for it and applies it, as for a local snapshot.
A failure raises there, before any update, and every step after (sticky). Damage in
the optimizers' files (CorruptSnapshot naming the remote file) keeps the tmp dir as
``.damaged-<name>-remote-<nonce>`` (:func:`set_aside_pulled`): the next start's pull
passes that remote commit over and resumes from the next older one, remote or
local. Any other failure (the store unreachable, the disk full) removes the tmp dir:
nothing is committed, and the next start pulls again, as after a kill.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, Iterable, Optional, Tuple

from snapd.errors import CorruptSnapshot, RemoteUnavailable, SnapdError
from snapd.reader import SnapshotReader
from snapd.store import SnapshotId
from snapd_client import overlaprestore
from snapd_client.fromremote import RemoteWarning
from snapd_client.restore import Loaded, Pending, step_only_names


def _finish(pending: Any, read: Callable[[str], Any], **how: Any) -> Any:
    return pending.finish(read, **how)


# The background half of the pull (PendingPull.finish); tests substitute a gated one.
FINISH = _finish


def later_objects(defer: Iterable[str], omit: Iterable[str]
                  ) -> Callable[[SnapshotReader], Tuple[str, ...]]:
    """Which objects' files a pull may leave for later, from the pulled manifest: the
    ones restore will defer (the same rule, the same arguments)."""
    names = set(defer) - set(omit)
    return lambda reader: step_only_names(reader, names)


def split(pulled: Any) -> Tuple[Optional[SnapshotId], Any]:
    """What pull_newer returned, as (the snapshot pulled, the PendingPull or None)."""
    if pulled is None or isinstance(pulled, SnapshotId):
        return pulled, None
    return pulled.sid, pulled


def candidate(pending: Any) -> Optional[Pending]:
    """The pending pull as restore's first candidate; refused as damaged there, it
    is set aside as damage found later would be."""
    if pending is None:
        return None
    return Pending(pending.sid, pending.tmp, tuple(pending.later),
                   refused=lambda: set_aside_pulled(pending))


def settle_unused(pending: Any, loaded: Optional[Loaded]) -> None:
    """A pending pull restore did not resume from: gone already when restore refused
    it as damaged (:func:`candidate`), else (``verify_steps`` chose an older snapshot) finished now, verified
    whole, so that it is committed as a pull without overlap would have left it."""
    if loaded is None or pending.sid.name in loaded.refused:
        pending.abandon()
        return
    finish_whole(pending)


def finish_whole(pending: Any) -> None:
    """A pending pull restore does not resume from, finished now and verified whole,
    then committed; damaged, set aside; unreachable, removed (warned of each time)."""
    try:
        pending.fetch()
        pending.verify_later()
        pending.commit()
    except CorruptSnapshot as e:   # restore goes on from the older one it chose
        warnings.warn(f"remote snapshot {pending.where} refused: {e}; "
                      f"{set_aside_pulled(pending)}", RemoteWarning, stacklevel=4)
    except (OSError, SnapdError) as e:
        pending.abandon()
        warnings.warn(f"remote snapshot {pending.where} could not be pulled whole ({e}); "
                      "it is not committed locally", RemoteWarning, stacklevel=4)


class RemoteStepState:
    """The background read of a StepStateArrival whose optimizers' files are still
    remote: the pull finished (steps 1-3 of the module docstring), the states returned.
    ``loaded.path`` names the remote snapshot until the commit, the local one after."""

    def __init__(self, pending: Any, loaded: Loaded, tracked: Dict[str, Any], *,
                 threads: int, timeout: Optional[float]) -> None:
        self.pending, self.loaded, self.tracked = pending, loaded, tracked
        self.threads, self.timeout = threads, timeout
        loaded.path = pending.where

    def __call__(self) -> Dict[str, Any]:
        from snapd.remote.deadline import Deadline
        from snapd.remote.layout import redact
        from snapd.remote.pull import arrived
        pending, loaded = self.pending, self.loaded
        deadline = Deadline(self.timeout, redact(pending.remote.url))

        def read(tmp: str) -> Dict[str, Any]:
            return overlaprestore.READ(loaded.reader, loaded.deferred, self.tracked, None)

        outcome = deadline.run(
            lambda: FINISH(pending, read, threads=self.threads, deadline=deadline),
            name=f"snapd-remote-pull-{pending.store.run}",
            progress=lambda: arrived(pending.store))
        if outcome.timed_out:   # the pull left behind commits nothing (deadline.py)
            raise RemoteUnavailable(
                f"{pending.where}: the files of {', '.join(loaded.deferred)} did not "
                f"arrive: the remote tier was silent for remote_timeout={self.timeout:g} "
                "s, and nothing was committed locally. Restart (the next start pulls "
                "again), or raise remote_timeout if the store is slow rather than silent",
                path=pending.where, field="remote_timeout")
        try:
            states = outcome.result()
        except RemoteUnavailable as e:
            raise RemoteUnavailable(
                f"{pending.where}: the files of {', '.join(loaded.deferred)} could not be "
                f"downloaded ({e}); nothing was committed locally, and the next start "
                "pulls the snapshot again", path=pending.where, field="remote") from e
        loaded.path = pending.final
        return states


def set_aside_pulled(pending: Any) -> str:
    """The pulled snapshot found damaged (its optimizer files, or by restore's own
    checks), kept aside, never committed; the sentence that says what was done."""
    try:
        away = pending.set_aside()
    except OSError as e:   # the error to raise is the damage, not this
        return (f"keeping {pending.tmp} aside failed ({e}): the next start pulls "
                f"{pending.sid.name} again and finds it damaged there")
    return (f"{pending.sid.name} is not committed locally: its download is set aside as "
            f"{away} (kept for inspection), so the next start passes that remote "
            "snapshot over and resumes from an older one")
