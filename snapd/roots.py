"""A checkpoint root, on the local disk or behind a URL, read through one interface.

Every operator command (``ls``, ``status``, ``inspect``, ``verify``, ``diff``,
``export``, ``pull``) reads a root through a :class:`Root`, never by asking which kind
it has: its runs, each run's committed snapshots and pointers, a directory holding a
snapshot's manifests, a check of its files' sizes, a directory holding every file of
it verified, the runs' state logs, and what is there but never read. Two kinds:

- :class:`DiskRoot`: a directory (snapd/store.py's layout). Every view reads the
  snapshot's own directory.
- :class:`StoreRoot`: any fsspec URL (``s3://bucket/prefix`` through s3fs,
  ``file:///mnt/shared``), the remote tier's layout (snapd/remote/layout.py). Only
  remotely committed snapshots are listed (docs/remote.md, the commit rule); a view
  of the manifests fetches only the small files (the manifest, or a multi-rank
  snapshot's commit record and its parts' manifests) into a temporary directory; a
  view of every file pulls the snapshot there (snapd/remote/pull.py: every size and
  checksum checked). A client's restore with a remote tier reads it here too
  (snapd_client/fromremote.py: the commits, a pull, the replicated log), its calls
  bounded by ``remote_timeout`` (``open_root``'s ``timeout``).

:func:`open_root` is the one place that tells a URL from a path.
"""

from __future__ import annotations

import os
import tempfile
import time
from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

from snapd import format as fmt
from snapd import pins
from snapd.errors import CorruptSnapshot, InvalidOption
from snapd.globalcommit import incomplete
from snapd.globalsnap import GlobalSnapshot, open_snapshot
from snapd.remote.layout import RemoteRoot, record_files
from snapd.remote.logsync import pull_log
from snapd.remote.pull import arrived, check_listing, pull, reaching, refuse_credentials
from snapd.store import POINTERS, RunStore, SnapshotId, list_runs


def is_url(text: Optional[str]) -> bool:
    """A root given as a URL (``scheme://...``) rather than a directory."""
    return bool(text) and "://" in str(text)


@dataclass(frozen=True)
class Snap:
    """A committed snapshot a command acts on."""

    run: Optional[str]    # None: a directory given by path, outside any run layout
    name: str             # its snapshot name (directory name)
    where: str            # its directory, or its URL: what messages name
    label: str            # RUN/NAME, URL/RUN@STEP, or the directory

    @property
    def argument(self) -> str:
        """How a command names it again from anywhere: its directory, or its URL form."""
        return self.label if is_url(self.label) else self.where

    @property
    def sid(self) -> Optional[SnapshotId]:
        return SnapshotId.parse(self.name)


