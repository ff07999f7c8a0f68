"""Retention: which committed snapshots a run keeps, and deleting the rest safely.

Planning is a pure function over what the manifests say (:func:`plan_retention`), so
the rules can be tested without a disk; :func:`apply_retention` reads the manifests,
plans, and deletes. The rules:

- a snapshot is kept when it is among the last ``keep_last``, or its step is a
  multiple of ``keep_every``, or it is among the ``keep_best`` best by metric
  (``best_mode`` "min" or "max"); with no rule set at all, everything is kept;
- order is (lineage, step) as the *manifest* says, never the name or the mtime;
- the newest verified snapshot is always kept: the last good one is never deleted
  before its successor is committed, and a run never loses its only good snapshot;
- a snapshot whose manifest cannot be read is never deleted automatically (it is
  reported, as a reader reports it) and counts for nothing.

A deletion first renames the directory to ``.tmp-deleting-<name>-<nonce>``, so that a
crash in the middle of the (slow) recursive delete leaves a tmp dir, which no reader
lists and the next collection removes, never a half snapshot under a committed name.
"""

from __future__ import annotations

import math
import os
import secrets
import shutil
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from snapd import fsio
from snapd.errors import CorruptSnapshot
from snapd.options import Options
from snapd.reader import SnapshotReader
from snapd.store import (TMP_PREFIX, RunStore, SnapshotId, list_runs, remove_pointer)

DELETING_PREFIX = f"{TMP_PREFIX}deleting-"


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
                   best_mode: str = "min") -> RetentionPlan:
    """Split verified snapshots into kept and deleted (pure; see the module rules)."""
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
    return RetentionPlan(keep=[i for i in ordered if i.sid in kept],
                         delete=[i for i in ordered if i.sid not in kept])


def scan(store: RunStore) -> Tuple[List[SnapshotInfo], List[str]]:
    """Every committed snapshot's info from its manifest (no tensor file is read).

    Returns (verified infos, names whose manifest or file sizes are refused).
    """
    infos, refused = [], []
    for sid in store.committed():
        try:
            manifest = SnapshotReader(store.snapshot_path(sid)).manifest
            lineage = manifest.get("lineage") or {}
            metric = manifest.get("metric")
            infos.append(SnapshotInfo(sid, int(lineage.get("id", 0)),
                                      int(manifest["step"]),
                                      None if metric is None else float(metric)))
        except (CorruptSnapshot, OSError, KeyError, TypeError, ValueError):
            refused.append(sid.name)
    return infos, refused


def trash_snapshot(store: RunStore, sid: SnapshotId) -> str:
    """Un-commit a snapshot with one rename; returns the tmp dir to purge."""
    trash = os.path.join(store.snapshots_path,
                         f"{DELETING_PREFIX}{sid.name}-{secrets.token_hex(4)}")
    os.rename(store.snapshot_path(sid), trash)   # 1. no longer a committed name
    fsio.fsync_dir(store.snapshots_path)         # 2. the un-commit is durable first
    return trash


def purge(paths: Iterable[str]) -> None:
    """Remove trashed directories (slow part of a delete; safe to interrupt)."""
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


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


def apply_retention(store: RunStore, opts: Options, *, purge_now: bool = True,
                    dry_run: bool = False) -> RetentionResult:
    """Delete what the rules do not keep and move BEST; returns what it did.

    ``purge_now=False`` leaves the renamed directories for :func:`purge`, so that a
    caller can report the commit before the slow recursive delete.
    """
    infos, refused = scan(store)
    plan = plan_retention(infos, keep_last=opts.keep_last, keep_every=opts.keep_every,
                          keep_best=opts.keep_best, best_mode=opts.best_mode)
    result = RetentionResult(deleted=[i.sid.name for i in plan.delete], refused=refused)
    if dry_run:
        return result
    result.trash = [trash_snapshot(store, i.sid) for i in plan.delete]
    update_best(store, plan.keep, opts.best_mode)
    if purge_now:
        purge(result.trash)
        result.trash = []
    return result


def gc(root: str, opts: Options, runs: Optional[Sequence[str]] = None, *,
       dry_run: bool = False, collect_tmp: bool = False) -> Dict[str, RetentionResult]:
    """Retention over every run of a root (``snapd gc``); returns results per run.

    ``collect_tmp`` also removes ``.tmp-*`` directories: only safe while no daemon
    writes under the root (hold ``<root>/.snapd.lock``), since one of them may be a
    snapshot being written.
    """
    results = {}
    for run in runs if runs is not None else list_runs(root):
        store = RunStore(root, run)
        results[run] = apply_retention(store, opts, dry_run=dry_run)
        if collect_tmp and not dry_run:
            store.collect_tmp()
    return results
