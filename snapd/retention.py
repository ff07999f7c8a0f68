"""Retention: which committed snapshots a run keeps, and deleting the rest safely.

Planning is a pure function over what the manifests say (:func:`plan_retention`), so
the rules can be tested without a disk; :func:`apply_retention` reads the manifests,
plans, and deletes. It is the one entry point: the daemon after each commit, the
in-process writer (both through snapd/commit.py) and ``snapd gc`` (through
:func:`gc`) apply the same rules:

- a snapshot is kept when it is among the last ``keep_last``, or its step is a
  multiple of ``keep_every``, or it is among the ``keep_best`` best by metric
  (``best_mode`` "min" or "max"); with no rule set at all, everything is kept;
- order is (lineage, step) as the *manifest* says, never the name or the mtime;
- the newest verified snapshot is always kept: the last good one is never deleted
  before its successor is committed, and a run never loses its only good snapshot;
- the snapshot LATEST names is never deleted, even when a crash left it behind a
  newer commit: a restore looks there first; nor the one just committed, when
  retention runs after a commit (LATEST stays on a newer one when a resume below it
  commits: docs/format.md, "Pointers");
- a snapshot whose manifest cannot be read is never deleted automatically (it is
  reported, as a reader reports it) and counts for nothing.

A deletion first renames the directory to ``.tmp-deleting-<name>-<nonce>`` (the one
un-commit, snapd/commit.py's :func:`uncommit`), so that a crash in the middle of the
(slow) recursive delete leaves a tmp dir, which no reader lists and the next
collection removes, never a half snapshot under a committed name.

Snapshots of format v4 may read tensors from an earlier snapshot's file: before a
snapshot is renamed away, the files of it that other committed snapshots read are
kept in ``<run>/shared/`` (snapd/keepshared.py), and after the deletes the entries
there that no committed snapshot reads are swept. Doomed snapshots go newest first,
so a file only doomed snapshots read never needs keeping.

Collecting tmp dirs by hand (``snapd gc --collect-tmp``, :func:`collect_tmp`) happens
under the root's lock (snapd/rootlock.py), so never beside a serving daemon, and
skips every run whose writer lock (snapd/runlock.py) a live client holds, since an
in-process writer (``daemon=False``) writes tmp dirs without the root's lock.
``snapd gc``'s deletes (:func:`gc`) take the same locks, and hold the run's writer
lock meanwhile: a snapshot written beside them could refer to a file of a snapshot
they delete.
"""

from __future__ import annotations

import fcntl
import glob
import math
import os
import secrets
import time
from dataclasses import dataclass, field
from typing import Collection, Dict, Iterable, List, Optional, Sequence, Tuple

from snapd import keepshared, pins, sharing
# purge: the slow part of a delete, the commit service's (snapd/remote/parts.py
# imports it from here too).
from snapd.commit import purge, uncommit
from snapd.errors import CorruptSnapshot, RunInUse
from snapd.names import WRITER_LOCK_GLOB
from snapd.options import Options
from snapd.reader import read_summary
from snapd.rootlock import RootLock
from snapd.runlock import RunLock
from snapd.store import (TMP_PREFIX, RunStore, SnapshotId, list_runs, remove_pointer)

DELETING_PREFIX = f"{TMP_PREFIX}deleting-"
TMP_MIN_AGE_S = 3600.0  # a younger .tmp- directory may be a snapshot still being written


@dataclass(frozen=True)
class SnapshotInfo:
    """What retention needs from one committed snapshot's manifest."""

    sid: SnapshotId            # from the directory name: how to find it
    lineage: int               # from the manifest: how to order it
    step: int
    metric: Optional[float] = None

    @property
    def key(self) -> Tuple[int, int]:
        return (self.lineage, self.step)


@dataclass
class RetentionPlan:
    keep: List[SnapshotInfo] = field(default_factory=list)
    delete: List[SnapshotInfo] = field(default_factory=list)
    protected: List[SnapshotInfo] = field(default_factory=list)  # kept: LATEST names it


def _has_metric(info: SnapshotInfo) -> bool:
    return info.metric is not None and not math.isnan(info.metric)