class Root(ABC):
    """The reading side of a checkpoint root (module docstring)."""

    where: str   # the root as messages name it (a URL never with credentials)

    @abstractmethod
    def runs(self) -> List[str]:
        """Every run, by name."""

    @abstractmethod
    def commits(self, run: str) -> List[SnapshotId]:
        """The run's committed snapshots, oldest first."""

    @abstractmethod
    def pointer(self, run: str, which: str) -> Optional[SnapshotId]:
        """What LATEST or BEST names (a hint: it may name no committed snapshot)."""

    @abstractmethod
    def snap(self, run: str, sid: SnapshotId) -> Snap:
        """Snapshot ``sid`` of ``run`` as a command names it."""

    @abstractmethod
    def manifests(self, snap: Snap) -> "Iterator[str]":
        """(A context manager) a directory holding the snapshot's manifests under its
        name: ``manifest.snapd``, or ``commit.snapd`` and each part's manifest."""

    @abstractmethod
    def check_files(self, snap: Snap) -> None:
        """Every file the snapshot lists is there at its size; CorruptSnapshot naming
        the first that is not. Nothing is read."""

    @abstractmethod
    def files(self, snap: Snap) -> "Iterator[str]":
        """(A context manager) a directory holding every file of the snapshot, as
        committed on a disk; CorruptSnapshot when a file does not verify."""

    @abstractmethod
    def unfinished(self, run: str) -> List[Dict[str, Any]]:
        """What is there but never read: a multi-rank snapshot some rank never
        completed, an upload without its commit record. Each has ``run``, ``name``,
        ``path`` and ``line``, the sentence that says so."""

    @abstractmethod
    def logs(self) -> "Iterator[str]":
        """(A context manager) a directory laid out as a root, holding every run's state
        log (snapd/statelog.py reads it) and nothing else this root does not have."""

    @abstractmethod
    def snapshot_where(self, run: str, sid: SnapshotId) -> str:
        """Where snapshot ``sid`` of ``run`` is or would be, committed or not."""

    def has_run(self, run: str) -> bool:
        return run in self.runs()

    def exists(self) -> bool:
        """Whether there is a root here at all (a URL is only known by reading it)."""
        return True

    @abstractmethod
    def run_where(self, run: str) -> str:
        """Where run ``run`` is or would be."""

    def pinned(self, run: str) -> List[SnapshotId]:
        """The snapshots pinned in ``run`` (snapd/pins.py); pins live in the local run
        only, so a remote root has none."""
        return []

    def latest(self, run: str) -> Optional[SnapshotId]:
        """LATEST when it names a committed snapshot, else the newest committed one."""
        commits = self.commits(run)
        named = self.pointer(run, "LATEST")
        return named if named in commits else (commits[-1] if commits else None)

    def parts_where(self, run: str, sid: SnapshotId) -> Optional[str]:
        """Where some ranks' parts of a snapshot not committed globally lie, if any."""
        return None

    def daemon_root(self) -> Optional[str]:
        """The directory a daemon serving this root listens in (None: no daemon)."""
        return None

    def against_commits(self, rows: List[Dict[str, Any]],
                        jobs: List[Dict[str, Any]]) -> None:
        """``snapd status``'s rows and jobs (planned from :meth:`logs`) set against
        this root's commits, where the logs alone do not know them. On a disk the log
        planner reads the snapshot directories itself: nothing to add."""

    def stored_bytes(self, snap: Snap) -> int:
        """The bytes a copy of the snapshot brings (its files, and the shared files
        it reads)."""
        raise self._read_in_place()

    def pull(self, snap: Snap, store: RunStore, **how: Any) -> str:
        """Commit ``snap`` into ``store`` on the local disk, verified (``snapd pull``);
        returns the local directory."""
        raise self._read_in_place()

    def _read_in_place(self) -> InvalidOption:
        return InvalidOption(f"{self.where}: snapd pull brings a snapshot from a root "
                            "behind a URL (s3://..., file:///...); a directory is read in "
                            "place", path=self.where, field="URL")


class DiskRoot(Root):
    """A root on the local disk (snapd/store.py)."""

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(path)
        self.where = self.path

    def store(self, run: str) -> RunStore:
        return RunStore(self.path, run)

    def runs(self) -> List[str]:
        return list_runs(self.path)

    def has_run(self, run: str) -> bool:
        return os.path.isdir(os.path.join(self.path, run))

    def exists(self) -> bool:
        return os.path.isdir(self.path)

    def run_where(self, run: str) -> str:
        return os.path.join(self.path, run)

    def commits(self, run: str) -> List[SnapshotId]:
        return self.store(run).committed()

    def pinned(self, run: str) -> List[SnapshotId]:
        return pins.pinned(self.run_where(run))

    def pointer(self, run: str, which: str) -> Optional[SnapshotId]:
        assert which in POINTERS
        return self.store(run).read_pointer(which)

    def snap(self, run: str, sid: SnapshotId) -> Snap:
        path = self.snapshot_where(run, sid)
        return Snap(run, sid.name, path, f"{run}/{sid.name}")

    def snapshot_where(self, run: str, sid: SnapshotId) -> str:
        return self.store(run).snapshot_path(sid)

    def parts_where(self, run: str, sid: SnapshotId) -> Optional[str]:
        path = self.store(run).parts_path(sid)
        return path if os.path.isdir(path) else None

    @contextmanager
    def manifests(self, snap: Snap) -> Iterator[str]:
        yield snap.where

    def check_files(self, snap: Snap) -> None:
        opened = open_snapshot(snap.where)
        for rank in range(opened.world_size if isinstance(opened, GlobalSnapshot) else 0):
            try:
                opened.part(rank)
            except CorruptSnapshot as e:
                raise CorruptSnapshot(f"rank {rank}: {e}", path=e.path, field=e.field) from e

    @contextmanager
    def files(self, snap: Snap) -> Iterator[str]:
        yield snap.where

    def unfinished(self, run: str) -> List[Dict[str, Any]]:
        return [{"run": run, **entry, "line": _incomplete_line(run, entry)}
                for entry in incomplete(self.store(run))]

    @contextmanager
    def logs(self) -> Iterator[str]:
        yield self.path

    def daemon_root(self) -> Optional[str]:
        return self.path


