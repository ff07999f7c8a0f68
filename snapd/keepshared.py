"""Keeping the tensor files other snapshots share, and sweeping them when no one does.

A v4 snapshot may read some tensors from an earlier snapshot's file (``src``
entries; snapd/sharing.py). That file must outlive its snapshot for as long as a
committed snapshot refers to it, so un-committing a snapshot S (snapd/commit.py's
:func:`uncommit`, for retention's deletes, ``snapd gc`` and a damaged snapshot set
aside) first calls :func:`keep_referenced`: each file of S that another committed
manifest of the run refers to gets a second name, a hard link
``<run>/shared/<S>/<file>``, made durable before S is renamed away. A reader looks
in ``shared/`` first, then in ``snapshots/``: the file gains its second name before
it loses its first, so one of the two opens at every instant. After retention's
deletes, :func:`sweep` (mark and sweep) removes the ``shared/`` entries no committed
manifest refers to.

Every step is crash-safe (docs/format.md, "Keeping shared files", has the table):
the links are made and fsynced before the rename that un-commits S, a name under
``shared/`` that must change is replaced by a rename (a link to a tmp name first),
and the sweep removes only what no committed manifest names.

What counts as a reference: every committed one-rank snapshot's manifest, read and
decoded (its tensor files are not opened). Multi-rank snapshots are skipped: their
parts never share, and their files lie in ``rank-NNNNN/`` directories, which no
``shared`` entry can name. A committed manifest that cannot be decoded (damaged, or
of a newer format this snapd does not read, which may well share) might refer to
anything, so it makes both steps conservative: :func:`keep_referenced` keeps every
tensor file of S, and :func:`sweep` removes nothing. Retention never deletes such a
snapshot automatically either; once it is repaired or removed by hand, the next
sweep frees what it held.

Both run under the serialization retention has: the daemon's per-run write queue
(retention runs after each commit, on the writer's path), the in-process writer's
run lock, or ``snapd gc``'s root and run locks (snapd/retention.py, :func:`gc`). A
writer that refers to a file between the mark and the un-commit would otherwise be
missed.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import shutil
import stat
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from snapd import format as fmt
from snapd import fsio, sharing
from snapd.errors import SnapdError
from snapd.store import DIR_MODE, TMP_PREFIX, RunStore, SnapshotId

log = logging.getLogger(__name__)

Ref = Tuple[str, str]                      # (snapshot name, file name)
Marks = Dict[str, Optional[Set[Ref]]]      # committed name -> its references; None: unknown

# An unreferenced shared/ entry younger than this is not swept yet: it may be a file
# a pull brought down for a snapshot it has not committed yet.
SWEEP_MIN_AGE_S = 3600.0

# What os.link raises where a filesystem has no hard links (or no more for a file).
NO_HARD_LINKS = (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK, errno.EXDEV)

# Tests set this to reach a crash between two steps (a real SIGKILL from inside the
# hook); each step below calls it with the step's name. None in production.
crash_hook: Optional[Callable[[str], None]] = None


def passed(point: str) -> None:
    """A step of the lifecycle is done (the crash hook's seam)."""
    if crash_hook is not None:
        crash_hook(point)


# --- mark --------------------------------------------------------------------------

def mark(store: RunStore) -> Marks:
    """Every committed one-rank snapshot's references (None where its manifest cannot
    be decoded). Multi-rank snapshots are left out: they never share."""
    marks: Marks = {}
    for sid in store.committed():
        path = store.snapshot_path(sid)
        try:
            manifest = sharing.one_rank_manifest(path)
        except (SnapdError, OSError) as e:
            log.warning("run %r: %s cannot be read (%s); shared files are kept as if it "
                        "referred to all of them", store.run,
                        os.path.join(path, fmt.MANIFEST_NAME), e)
            marks[sid.name] = None
            continue
        if manifest is not None:
            marks[sid.name] = sharing.references(manifest)
    return marks


def unknown(marks: Marks, but: Optional[str] = None) -> List[str]:
    """The snapshots (other than ``but``) whose references are unknown."""
    return sorted(name for name, refs in marks.items() if refs is None and name != but)


def referenced(marks: Marks, but: Optional[str] = None) -> Set[Ref]:
    """Every reference of the marked snapshots other than ``but``."""
    return {ref for name, refs in marks.items() if name != but and refs for ref in refs}


# --- keep --------------------------------------------------------------------------

def keep_referenced(store: RunStore, sid: SnapshotId,
                    marks: Optional[Marks] = None) -> List[str]:
    """Before ``sid`` is un-committed: hard-link each of its files that another
    committed snapshot refers to into ``shared/<name>/``, durably. Returns the files
    kept. ``marks``: :func:`mark`'s result when the caller has it (the run unchanged
    since), else the manifests are read here.

    Raises (OSError, SnapdError) when a needed link cannot be made: the caller then
    does not un-commit the snapshot, which keeps everything whole."""
    name = sid.name
    marks = mark(store) if marks is None else marks
    kept = [f for f in files_to_keep(store, sid, marks) if _keep_one(store, name, f)]
    if kept:
        # The links durable before the rename that un-commits the snapshot.
        fsio.fsync_dir(os.path.join(store.path, sharing.SHARED_DIR, name))
        fsio.fsync_dir(os.path.join(store.path, sharing.SHARED_DIR))
        fsio.fsync_dir(store.path)
        passed("kept")
    return kept


def files_to_keep(store: RunStore, sid: SnapshotId, marks: Marks) -> List[str]:
    """The files of ``sid`` that the other marked snapshots refer to (every tensor
    file of it while one of them is unknown), sorted."""
    source_dir = store.snapshot_path(sid)
    if not _real_dir(source_dir):
        return []   # gone already, or not a directory snapd made: nothing of it to keep
    files = {f for s, f in referenced(marks, but=sid.name) if s == sid.name}
    if unknown(marks, but=sid.name):
        files |= set(_tensor_files(source_dir))
    return sorted(files)


def _keep_one(store: RunStore, name: str, file: str) -> bool:
    """One file's second name; whether it now has one."""
    source = os.path.join(store.snapshots_path, name, file)
    target = sharing.shared_path(store.path, name, file)
    try:
        st = os.lstat(source)
    except FileNotFoundError:
        if not os.path.lexists(target):
            log.warning("run %r: %s is referred to but missing, and not in %s; the "
                        "snapshots that read it are damaged", store.run, source, target)
        return False
    if not stat.S_ISREG(st.st_mode):
        log.warning("run %r: %s is not a regular file; not kept", store.run, source)
        return False
    _ensure_dir(os.path.join(store.path, sharing.SHARED_DIR))
    _ensure_dir(os.path.dirname(target))
    try:
        there = os.lstat(target)
    except FileNotFoundError:
        there = None
    if there is not None and (there.st_dev, there.st_ino) == (st.st_dev, st.st_ino):
        return True   # linked already (a pass that crashed before the rename)
    if there is None:
        try:
            os.link(source, target)
            passed("linked")
            return True
        except FileExistsError:
            pass   # appeared meanwhile: replaced as below
        except OSError as e:
            if e.errno not in NO_HARD_LINKS:
                raise
    # Another file holds the name, or the filesystem has no hard links: a second name
    # (or a copy) made under a tmp name and renamed over the name, so that the name
    # never holds a partial file, nor nothing once it held something.
    tmp = os.path.join(os.path.dirname(target), f"{TMP_PREFIX}{file}-{secrets.token_hex(4)}")
    _link_or_copy(source, tmp)
    passed("linked-tmp")
    os.replace(tmp, target)
    passed("replaced")
    return True


def _link_or_copy(source: str, dest: str) -> None:
    """``dest`` a hard link to ``source``; a durable copy (0600) where the filesystem
    has no hard links (the space is then spent twice, never the snapshot lost)."""
    try:
        os.link(source, dest)
        return
    except OSError as e:
        if e.errno not in NO_HARD_LINKS:
            raise
        log.warning("%s: no hard links here (%s); copying it to %s", source, e, dest)
    src = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        out = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            with os.fdopen(src, "rb", closefd=False) as r, \
                    os.fdopen(out, "wb", closefd=False) as w:
                shutil.copyfileobj(r, w, 1 << 20)
            st = os.fstat(src)
            os.utime(out, ns=(st.st_atime_ns, st.st_mtime_ns))   # its age, as a link has
            os.fsync(out)
        finally:
            os.close(out)
    finally:
        os.close(src)


def _ensure_dir(path: str) -> None:
    """A private directory of ours (0700); its creation durable in its parent. A
    symlink or file in its place is refused: links would lead writes out of the root."""
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        if not _real_dir(path):
            raise SnapdError(f"{path}: a symlink or non-directory where snapd keeps "
                             "shared tensor files; replace it with a directory (or "
                             "remove it) and run snapd gc again", path=path,
                             field="shared") from None
        return
    fsio.fsync_dir(os.path.dirname(path))
    passed("mkdir")


def _real_dir(path: str) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def _tensor_files(snapshot_dir: str) -> List[str]:
    """The regular tensor files directly in a snapshot directory."""
    names = []
    for entry in os.scandir(snapshot_dir):
        if entry.name.endswith(fmt.TENSOR_FILE_SUFFIX) and entry.is_file(follow_symlinks=False):
            names.append(entry.name)
    return names


# --- what a snapshot owns and shares ------------------------------------------------

@dataclass
class Usage:
    """A one-rank snapshot's bytes by its manifest: ``owned`` its own files hold
    (their sizes), ``shared`` its entries read from earlier snapshots' files (the
    stored bytes of those chunks, not the files' sizes: a snapshot reading one tensor
    of a large file shares that tensor), and the snapshots it reads them from."""

    owned: int
    shared: int
    shared_with: List[str]


def usage(manifest: Dict[str, Any]) -> Usage:
    owned = sum(int(entry["size"]) for entry in manifest.get("files", {}).values())
    shared_files = manifest.get("shared") or []
    shared, sources = 0, set()
    for obj in manifest["objects"].values():
        for t in obj["tensors"]:
            if t.get("src") is not None:
                shared += sum(c[1] for c in t["chunks"])
                sources.add(shared_files[t["src"]]["snapshot"])
    return Usage(owned, shared, sorted(sources))


# --- sweep -------------------------------------------------------------------------

@dataclass
class Swept:
    """What a sweep removed (or, planned, would remove)."""

    files: List[str] = field(default_factory=list)     # "<snapshot>/<file>"
    bytes: int = 0        # freed: removed entries that were the file's last name
    blocked_by: List[str] = field(default_factory=list)  # unreadable manifests: nothing removed


def sweep(store: RunStore, marks: Optional[Marks] = None, *, dry_run: bool = False) -> Swept:
    """Remove the ``shared/<S>/<file>`` entries no committed manifest refers to, and
    the ``shared/<S>`` directories left empty. ``marks``: the references to keep
    (:func:`mark` by default, after the deletes).

    Only what snapd makes is touched: real directories named as snapshots directly
    under ``shared/``, and the plain entries in them (files, and a symlink or tmp
    name there, which snapd never refers to); a symlink at ``shared/`` or
    ``shared/<S>``, other names and nested directories are left as they are.
    With an unreadable committed manifest nothing is removed (``blocked_by``).

    An entry modified less than SWEEP_MIN_AGE_S ago is left for a later sweep: a pull
    of a remote snapshot (snapd/remote/pull.py) puts the shared files it reads here
    before the rename that commits it, outside the serialization retention runs
    under. A kept file has its first name's mtime (a link, or a copy
    given it), so one written long ago is swept at once."""
    done = Swept()
    top = os.path.join(store.path, sharing.SHARED_DIR)
    if not _real_dir(top):
        return done
    marks = mark(store) if marks is None else marks
    done.blocked_by = unknown(marks)
    if done.blocked_by:
        return done
    keep = referenced(marks)
    for name in sorted(os.listdir(top)):
        directory = os.path.join(top, name)
        if SnapshotId.parse(name) is None or not _real_dir(directory):
            continue
        for file in sorted(os.listdir(directory)):
            if (name, file) not in keep:
                _sweep_one(os.path.join(directory, file), f"{name}/{file}", done, dry_run)
        if not dry_run:
            _remove_if_empty(directory)
    return done


def _sweep_one(path: str, label: str, done: Swept, dry_run: bool) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode) or _young(st):
        return   # not something snapd makes there; or perhaps a pull's, not yet read
    if not dry_run:
        os.unlink(path)   # never follows a link: removes the entry alone
        passed("swept")
    done.files.append(label)
    if stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
        done.bytes += st.st_size


def _young(st: os.stat_result) -> bool:
    return time.time() - st.st_mtime < SWEEP_MIN_AGE_S


def _remove_if_empty(directory: str) -> None:
    try:
        os.rmdir(directory)
    except OSError:
        pass   # not empty (still shared), or gone: both fine
