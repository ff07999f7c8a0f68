"""Uploading one locally committed snapshot to a remote root (docs/remote.md, "Uploading").

The order is the remote commit rule's, each step repeatable after a crash:

1. List the local snapshot directory (``<root>/<run>/snapshots/<name>/``): it is
   committed, so nothing writes there any more; its files are the snapshot.
2. Ask the remote what is already under ``snapshots/<name>/``: a file of the right
   size was uploaded by an earlier attempt (a put is all or nothing) and is skipped.
3. The tensor files, several at a time (snapd/remote/transfer.py).
3b. The shared files its tensors read (format v4: earlier snapshots' tensor files,
   found locally by snapd/sharing.py) to ``shared/<snapshot>/<file>``, unless one
   of the right size is already there: a frozen base goes up once for every later
   snapshot that reads it.
4. The manifests (each rank's, for a multi-rank snapshot), then ``commit.snapd``:
   a reader opens these first, so they go up after what they describe.
5. The record ``committed/<name>.snapd``, last, listing the files and the shared
   files: from here the snapshot is committed remotely. A record already there (an
   earlier attempt got this far) ends it at once.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Dict, List, Optional, Tuple

from snapd import format as fmt
from snapd import sharing
from snapd.errors import CorruptSnapshot, RemoteUnavailable, SnapdError
from snapd.remote import transfer
from snapd.remote.layout import (RemoteFile, RemoteRoot, SharedFile, check_relpath,
                                 make_record)
from snapd.store import RunStore, SnapshotId

log = logging.getLogger(__name__)

Progress = Optional[Callable[[int], None]]


def local_files(path: str) -> List[RemoteFile]:
    """Every file of a committed snapshot directory, by relative path (one level of
    ``rank-NNNNN/`` for a multi-rank snapshot). A name snapd does not write is refused:
    it would not be accepted back from the remote either."""
    found = []
    for entry in sorted(os.scandir(path), key=lambda e: e.name):
        if entry.is_dir(follow_symlinks=False):
            for sub in sorted(os.scandir(entry.path), key=lambda e: e.name):
                found.append((f"{entry.name}/{sub.name}", sub))
        elif entry.is_file(follow_symlinks=False):
            found.append((entry.name, entry))
    return [RemoteFile(check_relpath(rel, where=path), e.stat(follow_symlinks=False).st_size)
            for rel, e in found]


def upload_order(files: List[RemoteFile]) -> Tuple[List[RemoteFile], List[RemoteFile]]:
    """(tensor and other files, then the files a reader opens first: the manifests,
    then commit.snapd last)."""
    def late(f: RemoteFile) -> int:
        leaf = f.relpath.rsplit("/", 1)[-1]
        return 2 if f.relpath == fmt.COMMIT_NAME else 1 if leaf == fmt.MANIFEST_NAME else 0
    ordered = sorted(files, key=lambda f: (late(f), f.relpath))
    return [f for f in ordered if not late(f)], [f for f in ordered if late(f)]


def upload_snapshot(remote: RemoteRoot, store: RunStore, name: str, *, threads: int = 4,
                    progress: Progress = None, signer: Any = None) -> Dict[str, Any]:
    """Upload the locally committed snapshot ``name`` of ``store``'s run; returns its
    remote commit record (signed with ``signer``'s key when given: snapd/signing.py). Raises RemoteUnavailable on a transfer failure (the caller
    retries: every step is repeatable) and SnapdError when the local snapshot is gone."""
    sid = SnapshotId.parse(name)
    path = os.path.join(store.snapshots_path, name)
    if sid is None or not os.path.isdir(path):
        raise SnapdError(f"{path}: no committed snapshot to upload (deleted by retention "
                         "meanwhile?)", path=path, field="name")
    where = remote.where(remote.record_path(store.run, name))
    existing = _remote(where, _existing_record, remote, store.run, name)
    if existing is not None:
        return existing
    files = local_files(path)                                                # 1.
    top_name, world_size = _top(path)
    manifest_path = os.path.join(path, top_name)
    top_bytes = _read(manifest_path)
    shared = shared_files(top_bytes, manifest_path) if world_size == 1 else []
    done = _remote(where, remote.uploaded_files, store.run, name)            # 2.
    tensors, readers_first = upload_order(files)
    _put(remote, store.run, name, path, tensors, done, threads, progress)    # 3.
    put_shared(remote, store, shared, threads=threads, wanted_by=manifest_path)  # 3b.
    _put(remote, store.run, name, path, readers_first, done, threads, progress)  # 4.
    record = make_record(store.run, sid, world_size, files, top_bytes, shared)
    _remote(where, remote.write_record, store.run, name, record, signer)     # 5.
    log.info("run %r: %s committed remotely at %s (%d files, %d bytes)", store.run,
             name, remote.url, len(files), record["bytes"])
    return record


def _put(remote: RemoteRoot, run: str, name: str, path: str, batch: List[RemoteFile],
         done: Dict[str, int], threads: int, progress: Progress) -> None:
    todo = [f for f in batch if done.get(f.relpath) != f.size]
    for f in batch:
        if f not in todo and progress is not None:
            progress(f.size)   # already up: counted as moved
    pairs = [(os.path.join(path, f.relpath), remote.file_path(run, name, f.relpath))
             for f in todo]
    transfer.put_files(remote.fs, pairs, threads=threads, sizes=[f.size for f in todo],
                       progress=progress, where=remote.where(remote.snapshot_path(run, name)))


def shared_files(manifest_bytes: bytes, manifest_path: str) -> List[SharedFile]:
    """The files of earlier snapshots that a one-rank manifest's tensors read, with the
    sizes the manifest gives them (none before format v4)."""
    manifest = fmt.decode_manifest(manifest_bytes, path=manifest_path)
    used = sharing.references(manifest)
    return [SharedFile(s["snapshot"], s["file"], s["size"])
            for s in manifest.get("shared") or [] if (s["snapshot"], s["file"]) in used]


def shared_source(store: RunStore, shared: SharedFile, *, wanted_by: str) -> str:
    """The local path of a shared file: pinned beside the upload when the uploader
    pinned it (``store.shared_pins``), else where snapd/sharing.py finds it; refused
    when its size is not the manifest's."""
    pins = getattr(store, "shared_pins", None)
    pinned = os.path.join(pins, shared.snapshot, shared.file) if pins else None
    found = pinned if pinned and os.path.lexists(pinned) else sharing.locate(
        store.path, shared.snapshot, shared.file, wanted_by=wanted_by)
    size = os.lstat(found).st_size
    if size != shared.size:
        raise CorruptSnapshot(f"{found}: {size} bytes, but {wanted_by} reads it as "
                              f"{shared.size} (field shared); the local bytes it shares "
                              "are damaged: snapd verify names the snapshots that read it",
                              path=found, field="shared")
    return found