def best_of(infos: Iterable[SnapshotInfo], mode: str = "min",
            count: int = 1) -> List[SnapshotInfo]:
    """The ``count`` best snapshots by metric; ties go to the newer snapshot."""
    scored = [i for i in infos if _has_metric(i)]
    sign = 1.0 if mode == "min" else -1.0
    scored.sort(key=lambda i: (sign * i.metric, tuple(-k for k in i.key)))
    return scored[:max(count, 0)]


def plan_retention(infos: Sequence[SnapshotInfo], *, keep_last: Optional[int] = None,
                   keep_every: Optional[int] = None, keep_best: int = 0,
                   best_mode: str = "min",
                   protect: Collection[SnapshotId] = ()) -> RetentionPlan:
    """Split verified snapshots into kept and deleted (pure; see the module rules).

    ``protect``: names kept whatever the rules say (LATEST's); those the rules alone
    would delete are listed in ``protected`` too.
    """
    ordered = sorted(infos, key=lambda i: i.key)
    if not ordered or (keep_last is None and not keep_every and not keep_best):
        return RetentionPlan(keep=ordered)
    kept = {ordered[-1].sid}                       # the newest verified, always
    if keep_last is not None and keep_last > 0:
        kept.update(i.sid for i in ordered[-keep_last:])
    if keep_every:
        kept.update(i.sid for i in ordered if i.step % keep_every == 0)
    if keep_best:
        kept.update(i.sid for i in best_of(ordered, best_mode, keep_best))
    protected = [i for i in ordered if i.sid in protect and i.sid not in kept]
    kept.update(i.sid for i in protected)
    return RetentionPlan(keep=[i for i in ordered if i.sid in kept],
                         delete=[i for i in ordered if i.sid not in kept],
                         protected=protected)


def scan(store: RunStore) -> Tuple[List[SnapshotInfo], List[str]]:
    """Every committed snapshot's info from its manifest (no tensor file is read).

    Returns (verified infos, names whose manifest or file sizes are refused).
    """
    infos, refused = [], []
    for sid in store.committed():
        try:
            manifest = read_summary(store.snapshot_path(sid))
            lineage = manifest.get("lineage") or {}
            metric = manifest.get("metric")
            infos.append(SnapshotInfo(sid, int(lineage.get("id", 0)),
                                      int(manifest["step"]),
                                      None if metric is None else float(metric)))
        except (CorruptSnapshot, OSError, KeyError, TypeError, ValueError):
            refused.append(sid.name)
    return infos, refused


def stale_parts(store: RunStore, done: Optional[SnapshotId]) -> List[Tuple[SnapshotId, str]]:
    """``.parts-<name>`` dirs older than ``done`` (the snapshot just committed, else
    the one LATEST names): they can never complete. A rank writes its snapshots in
    order, so when snapshot S commits globally, every rank has finished its parts
    before S; a set still incomplete then lacks a part that will not come. (Not
    LATEST after a commit: it stays on a newer snapshot when a resume below it
    commits, and the parts between are the resumed ranks' own.)"""
    if done is None:
        return []
    return [(sid, path) for sid, path in store.parts_dirs() if sid < done]


def collect_parts(store: RunStore, done: Optional[SnapshotId]) -> Tuple[List[str], List[str]]:
    """Rename the stale parts dirs out (then purged with the trash); returns their
    names and the trash paths."""
    names, trash = [], []
    for sid, path in stale_parts(store, done):
        away = os.path.join(store.snapshots_path,
                            f"{DELETING_PREFIX}parts-{sid.name}-{secrets.token_hex(4)}")
        try:
            os.rename(path, away)
        except FileNotFoundError:
            continue
        names.append(sid.name)
        trash.append(away)
    return names, trash


def update_best(store: RunStore, infos: Sequence[SnapshotInfo], mode: str) -> None:
    """Point BEST at the best surviving snapshot with a metric (or remove it)."""
    best = best_of(infos, mode, 1)
    current = store.read_pointer("BEST")
    if best and current != best[0].sid:
        store.write_pointer("BEST", best[0].sid)
    elif not best and current is not None:
        remove_pointer(store, "BEST")


