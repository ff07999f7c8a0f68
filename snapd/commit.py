"""The commit service: where a snapshot becomes committed, and where it stops being.

Every producer of a snapshot (the writer, snapd/writer.py; the global commit of a
multi-rank one, snapd/globalcommit.py; a pull, snapd/remote/pull.py) fills a private
directory by its own steps 1-2, then calls :func:`publish` for the last two:

3. The directory renamed to the snapshot's name (the commit), the parent fsynced.
4. LATEST moved by its one rule, :func:`move_latest`: only forward in (lineage,
   step) order (docs/format.md, "Pointers").

Every un-commit is :func:`uncommit` (retention's deletes, a damaged snapshot set
aside): the files others read from it get their second name (snapd/keepshared.py),
then one rename takes it out of the committed namespace.

:meth:`CommitService.commit` is the one path from a snapshot plan to a committed
snapshot, for the daemon's writer threads and the in-process writer (``Client(...,
daemon=False)``). The order, written once:

1. Free space: refuse a snapshot the disk cannot hold before writing a byte; when
   short, retention runs first, once (snapd/diskguard.py).
2. The writer (:func:`snapd.writer.write_snapshot`), which ends in :func:`publish`.
3. On a failure, ENOSPC (or a quota) becomes InsufficientSpace, naming the root and
   what to free (:func:`enospc_of`, which a pull's failure goes through too).
4. On a failure, the tmp dirs this write made are removed (a crash leaves them for
   the next daemon start or ``snapd gc --collect-tmp``).
5. After the commit, retention with the run's rules. Its failure never fails the
   committed snapshot: it is logged and everything is kept, which is safe. A part of
   a multi-rank snapshot that did not complete it is not a commit yet: retention
   runs in the writer whose part completes the set.

Retention's deletes are un-committed in step 5; the slow recursive delete is left to
:meth:`Commit.purge`, so that the daemon can tell the client first. The writer and
retention build on this module, so the service is handed them (``writer``,
``retain``) rather than importing them.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Iterable, List, Optional

from snapd import diskguard, fsio, keepshared
from snapd.errors import InsufficientSpace
from snapd.options import Options
from snapd.plan import SnapshotPlan
from snapd.store import TMP_PREFIX, RunStore, SnapshotId

log = logging.getLogger(__name__)

Progress = Optional[Callable[[int], None]]


@dataclass
class CommitResult:
    sid: SnapshotId
    path: str            # the committed snapshot's directory (for a part: once committed)
    bytes_written: int
    seconds: float
    # False for a part of a multi-rank snapshot whose other parts are still missing:
    # durable, but not committed (snapd/globalcommit.py).
    complete: bool = True
    # The SHA-256 of the committed manifest (hex), which the state log's committed
    # record keeps so that restore can tell a manifest rewritten since; None when the
    # writer took no SHA-256 (option ``sha256`` off), and for a multi-rank snapshot.
    manifest_sha256: Optional[str] = None


Writer = Callable[..., CommitResult]
Retain = Callable[..., Any]   # retention.apply_retention's shape: a RetentionResult


# --- publish and uncommit: the commit namespace, both ways ---------------------------

def publish(store: RunStore, tmp: str, sid: SnapshotId, *,
            superseded: Collection[str] = ()) -> None:
    """Commit the fully written, fsynced directory ``tmp`` as snapshot ``sid``: steps
    3-4 of the commit order. ``superseded``: names the committer's restore refused
    as damaged (see :func:`move_latest`). Raises when the rename fails (the name is
    taken): nothing is committed then, and ``tmp`` is left to the caller."""
    # 3. The rename that commits the snapshot, then the parent fsynced so that the
    #    rename survives a power loss.
    fsio.publish_directory(tmp, store.snapshot_path(sid))
    # 4. Only now LATEST (atomically); it is a hint, verified on use.
    move_latest(store, sid, superseded)


def move_latest(store: RunStore, sid: SnapshotId,
                superseded: Collection[str] = ()) -> None:
    """The one rule for LATEST, after ``sid`` committed (or was found committed): it
    moves to ``sid`` unless it names a committed snapshot at or after ``sid`` in
    (lineage, step) order. A snapshot named in ``superseded`` (refused as damaged by
    the committer's restore) counts as not committed. A warm start forks a lineage
    numbered above every committed one, so a fork always moves LATEST."""
    now = store.read_pointer("LATEST")
    if now is not None and now >= sid and now.name not in superseded \
            and now in store.committed():
        return
    with diskguard.space_for(store.root, os.path.join(store.path, "LATEST"),
                             f"moving LATEST to {sid.name}"):
        store.write_pointer("LATEST", sid)


def uncommit(store: RunStore, sid: SnapshotId, prefix: str,
             marks: Optional[keepshared.Marks] = None) -> str:
    """Take snapshot ``sid`` out of the committed namespace with one rename to
    ``<prefix><name>-<nonce>``; returns that path. ``prefix``: retention's
    ``.tmp-deleting-`` (a tmp name, to :func:`purge`) or ``.damaged-`` (set aside,
    kept for inspection). ``marks``: the run's references when the caller has read
    them (snapd/keepshared.py)."""
    keepshared.keep_referenced(store, sid, marks)   # 1. shared files get a second name
    away = os.path.join(store.snapshots_path,
                        f"{prefix}{sid.name}-{secrets.token_hex(4)}")
    os.rename(store.snapshot_path(sid), away)       # 2. no longer a committed name
    fsio.fsync_dir(store.snapshots_path)            # 3. the un-commit is durable first
    keepshared.passed("trashed")                    # the crash hook's point (tests)
    return away


def purge(paths: Iterable[str]) -> None:
    """Remove un-committed directories (slow part of a delete; safe to interrupt)."""
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


def enospc_of(error: BaseException) -> Optional[OSError]:
    """The ENOSPC (or quota) error behind a failed commit, ``error`` itself or its
    cause (a download that filled the disk comes back from snapd/remote/transfer.py
    as RemoteUnavailable caused by it); None for any other error, and for an
    InsufficientSpace, which already names what it could not write."""
    if isinstance(error, InsufficientSpace):
        return None
    for e in (error, error.__cause__):
        if diskguard.is_enospc(e):
            return e
    return None


# --- the commit service ---------------------------------------------------------------

@dataclass
class Commit:
    """A committed snapshot, and what retention did after it."""

    result: CommitResult
    deleted: List[str] = field(default_factory=list)   # un-committed by retention
    trash: List[str] = field(default_factory=list)     # renamed, still to purge
    retention_error: Optional[BaseException] = None    # retention failed: all kept

    def purge(self) -> None:
        """The slow part of retention's deletes (safe to interrupt, or to skip)."""
        purge(self.trash)
        self.trash = []


class CommitService:
    """Commits snapshots under one root: check, write, map errors, clean up, retain.

    ``writer`` and ``retain`` are :func:`snapd.writer.write_snapshot` and
    :func:`snapd.retention.apply_retention` (tests pass faulty ones to reach the
    failure paths without touching module state). ``min_free_bytes`` is kept free on
    the root's disk beside the snapshot.
    """

    def __init__(self, root: str, min_free_bytes: int, *, writer: Writer,
                 retain: Retain) -> None:
        self.root = os.path.abspath(root)
        self.min_free_bytes = min_free_bytes
        self.writer = writer
        self.retain = retain

    def commit(self, store: RunStore, plan: SnapshotPlan, opts: Options,
               progress: Progress = None) -> Commit:
        """Commit ``plan`` in ``store`` (see the module's steps); raises on failure,
        with nothing committed and no tmp dir of this write left."""
        store.ensure()
        # 1. Free space first; retention once when short (its result is not needed).
        diskguard.ensure_space(self.root, plan.nbytes, self.min_free_bytes,
                               reclaim=lambda: self.retain(store, opts))
        before = set(store.tmp_dirs())
        try:
            # 2. The write and its commit.
            result = self.writer(store, plan, opts, progress=progress)
        except BaseException as e:
            # 3. The disk filled up part way: the same error and advice as in 1.
            full = enospc_of(e)
            # 4. Only this write's tmp dirs: another process may be writing beside us.
            self._collect_failed(store, plan, before)
            if full is not None:
                raise diskguard.from_enospc(full, self.root, plan.nbytes) from e
            raise
        if not result.complete:   # a part: the snapshot waits for the other ranks
            return Commit(result)
        # 5. Retention, after the commit and never failing it.
        return self._retain(store, opts, Commit(result))

    def _collect_failed(self, store: RunStore, plan: SnapshotPlan, before: set) -> None:
        prefix = os.path.join(store.snapshots_path, f"{TMP_PREFIX}{plan.sid.name}-")
        try:
            mine = [p for p in store.tmp_dirs() if p not in before and p.startswith(prefix)]
            store.collect_tmp(keep=tuple(p for p in store.tmp_dirs() if p not in mine))
        except OSError as e:   # the write's own error is the one to report
            log.warning("run %r: could not remove the failed write's tmp dir: %s",
                        store.run, e)

    def _retain(self, store: RunStore, opts: Options, done: Commit) -> Commit:
        try:
            kept = self.retain(store, opts, purge_now=False, committed=done.result.sid)
        except Exception as e:
            done.retention_error = e
            log.warning("retention of run %r failed (snapshots kept): %r", store.run, e)
            return done
        done.deleted, done.trash = kept.deleted, kept.trash
        if kept.deleted:
            log.info("run %r: retention deleted %s", store.run, ", ".join(kept.deleted))
        return done
