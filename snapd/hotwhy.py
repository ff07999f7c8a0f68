"""Why the daemon holds no hot copy of a run and rank, in the words a restart quotes.

A restart that reads the files where it could have read memory says why, in its
resume line and in the daemon's log (docs/operations.md, "(hot) or (disk)"). The
reasons arise in three places: at a commit whose slot is not held
(:func:`not_held_because`), at a release (the hot cache keeps the reason it was given:
snapd/arena_map.py, ``HotCache.why_not``), and for a run this daemon never committed
(:func:`never_held`: its snapshots were written before this daemon started, or by a
client with ``daemon=False``).
"""

from __future__ import annotations

import os
import time
from typing import Any, Dict, Optional

from snapd.arena_map import HotCache
from snapd.store import RunStore, SnapshotId


def not_held_because(sub: Any, cache: HotCache) -> Optional[str]:
    """Why the committed slot of submission ``sub`` is not held for a fast restore;
    None when it is: the client asked for it (a hot arena, a slot to spare) and the
    bound allows it."""
    if not sub.options.hot_restore:
        return "its client set hot_restore=False"
    # A multi-rank job restores from the files: every rank must read one snapshot.
    # So does a snapshot that refers to earlier ones' bytes: its slot lacks them.
    if sub.desc.get("world_size", 1) != 1:
        return "a multi-rank job restores from the files"
    if not sub.arena.hot:
        return "the run stages into one slot (no slot to spare for a hot copy)" \
            if sub.arena.slots < 2 else \
            "its arena could not be named for hot restore (see this log at its attach)"
    if sub.conn.finished:
        return "its client closed cleanly"
    if refers_to_earlier(sub.desc):
        return "it refers to bytes of earlier snapshots (share_unchanged), which its " \
               "slot lacks"
    if not cache.fits(sub.arena.size):
        return f"its arena of {sub.arena.size} bytes exceeds hot_max_bytes " \
               f"({cache.max_bytes} bytes)"
    return None


def never_held(store: RunStore, latest: Optional[SnapshotId], started: float) -> str:
    """Why a run this daemon (started at ``started``) never committed has no copy."""
    since = time.strftime("%H:%M:%S", time.localtime(started))
    text = (f"the daemon serving the root (pid {os.getpid()}, since {since}) has "
            "committed no snapshot of this run and rank")
    if latest is None:
        return text
    return f"{text}; {latest.name} was written " + (
        "before it started" if _written_before(store, latest, started) else
        "by another writer (a client with daemon=False?)")


def _written_before(store: RunStore, sid: SnapshotId, when: float) -> bool:
    """Whether snapshot ``sid`` was committed before ``when`` (its directory's
    modification time: the manifest is written last); unknown counts as before."""
    try:
        return os.stat(store.snapshot_path(sid)).st_mtime < when
    except OSError:
        return True


def refers_to_earlier(desc: Dict[str, Any]) -> bool:
    """Whether a descriptor has tensors an earlier snapshot holds (``reuse``)."""
    return any("reuse" in t for o in desc["objects"] for t in o["tensors"])
