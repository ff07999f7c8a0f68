"""The commit service: the one path from a snapshot plan to a committed snapshot.

Every writer of snapshots goes through :meth:`CommitService.commit`: the daemon's
writer threads (snapd/daemon.py), the in-process writer (``Client(...,
daemon=False)``). ``snapd gc`` applies the same retention (:func:`retention.
apply_retention`, the one entry point of the rules). The order, written once:

1. Free space: refuse a snapshot the disk cannot hold before writing a byte; when
   short, retention runs first, once (snapd/diskguard.py).
2. :func:`snapd.writer.write_snapshot`: tensor files, manifest, the rename that
   commits, LATEST (the commit order itself lives there).
3. On a failure, the error mapped: ENOSPC (or a quota) becomes InsufficientSpace,
   naming the root and what to free.
4. On a failure, the tmp dirs this write made are removed (a crash leaves them for
   the next daemon start or ``snapd gc --collect-tmp``).
5. After the commit, retention with the run's rules. Its failure never fails the
   committed snapshot: it is logged and everything is kept, which is safe. A part of
   a multi-rank snapshot that did not complete it (snapd/globalcommit.py) is not a
   commit yet: retention runs in the writer whose part completes the set.

The deleted snapshots are renamed out of the committed namespace in step 5; the slow
recursive delete is left to :meth:`Commit.purge`, so that the daemon can tell the
client first.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Callable, List, Optional

from snapd import diskguard, retention
from snapd.options import Options
from snapd.plan import SnapshotPlan
from snapd.retention import RetentionResult
from snapd.store import TMP_PREFIX, RunStore
from snapd.writer import CommitResult, Progress, write_snapshot

log = logging.getLogger(__name__)

Writer = Callable[..., CommitResult]
Retain = Callable[..., RetentionResult]


@dataclass
class Commit:
    """A committed snapshot, and what retention did after it."""

    result: CommitResult
    deleted: List[str] = field(default_factory=list)   # un-committed by retention
    trash: List[str] = field(default_factory=list)     # renamed, still to purge
    retention_error: Optional[BaseException] = None    # retention failed: all kept

    def purge(self) -> None:
        """The slow part of retention's deletes (safe to interrupt, or to skip)."""
        retention.purge(self.trash)
        self.trash = []


class CommitService:
    """Commits snapshots under one root: check, write, map errors, clean up, retain.

    ``writer`` and ``retain`` are :func:`write_snapshot` and
    :func:`retention.apply_retention`; tests pass faulty ones to reach the failure
    paths without touching module state. ``min_free_bytes`` is kept free on the
    root's disk beside the snapshot.
    """

    def __init__(self, root: str, min_free_bytes: int, *, writer: Writer = write_snapshot,
                 retain: Retain = retention.apply_retention) -> None:
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
            full = isinstance(e, OSError) and diskguard.is_enospc(e)
            # 4. Only this write's tmp dirs: another process may be writing beside us.
            self._collect_failed(store, plan, before)
            if full:
                raise diskguard.from_enospc(e, self.root, plan.nbytes) from e
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
            kept = self.retain(store, opts, purge_now=False)
        except Exception as e:
            done.retention_error = e
            log.warning("retention of run %r failed (snapshots kept): %r", store.run, e)
            return done
        done.deleted, done.trash = kept.deleted, kept.trash
        if kept.deleted:
            log.info("run %r: retention deleted %s", store.run, ", ".join(kept.deleted))
        return done