def _incomplete_line(run: str, entry: Dict[str, Any]) -> str:
    world = entry["world_size"]
    present = ", ".join(map(str, entry["ranks"])) or "none"
    missing = ", ".join(map(str, entry["missing"])) or "unknown"
    return (f"{run}/{entry['name']} INCOMPLETE: ranks {present} of "
            f"{world if world else '?'} present, missing {missing} ({entry['path']}). "
            "Never restored; snapd gc removes it once a newer snapshot is committed")


class StoreRoot(Root):
    """A root behind an fsspec URL: the remote tier's layout (snapd/remote/layout.py)."""

    def __init__(self, url: str, timeout: Optional[float] = None) -> None:
        self.remote = RemoteRoot(refuse_credentials(url, where="snapd"), timeout=timeout)
        self.where = self.remote.url
        self._records: Dict[Tuple[str, str], Dict[str, Any]] = {}

    def runs(self) -> List[str]:
        with reaching(self.remote, "listing the runs"):
            return self.remote.runs()

    def commits(self, run: str) -> List[SnapshotId]:
        with reaching(self.remote, f"listing the commits of {run}"):
            return self.remote.commits(run)

    def pointer(self, run: str, which: str) -> Optional[SnapshotId]:
        """A remote root keeps no pointer files: LATEST is the newest remote commit;
        BEST is not kept remotely."""
        assert which in POINTERS
        commits = self.commits(run) if which == "LATEST" else []
        return commits[-1] if commits else None

    def latest(self, run: str) -> Optional[SnapshotId]:
        """The newest remote commit: LATEST is that here, so one listing answers."""
        commits = self.commits(run)
        return commits[-1] if commits else None

    def snap(self, run: str, sid: SnapshotId) -> Snap:
        label = sid.name if sid.lineage else str(sid.step)
        return Snap(run, sid.name, self.snapshot_where(run, sid),
                    f"{self.where}/{run}@{label}")

    def run_where(self, run: str) -> str:
        return self.remote.where(self.remote.run_path(run))

    def snapshot_where(self, run: str, sid: SnapshotId) -> str:
        return self.remote.where(self.remote.snapshot_path(run, sid.name))

    def record(self, snap: Snap) -> Dict[str, Any]:
        """The snapshot's remote commit record, decoded and checked (read once)."""
        key = (snap.run, snap.name)
        if key not in self._records:
            with reaching(self.remote, f"reading {snap.label}"):
                self._records[key] = self.remote.read_record(snap.run, snap.name)
        return self._records[key]

    @contextmanager
    def manifests(self, snap: Snap) -> Iterator[str]:
        record = self.record(snap)
        small = [f.relpath for f in record_files(record)
                 if f.relpath.rsplit("/", 1)[-1] in (fmt.MANIFEST_NAME, fmt.COMMIT_NAME)]
        with tempfile.TemporaryDirectory(prefix="snapd-manifests-") as tmp:
            directory = os.path.join(tmp, snap.name)
            for relpath in small:
                remote_path = self.remote.file_path(snap.run, snap.name, relpath)
                with reaching(self.remote, f"reading {snap.label}"):
                    data = self.remote.read_small(remote_path, fmt.MAX_MANIFEST_BYTES)
                local = os.path.join(directory, relpath)
                os.makedirs(os.path.dirname(local), exist_ok=True)
                with open(local, "wb") as f:
                    f.write(data)
            yield directory

    def check_files(self, snap: Snap) -> None:
        record = self.record(snap)
        with reaching(self.remote, f"listing {snap.label}"):
            check_listing(self.remote, snap.run, snap.name, record)

    def stored_bytes(self, snap: Snap) -> int:
        record = self.record(snap)
        return record["bytes"] + sum(s["size"] for s in record.get("shared") or [])

    def pull(self, snap: Snap, store: RunStore, **how: Any) -> str:
        return pull(self.remote, store, snap.name, **how)

    def begin_pull(self, snap: Snap, store: RunStore, later: Any, **how: Any) -> Any:
        """A pull in two halves (snapd/remote/pendingpull.py): every file but those of
        the objects ``later`` names brought down and verified; the PendingPull, whose
        finish() commits it, or None when the snapshot is to be pulled whole."""
        from snapd.remote.pendingpull import begin_pull
        return begin_pull(self.remote, store, snap.name, later, **how)

    def pull_log(self, store: RunStore, **how: Any) -> List[int]:
        """The run's replicated state log brought into ``store`` for each rank whose
        local log has no segment (a new node's restore); returns those ranks. ``how``:
        pull_log's ``deadline`` (snapd/remote/logsync.py)."""
        return pull_log(self.remote, store, **how)

    @staticmethod
    def arrived(store: RunStore) -> int:
        """Bytes a pull into ``store`` has downloaded so far (its tmp names): a caller
        waiting on the pull sees the store still answering (snapd/remote/deadline.py).
        Local, so it is asked before the root is opened too."""
        return arrived(store)

    @contextmanager
    def files(self, snap: Snap) -> Iterator[str]:
        with tempfile.TemporaryDirectory(prefix="snapd-pull-") as tmp:
            yield pull(self.remote, RunStore(tmp, snap.run), snap.name, min_free_bytes=0)

    def unfinished(self, run: str) -> List[Dict[str, Any]]:
        with reaching(self.remote, f"listing the uploads of {run}"):
            commits = set(self.remote.commits(run))
            names = [n for n in self.remote.snapshot_names(run)
                     if SnapshotId.parse(n) not in commits]
        out = []
        for name in names:
            where = self.remote.where(self.remote.snapshot_path(run, name))
            out.append({"run": run, "name": name, "path": where,
                        "line": f"{run}/{name}: files without a remote commit record "
                                f"({where}): an upload in progress or abandoned; never read"})
        return out

    def against_commits(self, rows: List[Dict[str, Any]],
                        jobs: List[Dict[str, Any]]) -> None:
        """Each run's newest remote commit (from its record) in place of what the
        replicated log says: "at risk" counts the updates a restore from here would
        recompute."""
        newest: Dict[str, Tuple[int, Optional[Dict[str, Any]]]] = {}
        for run in {row["run"] for row in rows} | {job["run"] for job in jobs}:
            commits = self.commits(run)
            newest[run] = (len(commits), self._newest_record(run, commits))
        for row in rows:
            count, record = newest[row["run"]]
            row.update(remote=self.where, remote_commits=count, committed=None,
                       committed_step=None, committed_age_s=None, at_risk=None)
            if record is not None:
                row.update(committed=record["name"], committed_step=record["step"],
                           committed_age_s=time.time() - record["uploaded_at"],
                           at_risk=None if row["reached"] is None else
                           max(0, row["reached"] - record["step"]))
        for job in jobs:
            record = newest[job["run"]][1]
            job["last_global_commit"] = record["name"] if record else None

    def _newest_record(self, run: str, commits: List[SnapshotId]
                       ) -> Optional[Dict[str, Any]]:
        for sid in reversed(commits):
            try:
                return self.record(self.snap(run, sid))
            except CorruptSnapshot:
                continue
        return None

    @contextmanager
    def logs(self) -> Iterator[str]:
        with tempfile.TemporaryDirectory(prefix="snapd-logs-") as tmp:
            with reaching(self.remote, "reading the runs' logs"):
                for run in self.remote.runs():
                    store = RunStore(tmp, run)
                    store.ensure()
                    self.pull_log(store)
            yield tmp