@dataclass
class RetentionResult:
    deleted: List[str] = field(default_factory=list)   # snapshot names un-committed
    trash: List[str] = field(default_factory=list)     # tmp dirs still to purge
    refused: List[str] = field(default_factory=list)   # unreadable, left alone
    kept: List[str] = field(default_factory=list)      # what the rules keep
    # kept only because LATEST names it (or, after a commit, it is the one committed)
    protected: List[str] = field(default_factory=list)
    # kept only because it is pinned (snapd/pins.py)
    pinned: List[str] = field(default_factory=list)
    bytes: int = 0                      # freed by the deletes (gc measures it)
    incomplete: List[str] = field(default_factory=list)  # .parts- dirs removed
    # Files of the deleted snapshots that kept ones read: kept in shared/ ("S/file").
    kept_shared: List[str] = field(default_factory=list)
    kept_shared_bytes: int = 0
    # shared/ entries no committed snapshot reads any more, removed (snapd/keepshared.py).
    swept: List[str] = field(default_factory=list)
    swept_bytes: int = 0                # freed: the removed entries that were last names
    sweep_blocked_by: List[str] = field(default_factory=list)  # unreadable: nothing swept
    busy: bool = False                  # gc: a live client writes the run, left alone


def apply_retention(store: RunStore, opts: Options, *, purge_now: bool = True,
                    dry_run: bool = False, sweep: bool = False,
                    committed: Optional[SnapshotId] = None) -> RetentionResult:
    """Delete what the rules do not keep and move BEST; returns what it did.

    The one entry point of retention (see the module rules). ``purge_now=False``
    leaves the renamed directories for :func:`purge`, so that a caller can report
    the commit (or measure them) before the slow recursive delete. The ``shared/``
    entries no committed snapshot reads are swept after the deletes (``sweep``: even
    when nothing was deleted, as ``snapd gc`` does). ``committed``: the snapshot
    whose commit this retention follows (snapd/commit.py), kept like LATEST's.
    """
    infos, refused = scan(store)
    latest = store.read_pointer("LATEST")
    done = committed if committed is not None else latest
    held = set(pins.pinned(store.path))
    plan = plan_retention(infos, keep_last=opts.keep_last, keep_every=opts.keep_every,
                          keep_best=opts.keep_best, best_mode=opts.best_mode,
                          protect=held | {sid for sid in (latest, committed)
                                          if sid is not None})
    result = RetentionResult(deleted=[i.sid.name for i in plan.delete], refused=refused,
                             kept=[i.sid.name for i in plan.keep],
                             protected=[i.sid.name for i in plan.protected
                                        if i.sid not in held],
                             pinned=[i.sid.name for i in plan.protected if i.sid in held])
    marks = keepshared.mark(store) if plan.delete or sweep else {}
    if dry_run:
        result.incomplete = [sid.name for sid, _ in stale_parts(store, done)]
        _plan_shared(store, plan.delete, marks, result, sweep)
        return result
    _delete(store, plan.delete, marks, result)
    result.incomplete, parts_trash = collect_parts(store, done)
    result.trash += parts_trash
    update_best(store, plan.keep, opts.best_mode)
    if plan.delete or sweep:
        _record_sweep(keepshared.sweep(store, marks), result)
    if purge_now:
        purge(result.trash)
        result.trash = []
    return result


def _delete(store: RunStore, doomed: Sequence[SnapshotInfo], marks: keepshared.Marks,
            result: RetentionResult) -> None:
    """Un-commit ``doomed``, newest first: a file one doomed snapshot reads from an
    older doomed one then needs no second name, since its reader is gone first (a
    crash part way leaves the older ones committed, which the rules delete next
    time)."""
    for info in reversed(doomed):
        kept = keepshared.files_to_keep(store, info.sid, marks)
        result.trash.append(uncommit(store, info.sid, DELETING_PREFIX, marks))
        marks.pop(info.sid.name, None)   # no longer committed: it refers to nothing
        result.kept_shared += [f"{info.sid.name}/{f}" for f in kept]
        result.kept_shared_bytes += sum(
            _size(sharing.shared_path(store.path, info.sid.name, f)) for f in kept)


