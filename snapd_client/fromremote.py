"""Restore on a new node: the remote tier's newer snapshots brought down first.

With ``Options.remote`` set, restore() (one rank) asks the remote root for its
commits before it chooses a snapshot. The newest remote commit newer than the newest
local committed snapshot is pulled (snapd/remote/pull.py: every checksum verified,
committed locally by the same rename, LATEST moved to it); restore then takes it
through the usual order, LATEST first. A damaged remote snapshot is warned of and
the next older remote commit that is still newer than the local ones is tried. A
remote that cannot be reached is warned of, and restore goes on from the local disk:
a lost network never stops a job that has what it needs on the node.

The replicated state log is brought down too when the local log of this rank has no
segment, before the log is read: recovery planning and the replay check then see
what the lost node logged.
"""

from __future__ import annotations

import logging
import warnings
from typing import Optional

from snapd.errors import CorruptSnapshot, InsufficientSpace, RemoteUnavailable
from snapd.store import RunStore, SnapshotId


logger = logging.getLogger(__name__)


class RemoteWarning(UserWarning):
    """The remote tier could not be used for this restore (unreachable, or its
    snapshot damaged): restore went on with what else there is."""


def pull_newer(store: RunStore, url: str, *, min_free_bytes: int,
               threads: int = 4) -> Optional[SnapshotId]:
    """Pull the newest remote commit newer than every local committed snapshot, and
    the log when the local one is empty; returns the snapshot pulled, or None."""
    from snapd.remote.layout import RemoteRoot
    from snapd.remote.pull import pull, pull_log, reaching, refuse_credentials
    refuse_credentials(url, where="Client(remote=...)")
    try:
        remote = RemoteRoot(url)
        with reaching(remote, f"listing the commits of {store.run}"):
            commits = remote.commits(store.run)
        if pull_log(remote, store):
            logger.info(f"run {store.run}: state log brought down from {remote.url}")
    except RemoteUnavailable as e:
        _warn(f"the remote tier is not reachable, restoring from the local disk only: {e}")
        return None
    local = store.committed()
    newer = [sid for sid in reversed(commits) if not local or sid > local[-1]]
    for sid in newer:
        try:
            pull(remote, store, sid.name, threads=threads, min_free_bytes=min_free_bytes)
            logger.info(f"run {store.run}: pulled {sid.name} from {remote.url}, verified")
            return sid
        except CorruptSnapshot as e:
            _warn(f"remote snapshot {store.run}/{sid.name} refused: {e}; trying an older "
                  "one (the remote snapshot is left as it is)")
        except (RemoteUnavailable, InsufficientSpace) as e:
            _warn(f"remote snapshot {store.run}/{sid.name} could not be pulled, "
                  f"restoring from the local disk only: {e}")
            return None
    return None


def _warn(message: str) -> None:
    warnings.warn(message, RemoteWarning, stacklevel=4)
