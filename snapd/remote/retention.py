"""Remote retention: which remote commits a run keeps, and sweeping what no record names.

The rules are the local ones (snapd/retention.py's :func:`plan_retention`, pure) with
the remote tier's own numbers: ``remote_keep_last`` (0: keep every remote commit) and
``remote_keep_every``. The newest remote commit is always kept: a job restarted on
another node always finds one. A snapshot pinned in the local run (snapd/pins.py:
the newest before an anomaly) is kept remotely too, until ``snapd unpin``. Order is (lineage, step) from the record names.

A deletion is the record first, then the files (RemoteRoot.delete_snapshot): a crash
in between leaves files without a record, which no reader looks at and :func:`sweep`
removes. The sweep removes ``snapshots/<name>/`` without a record only when ``name``
is older than the newest record: a newer name without one may be an upload still in
progress (here or on another node), and an older one will never be committed, since
an upload always takes the newest local snapshot (newest wins). Its rank part records
(``parts/<name>/``, node-local roots) go first, so that a rank uploading late cannot
complete a snapshot whose files were swept.

Shared files (``shared/<snapshot>/<file>``, format v4) belong to no one snapshot: one
is kept while any kept record lists it, and swept (:func:`sweep_shared`) once none
does, after the records are deleted. An upload puts its shared files before its
record, so while a name newer than the newest record has files (an upload in
progress, here or on another node) no shared file is swept; nor when a kept record
cannot be read (what it lists is unknown).
"""

from __future__ import annotations

import logging
from typing import Collection, List, Optional, Tuple

from snapd.errors import CorruptSnapshot
from snapd.remote.layout import RemoteRoot, record_shared
from snapd.retention import SnapshotInfo, plan_retention
from snapd.store import SnapshotId

log = logging.getLogger(__name__)


def plan(commits: List[SnapshotId], keep_last: int, keep_every: Optional[int],
         pinned: Collection[SnapshotId] = ()) -> List[SnapshotId]:
    """The remote commits to delete (pure): neither among the last ``keep_last`` nor a
    multiple of ``keep_every`` nor ``pinned``, and never the newest."""
    if not keep_last and not keep_every:
        return []
    infos = [SnapshotInfo(sid, sid.lineage, sid.step) for sid in commits]
    # keep_last=0 with keep_every set: only the multiples and the newest are kept.
    chosen = plan_retention(infos, keep_last=keep_last or None, keep_every=keep_every,
                            protect=pinned)
    return [i.sid for i in chosen.delete]


def apply(remote: RemoteRoot, run: str, keep_last: int,
          keep_every: Optional[int], pinned: Collection[SnapshotId] = ()) -> List[str]:
    """Delete the run's remote commits the rules do not keep (``pinned``: the local
    run's pins, kept), then sweep; returns the names deleted."""
    commits = remote.commits(run)
    doomed = plan(commits, keep_last, keep_every, pinned)
    for sid in doomed:
        remote.delete_snapshot(run, sid.name)
    if doomed:
        log.info("run %r: remote retention deleted %s", run,
                 ", ".join(s.name for s in doomed))
    kept = [s for s in commits if s not in doomed]
    sweep(remote, run, kept)
    sweep_shared(remote, run, kept)
    return [s.name for s in doomed]


def sweep(remote: RemoteRoot, run: str, commits: Optional[List[SnapshotId]] = None) -> List[str]:
    """Remove files under ``snapshots/<name>/`` that no record names and never will
    (older than the newest record); returns the names swept."""
    commits = remote.commits(run) if commits is None else commits
    if not commits:
        return []
    newest, committed = max(commits), set(commits)
    swept = []
    for name in remote.snapshot_names(run):
        sid = SnapshotId.parse(name)
        if sid is not None and sid < newest and sid not in committed:
            _remove_parts(remote, run, name)   # first: no late rank can complete it
            remote.remove_files(run, name)
            swept.append(name)
    if swept:
        log.info("run %r: removed uncommitted remote files of %s", run, ", ".join(swept))
    return swept


def _remove_parts(remote: RemoteRoot, run: str, name: str) -> None:
    try:
        remote.fs.rm(remote.parts_path(run, name), recursive=True)
    except FileNotFoundError:
        pass


def sweep_shared(remote: RemoteRoot, run: str,
                 commits: Optional[List[SnapshotId]] = None) -> List[Tuple[str, str]]:
    """Remove the shared files no remote record lists; returns (snapshot, file) of
    each removed. Nothing is removed while an upload may be in progress or a record
    cannot be read (the module's rule)."""
    up = remote.shared_files(run)
    if not up:
        return []
    commits = remote.commits(run) if commits is None else commits
    newest = max(commits) if commits else None
    for name in remote.snapshot_names(run):
        sid = SnapshotId.parse(name)
        if sid is not None and sid not in commits and (newest is None or sid > newest):
            return []   # an upload in progress may need any of them
    listed = set()
    for sid in commits:
        try:
            listed |= {s.key for s in record_shared(remote.read_record(run, sid.name))}
        except CorruptSnapshot as e:
            log.warning("run %r: shared files kept: the record of %s is unreadable (%s)",
                        run, sid.name, e)
            return []
    doomed = sorted(set(up) - listed)
    for snapshot, file in doomed:
        remote.remove_shared(run, snapshot, file)
    if doomed:
        log.info("run %r: removed remote shared files no record lists: %s", run,
                 ", ".join(f"{s}/{f}" for s, f in doomed))
    return doomed