def put_shared(remote: RemoteRoot, store: RunStore, shared: List[SharedFile], *,
               threads: int, wanted_by: str) -> None:
    """Step 3b: each shared file not yet at ``shared/<snapshot>/<file>`` at its size."""
    if not shared:
        return
    where = remote.where(remote.shared_root(store.run))
    up = _remote(where, remote.shared_files, store.run)
    todo = [s for s in shared if up.get(s.key) != s.size]
    pairs = [(shared_source(store, s, wanted_by=wanted_by),
              remote.shared_path(store.run, s.snapshot, s.file)) for s in todo]
    transfer.put_files(remote.fs, pairs, threads=threads, sizes=[s.size for s in todo],
                       where=where)
    if todo:
        log.info("run %r: %d shared file(s) uploaded to %s (%d already there)", store.run,
                 len(todo), where, len(shared) - len(todo))


def _remote(where: str, call: Callable[..., Any], *args: Any) -> Any:
    """A call to the remote, its failures as RemoteUnavailable (which the uploader
    retries), told apart from a local file's."""
    try:
        return call(*args)
    except SnapdError:
        raise
    except Exception as e:   # s3fs, botocore, aiohttp: each has its own errors
        raise RemoteUnavailable(f"{where}: {type(e).__name__}: {e}; it is retried",
                                path=where, field="remote") from e


def _existing_record(remote: RemoteRoot, run: str, name: str) -> Optional[Dict[str, Any]]:
    """The record of a snapshot already committed remotely; a damaged one is uploaded
    again (and overwritten) rather than trusted."""
    if not remote.fs.exists(remote.record_path(run, name)):
        return None
    try:
        return remote.read_record(run, name)
    except CorruptSnapshot as e:
        log.warning("run %r: the remote record of %s is damaged (%s); uploading again",
                    run, name, e)
        return None


def _top(path: str) -> Tuple[str, int]:
    """The snapshot's top file and world size: a multi-rank snapshot's commit record
    says how many ranks; one rank has only its manifest."""
    commit = os.path.join(path, fmt.COMMIT_NAME)
    if os.path.exists(commit):
        record = fmt.decode_commit(_read(commit), path=commit)
        return fmt.COMMIT_NAME, int(record["world_size"])
    return fmt.MANIFEST_NAME, 1


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()
