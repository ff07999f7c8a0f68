"""A root on disk: runs, snapshots, the LATEST and BEST pointers, tmp collection.

Layout (docs/format.md has the full spec)::

    <root>/.snapd.sock                 daemon socket
    <root>/<run>/log/rank-NNNNN/       state-log segments
    <root>/<run>/snapshots/00001200/   one committed snapshot (lineage 0)
    <root>/<run>/snapshots/00001200.L1 one committed snapshot of lineage 1
    <root>/<run>/snapshots/.tmp-*/     being written or abandoned: never read
    <root>/<run>/snapshots/.parts-*/   parts of a multi-rank snapshot not yet
                                       committed globally: never restored
    <root>/<run>/LATEST, BEST          pointers: a snapshot name and a newline

Pointers are hints: a reader verifies what they name and falls back to the newest
committed name that verifies. Order is by (lineage, step) parsed from the name, which
the writer derives from the manifest; never by mtime.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import stat
from dataclasses import dataclass
from typing import List, Optional, Tuple

from snapd import fsio
from snapd.errors import InvalidOption, SnapdError
from snapd.format import SNAPSHOT_NAME

_RUN_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.=+-]{0,127}$")
TMP_PREFIX = ".tmp-"
DAMAGED_PREFIX = ".damaged-"
PARTS_PREFIX = ".parts-"
POINTERS = ("LATEST", "BEST")
DIR_MODE = 0o700  # run, snapshots/, log/ and each snapshot directory (docs/format.md)


@dataclass(frozen=True, order=True)
class SnapshotId:
    """Where a snapshot sits in a run's history: ordering key and directory name."""

    lineage: int
    step: int

    @property
    def name(self) -> str:
        return f"{self.step:08d}" + (f".L{self.lineage}" if self.lineage else "")

    @classmethod
    def parse(cls, name: str) -> Optional["SnapshotId"]:
        match = SNAPSHOT_NAME.match(name)
        if not match:
            return None
        return cls(int(match.group(2) or 0), int(match.group(1)))


def check_run_name(run: str) -> str:
    if not isinstance(run, str) or not _RUN_NAME.match(run) or run in (".", ".."):
        raise InvalidOption(f"run name {run!r} is not a plain directory name; use "
                            "letters, digits and _ . = + - (at most 128)", field="run")
    return run


class RunStore:
    """One run's directory under a root."""

    def __init__(self, root: str, run: str) -> None:
        self.root = os.path.abspath(root)
        self.run = check_run_name(run)
        self.path = os.path.join(self.root, run)
        self.snapshots_path = os.path.join(self.path, "snapshots")
        self.log_path = os.path.join(self.path, "log")

    def ensure(self) -> None:
        """Create the run's directories, owner-only (0700, narrowed further by the
        umask); refuse a symlink in their place, which would lead writes outside."""
        for path in (self.path, self.snapshots_path, self.log_path):
            os.makedirs(path, mode=DIR_MODE, exist_ok=True)
            if os.path.islink(path) or not os.path.isdir(path):
                raise SnapdError(f"{path}: a symlink or non-directory where snapd keeps "
                                 f"run {self.run!r}; snapd never writes through links out "
                                 "of the root. Replace it with a directory")

    def snapshot_path(self, sid: SnapshotId) -> str:
        return os.path.join(self.snapshots_path, sid.name)

    def parts_path(self, sid: SnapshotId) -> str:
        """Where the parts of multi-rank snapshot ``sid`` gather before the global
        commit renames the directory to its snapshot name (snapd/globalcommit.py)."""
        return os.path.join(self.snapshots_path, f"{PARTS_PREFIX}{sid.name}")

    def parts_dirs(self) -> List[Tuple[SnapshotId, str]]:
        """Every ``.parts-<name>`` directory, oldest snapshot first."""
        try:
            names = os.listdir(self.snapshots_path)
        except FileNotFoundError:
            return []
        found = [(SnapshotId.parse(n[len(PARTS_PREFIX):]), n) for n in names
                 if n.startswith(PARTS_PREFIX)]
        return sorted((sid, os.path.join(self.snapshots_path, n))
                      for sid, n in found if sid is not None)

    def new_tmp_dir(self, sid: SnapshotId) -> str:
        self.ensure()
        path = os.path.join(self.snapshots_path,
                            f"{TMP_PREFIX}{sid.name}-{secrets.token_hex(4)}")
        os.mkdir(path, DIR_MODE)
        return path

    def committed(self) -> List[SnapshotId]:
        """Committed snapshots, oldest first. Tmp dirs and stray names are never listed."""
        try:
            names = os.listdir(self.snapshots_path)
        except FileNotFoundError:
            return []
        ids = [SnapshotId.parse(n) for n in names]
        return sorted(i for i in ids if i is not None)

    def read_pointer(self, which: str) -> Optional[SnapshotId]:
        """The snapshot a pointer names, or None if absent or not a snapshot name."""
        try:
            fd = os.open(os.path.join(self.path, which),
                         os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:  # absent, or a symlink: a hint is only a hint
            return None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO would block a read
                return None
            text = os.read(fd, 64).decode("ascii").strip()
        except (OSError, UnicodeDecodeError):
            return None
        finally:
            os.close(fd)
        return SnapshotId.parse(text)

    def write_pointer(self, which: str, sid: SnapshotId) -> None:
        assert which in POINTERS
        fsio.replace_file_atomic(os.path.join(self.path, which), f"{sid.name}\n".encode())

    def tmp_dirs(self) -> List[str]:
        try:
            names = os.listdir(self.snapshots_path)
        except FileNotFoundError:
            return []
        return [os.path.join(self.snapshots_path, n) for n in names
                if n.startswith(TMP_PREFIX)]

    def discard(self, path: str, what: str) -> None:
        """Remove ``path``, never a committed snapshot (an older attempt's part, a stray
        entry of a parts dir): renamed to ``.tmp-<what>-<nonce>`` first, so that a crash
        in the slow delete leaves a tmp dir to collect, never half a directory where a
        reader or the global commit looks."""
        away = os.path.join(self.snapshots_path,
                            f"{TMP_PREFIX}{what}-{secrets.token_hex(4)}")
        os.rename(path, away)
        if stat.S_ISDIR(os.lstat(away).st_mode):
            shutil.rmtree(away, ignore_errors=True)
        else:
            os.unlink(away)   # a file or a link: the entry alone

    def collect_tmp(self, keep: tuple = ()) -> int:
        """Remove abandoned tmp dirs (none is ever read); returns how many."""
        removed = 0
        for path in self.tmp_dirs():
            if path not in keep:
                shutil.rmtree(path, ignore_errors=True)
                removed += 1
        return removed


def list_runs(root: str) -> List[str]:
    """Run names under a root: directories that hold a snapshots/ or log/ folder."""
    try:
        names = sorted(os.listdir(root))
    except FileNotFoundError:
        return []
    return [n for n in names if _RUN_NAME.match(n) and (
        os.path.isdir(os.path.join(root, n, "snapshots"))
        or os.path.isdir(os.path.join(root, n, "log")))]


def remove_pointer(store: RunStore, which: str) -> None:
    """Remove a pointer (it named a snapshot that no longer exists); absent is fine."""
    assert which in POINTERS
    try:
        os.unlink(os.path.join(store.path, which))
    except FileNotFoundError:
        return
    fsio.fsync_dir(store.path)