def _plan_shared(store: RunStore, doomed: Sequence[SnapshotInfo], marks: keepshared.Marks,
                 result: RetentionResult, sweep: bool) -> None:
    """What :func:`_delete` and the sweep would keep and remove (a dry run)."""
    for info in reversed(doomed):
        kept = keepshared.files_to_keep(store, info.sid, marks)
        marks.pop(info.sid.name, None)
        result.kept_shared += [f"{info.sid.name}/{f}" for f in kept]
        result.kept_shared_bytes += sum(
            _size(os.path.join(store.snapshot_path(info.sid), f)) for f in kept)
    if doomed or sweep:
        _record_sweep(keepshared.sweep(store, marks, dry_run=True), result)


def _record_sweep(swept: keepshared.Swept, result: RetentionResult) -> None:
    result.swept, result.swept_bytes = swept.files, swept.bytes
    result.sweep_blocked_by = swept.blocked_by


def _size(path: str) -> int:
    try:
        return os.lstat(path).st_size
    except OSError:
        return 0


# --- snapd gc -----------------------------------------------------------------------

@dataclass
class Collected:
    """What :func:`collect_tmp` removed, and the runs it left alone."""

    removed: List[str] = field(default_factory=list)
    busy: List[str] = field(default_factory=list)   # runs a live client writes


def writer_active(store: RunStore) -> bool:
    """A live client holds one of the run's writer locks (snapd/runlock.py).

    A shared flock is refused while anyone holds the exclusive one; it is dropped at
    once, so probing never blocks the writer.
    """
    for path in glob.glob(os.path.join(glob.escape(store.path), WRITER_LOCK_GLOB)):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)   # also drops the shared lock
    return False


def collect_tmp(root: str, runs: Sequence[str], *,
                min_age: float = TMP_MIN_AGE_S) -> Collected:
    """Remove abandoned ``.tmp-`` directories at least ``min_age`` seconds old.

    Holds the root's lock meanwhile (AlreadyServing when a daemon serves the root: a
    tmp dir may be its snapshot in progress) and skips runs a live client writes.
    """
    done = Collected()
    with RootLock(root):
        now = time.time()
        for run in runs:
            store = RunStore(root, run)
            if writer_active(store):
                done.busy.append(run)
                continue
            young = tuple(p for p in store.tmp_dirs()
                          if now - os.lstat(p).st_mtime < min_age)
            old = [p for p in store.tmp_dirs() if p not in young]
            store.collect_tmp(keep=young)
            done.removed += old
    return done


def gc(root: str, opts: Options, runs: Optional[Sequence[str]] = None, *,
       dry_run: bool = False) -> Dict[str, RetentionResult]:
    """Retention over runs of a root (every run by default), then the sweep of
    ``shared/``; results per run. ``bytes`` is what the deletes free: the deleted
    snapshots' files less those kept in ``shared/`` for kept snapshots (measured
    before the purge).

    A gc that deletes holds the root's lock (AlreadyServing while a daemon serves the
    root) and each run's writer lock (a run a live client writes is skipped, ``busy``):
    a writer that referred to a snapshot's file while gc un-committed the snapshot
    would commit a reference to a file no one keeps (snapd/keepshared.py). A dry run
    changes nothing and takes no lock.
    """
    names = list(runs) if runs is not None else list_runs(root)
    if dry_run:
        return {run: _gc_run(RunStore(root, run), opts, True) for run in names}
    results = {}
    with RootLock(root):
        for run in names:
            store = RunStore(root, run)
            lock = _writer_lock(store)
            if lock is None:
                results[run] = RetentionResult(busy=True)
                continue
            try:
                results[run] = _gc_run(store, opts, False)
            finally:
                lock.release()
    return results


def _writer_lock(store: RunStore) -> Optional[RunLock]:
    """Rank 0's writer lock of a run no live client writes (held: no one-rank writer,
    the only kind that shares, starts meanwhile), or None."""
    if writer_active(store):
        return None
    lock = RunLock(store.path, store.run, 0)
    try:
        lock.acquire()
    except RunInUse:
        return None
    return lock


def _gc_run(store: RunStore, opts: Options, dry_run: bool) -> RetentionResult:
    result = apply_retention(store, opts, dry_run=dry_run, purge_now=False, sweep=True)
    paths = result.trash if not dry_run else \
        [os.path.join(store.snapshots_path, n) for n in result.deleted]
    result.bytes = sum(dir_bytes(p) for p in paths) - result.kept_shared_bytes
    purge(result.trash)
    result.trash = []
    return result


def dir_bytes(path: str) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                continue
    return total