def open_root(text: str, *, timeout: Optional[float] = None) -> Root:
    """The root a user named: a URL (any fsspec scheme) or a directory. Nothing is
    checked here but the URL's form (no credentials in it)."""
    if is_url(text):
        return StoreRoot(text, timeout=timeout)
    return DiskRoot(text)


def root_argument(first: Optional[str], root: Optional[str]
                  ) -> Tuple[Optional[str], Optional[str]]:
    """(the root, the run) of a command whose first argument is a RUN, which may also
    be the root itself when given as a URL (``snapd ls s3://bucket/prefix``)."""
    if is_url(first) and not is_url(root):
        return first, None
    return root, first


def split_target(spec: str, root: str) -> Tuple[str, str]:
    """The root a SNAPSHOT argument is read from, and the rest of it: a URL argument
    (``URL/RUN@STEP``, ``URL/RUN/NAME``, ``URL/RUN``) names its own root; anything
    else is read under ``root``."""
    if not is_url(spec):
        return root, spec
    url, _, rest = spec.rstrip("/").rpartition("/")
    if "@" not in rest and _is_snapshot_name(rest) and "/" in url.partition("://")[2]:
        url, _, run = url.rpartition("/")   # URL/RUN/NAME
        rest = f"{run}/{rest}"
    if not url.partition("://")[2]:
        raise InvalidOption(f"{spec}: name the run after the root, as in "
                            "s3://bucket/prefix/RUN@1200", path=spec, field="SNAPSHOT")
    return url, rest


def _is_snapshot_name(text: str) -> bool:
    step, _, lineage = text.partition(".L")
    return step.isdigit() and (not lineage or lineage.isdigit())
