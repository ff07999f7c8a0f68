"""Bringing a remotely committed snapshot, and the replicated log, onto the local disk.

A pull is a local commit whose bytes come from the remote root (docs/remote.md,
"Reading"), in this order:

1. The remote commit record, decoded and checked (layout.decode_record: names,
   sizes, the top file). Nothing else on the remote is looked at without it.
2. The listing of ``snapshots/<name>/`` against the record, and of ``shared/`` for
   each shared file the record lists that snapd/sharing.py does not find locally: a
   file missing or of another size is damage, found before a byte is downloaded.
3. Free space on the local disk for the record's bytes and those shared files'.
4. Every file downloaded into a tmp dir of the local run (the store's ``.tmp-``
   naming: no reader lists it, ``gc --collect-tmp`` removes an abandoned one), its
   size checked again and the top file's xxh3 against the record's; then each
   shared file not found locally to ``<run>/shared/<snapshot>/<file>`` (a tmp name,
   its size checked, fsynced, renamed), where the readers find it.
5. Every checksum verified by the local readers (SnapshotReader, or GlobalSnapshot
   for many ranks), the manifest's run, step and lineage against the name; the
   tensors that read shared files read them where step 4 put them.
6. The files and the tmp dir fsynced, then the commit service's :func:`snapd.commit.
   publish`, as every local commit: the rename that commits it, then LATEST by the
   one rule (it moves only forward: pulling an older snapshot leaves it).

Any failure removes the tmp dir. Shared files already brought down stay (another pull
of this node may be reading them): none is referenced by a committed snapshot, so
local retention's sweep of ``shared/`` removes them. Damage raises CorruptSnapshot
naming the remote file; a remote that cannot be reached raises RemoteUnavailable.

Under a ``deadline`` (restore()'s ``remote_timeout``, snapd/remote/deadline.py),
step 6 and the log's segments moving in are done under the deadline's lock, and
refused (RemoteUnavailable, field ``remote_timeout``) once the caller went on.
"""

from __future__ import annotations

import glob
import logging
import os
import stat
import secrets
import shutil
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from snapd import diskguard, fsio, sharing
from snapd import format as fmt
from snapd.commit import enospc_of, publish
from snapd.errors import CorruptSnapshot, RemoteUnavailable, SnapdError
from snapd.globalsnap import GlobalSnapshot
from snapd.options import Options
from snapd.reader import SnapshotReader
from snapd.remote import transfer
from snapd.remote.deadline import NO_DEADLINE, Deadline
from snapd.remote.layout import (RemoteFile, RemoteRoot, SharedFile, check_relpath,
                                 decode_record, record_files, record_shared, redact)
from snapd.store import DIR_MODE, TMP_PREFIX, RunStore, SnapshotId

log = logging.getLogger(__name__)

Progress = transfer.Progress


def refuse_credentials(url: str, *, where: str) -> str:
    """A URL the user gave, refused when it carries ``user:password@``: credentials
    come from the environment and are never written where snapd writes."""
    if isinstance(url, str) and redact(url) != url:
        raise RemoteUnavailable(f"{where}: {redact(url)} was given with a user or password "
                                "in the URL; put credentials in the environment (AWS_* "
                                "variables, fsspec configuration) and give the URL "
                                "without them", path=redact(url), field="remote")
    return url


def is_remote_failure(error: BaseException) -> bool:
    """An error of reaching the store (network, server, permissions), not of what it
    holds: the caller goes on without the remote."""
    if isinstance(error, RemoteUnavailable):
        return True
    if isinstance(error, SnapdError):
        return False
    module = type(error).__module__ or ""
    return isinstance(error, (OSError, ConnectionError, TimeoutError)) or \
        module.startswith(("botocore", "aiobotocore", "aiohttp", "s3fs"))


@contextmanager
def reaching(remote: RemoteRoot, what: str) -> Iterator[None]:
    """Errors of reaching the store inside, as RemoteUnavailable naming the URL."""
    try:
        yield
    except BaseException as e:
        if not is_remote_failure(e) or isinstance(e, RemoteUnavailable):
            raise
        raise RemoteUnavailable(f"remote {remote.url}: {what} failed: {e!r}; check the "
                                "URL, the network and the AWS variables (the remote is "
                                "left as it is)", path=remote.url, field="remote") from e


def check_before_download(remote: RemoteRoot, store: RunStore, name: str, keys: Any,
                          progress: Progress, deadline: Deadline,
                          min_free_bytes: Optional[int],
                          accept: Optional[Callable[[Dict[str, Any]], bool]] = None
                          ) -> Optional[Tuple[Dict[str, Any], List[SharedFile], int]]:
    """Steps 1-3, before a byte is downloaded: (the record, the shared files to bring
    down, the bytes needed). None when ``accept`` (given the record) declines it."""
    with reaching(remote, f"reading the record of {store.run}/{name}"):
        record = read_record(remote, store.run, name, keys)                # 1.
        if accept is not None and not accept(record):
            return None
        wanted = missing_shared(store, record, progress)
        check_listing(remote, store.run, name, record, wanted)             # 2.
    deadline.check(f"pulling {store.run}/{name}")
    store.ensure()
    need = int(record["bytes"]) + sum(s.size for s in wanted)
    min_free = Options().min_free_bytes if min_free_bytes is None else min_free_bytes
    diskguard.ensure_space(store.root, need, min_free)                     # 3.
    return record, wanted, need


def pull(remote: RemoteRoot, store: RunStore, name: str, *, threads: int = 4,
         progress: Progress = None, min_free_bytes: Optional[int] = None,
         deadline: Deadline = NO_DEADLINE, keys: Any = None) -> str:
    """Commit remote snapshot ``name`` of ``store.run`` locally (the module's steps);
    returns its local directory. One already committed locally is kept as it is.
    Past ``deadline`` (snapd/remote/deadline.py) nothing more is written or published.
    ``keys`` (snapd/signing.py): the record and the top file must be signed with an
    accepted key, else UntrustedSnapshot before a tensor file is downloaded."""
    sid = SnapshotId.parse(name)
    if sid is None:
        raise SnapdError(f"{name!r} is not a snapshot name (8+ digits, optionally "
                         "'.L<lineage>')", path=str(name), field="name")
    final = store.snapshot_path(sid)
    if os.path.isdir(final):
        log.info("run %r: %s is already committed locally; not pulled", store.run, name)
        return final
    record, wanted, need = check_before_download(remote, store, name, keys, progress,
                                                 deadline, min_free_bytes)
    tmp = store.new_tmp_dir(sid)
    try:
        download(remote, store.run, name, record, tmp, threads, progress,   # 4.
                 keys)
        brought = pull_shared(remote, store, wanted, threads, progress)
        with deadline.local_work():   # the local disk's time, not the store's
            verify_pulled(remote, store.run, sid, record, tmp, brought)    # 5.
            fsync_tree(tmp)                                                # 6.
        with deadline.publishing(f"committing {store.run}/{name} locally"):
            if not publish_pulled(store, tmp, sid):
                return final
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        space = enospc_of(e)   # the commit service's mapping, as for a local write
        if space is not None:
            raise diskguard.from_enospc(space, store.root, need) from e
        raise
    log.debug("run %r: pulled %s from %s (%d bytes)", store.run, name, remote.url, need)
    return final


def arrived(store: RunStore) -> int:
    """Bytes now in the tmp names pulls of ``store.run`` download into (a snapshot's
    tmp dir; a shared file's or a log segment's ``.pull-`` name): a caller waiting on
    a pull sees from it that bytes still come (snapd/remote/deadline.py)."""
    patterns = (os.path.join(store.snapshots_path, TMP_PREFIX + "*", "**"),
                os.path.join(store.path, sharing.SHARED_DIR, "*", ".pull-*"),
                os.path.join(store.log_path, "rank-*", ".pull-*"))
    total = 0
    for path in (p for pattern in patterns for p in glob.glob(pattern, recursive=True)):
        try:
            info = os.lstat(path)
        except FileNotFoundError:   # committed or removed since it was listed
            continue
        total += info.st_size if stat.S_ISREG(info.st_mode) else 0
    return total


def publish_pulled(store: RunStore, tmp: str, sid: SnapshotId) -> bool:
    """Step 6's commit; False when another pull (a second rank of this node) committed
    the same snapshot first: ours is dropped and theirs kept."""
    try:
        publish(store, tmp, sid)
        return True
    except OSError:
        # The rename failed (our tmp dir is still there) because the name is taken.
        if not (os.path.isdir(tmp) and os.path.isdir(store.snapshot_path(sid))):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        return False


def check_listing(remote: RemoteRoot, run: str, name: str, record: Dict[str, Any],
                  shared: Optional[List[SharedFile]] = None) -> None:
    """Step 2: what is under ``snapshots/<name>/`` has every file the record lists,
    and ``shared/`` the ``shared`` files (default: every one the record lists), at
    their sizes."""
    shared = record_shared(record) if shared is None else shared
    if shared:
        up = remote.shared_files(run)
        for s in shared:
            _check_size(remote.where(remote.shared_path(run, s.snapshot, s.file)),
                        up.get(s.key), s.size)
    found = remote.uploaded_files(run, name)
    for f in record_files(record):
        where = remote.where(remote.file_path(run, name, f.relpath))
        if f.relpath not in found:
            raise CorruptSnapshot(f"{where}: listed in the remote commit record but "
                                  "missing; the remote snapshot is damaged, use an older "
                                  "one", path=where, field="files")
        if found[f.relpath] != f.size:
            raise CorruptSnapshot(f"{where}: {found[f.relpath]} bytes, the remote commit "
                                  f"record says {f.size} (field files); the remote "
                                  "snapshot is damaged, use an older one", path=where,
                                  field="size")


def _check_size(where: str, found: Optional[int], size: int) -> None:
    if found is None:
        raise CorruptSnapshot(f"{where}: listed in the remote commit record (field "
                              "shared) but missing; the remote snapshot is damaged, use "
                              "an older one", path=where, field="shared")
    if found != size:
        raise CorruptSnapshot(f"{where}: {found} bytes, the remote commit record says "
                              f"{size} (field shared); the remote snapshot is damaged, "
                              "use an older one", path=where, field="size")


def missing_shared(store: RunStore, record: Dict[str, Any],
                   progress: Progress = None) -> List[SharedFile]:
    """The shared files the record lists that snapd/sharing.py does not find in the
    local run (in ``shared/`` or in their snapshot's directory); one found counts as
    moved for ``progress``."""
    wanted = []
    for s in record_shared(record):
        try:
            sharing.locate(store.path, s.snapshot, s.file, wanted_by=store.path)
            if progress is not None:
                progress(s.size)
        except CorruptSnapshot:
            wanted.append(s)
    return wanted


def pull_shared(remote: RemoteRoot, store: RunStore, wanted: List[SharedFile],
                threads: int, progress: Progress) -> Dict[str, str]:
    """Step 4's second half: each wanted shared file to ``<run>/shared/<S>/<file>``
    under a tmp name, size-checked, fsynced, then renamed. Returns local path ->
    remote name, for messages."""
    if not wanted:
        return {}
    dirs = [os.path.join(store.path, sharing.SHARED_DIR)]
    dirs += sorted({os.path.join(dirs[0], s.snapshot) for s in wanted})
    for d in dirs:
        try:
            os.mkdir(d, DIR_MODE)
            fsio.fsync_dir(os.path.dirname(d))
        except FileExistsError:   # an earlier pull, or retention keeping a file there
            pass
    final = [sharing.shared_path(store.path, s.snapshot, s.file) for s in wanted]
    pairs = [(remote.shared_path(store.run, s.snapshot, s.file),
              os.path.join(os.path.dirname(f), f".pull-{s.file}-{secrets.token_hex(4)}"))
             for s, f in zip(wanted, final)]
    try:
        with reaching(remote, f"downloading the shared files of {store.run}"):
            transfer.get_files(remote.fs, pairs, threads=threads,
                               sizes=[s.size for s in wanted], progress=progress,
                               where=remote.url)
        for s, (source, tmp), path in zip(wanted, pairs, final):
            _settle(tmp, s.size, remote.where(source))
            os.replace(tmp, path)
        for d in sorted({os.path.dirname(f) for f in final}):
            fsio.fsync_dir(d)
    finally:
        for _, tmp in pairs:
            if os.path.lexists(tmp):
                os.unlink(tmp)
    return {path: remote.where(source) for (source, _), path in zip(pairs, final)}


def _settle(tmp: str, size: int, where: str) -> None:
    """A downloaded shared file: owner-only, of the record's size, durable."""
    os.chmod(tmp, fsio.FILE_MODE)
    got = os.lstat(tmp).st_size
    if got != size:
        raise CorruptSnapshot(f"{where}: {got} bytes downloaded, the remote commit "
                              f"record says {size} (field shared); the remote snapshot "
                              "changed or is damaged, use an older one", path=where,
                              field="size")
    fd = os.open(tmp, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_record(remote: RemoteRoot, run: str, name: str, keys: Any) -> Dict[str, Any]:
    """The remote commit record, decoded; with ``keys``, its signature checked."""
    if keys is None:
        return remote.read_record(run, name)
    data = remote.record_bytes(run, name)
    where = remote.where(remote.record_path(run, name))
    record = decode_record(data, where=where, run=run, name=name)
    keys.check(data, path=where, what="remote commit record")
    return record


def download(remote: RemoteRoot, run: str, name: str, record: Dict[str, Any],
             tmp: str, threads: int, progress: Progress, keys: Any = None,
             files: Optional[List[RemoteFile]] = None) -> None:
    """Step 4: every file (or ``files``) into ``tmp``, owner-only, each size checked
    after; the top file, when among them, against the record's digests (and with
    ``keys``, its own signature)."""
    files = record_files(record) if files is None else files
    for sub in sorted({f.relpath.split("/")[0] for f in files if "/" in f.relpath}):
        os.makedirs(os.path.join(tmp, sub), DIR_MODE, exist_ok=True)
    pairs = [(remote.file_path(run, name, f.relpath),
              os.path.join(tmp, check_relpath(f.relpath, where=remote.url)))
             for f in files]
    with reaching(remote, f"downloading {run}/{name}"):
        transfer.get_files(remote.fs, pairs, threads=threads,
                           sizes=[f.size for f in files], progress=progress,
                           where=remote.url)
    for f, (source, local) in zip(files, pairs):
        os.chmod(local, fsio.FILE_MODE)
        size = os.lstat(local).st_size
        if size != f.size:
            where = remote.where(source)
            raise CorruptSnapshot(f"{where}: {size} bytes downloaded, the remote commit "
                                  f"record says {f.size}; the remote snapshot changed or "
                                  "is damaged, use an older one", path=where, field="size")
    if any(f.relpath == record["top"] for f in files):
        _check_top(remote, run, name, record, tmp, keys)


def _check_top(remote: RemoteRoot, run: str, name: str, record: Dict[str, Any],
               tmp: str, keys: Any) -> None:
    """The downloaded top file against the record's digests (and its signature)."""
    top = os.path.join(tmp, record["top"])
    with open(top, "rb") as handle:
        top_bytes = handle.read()
    where = remote.where(remote.file_path(run, name, record["top"]))
    if fmt.checksum(top_bytes) != record["top_xxh3"]:
        raise CorruptSnapshot(f"{where}: its xxh3 is not the remote commit record's "
                              "top_xxh3; the remote snapshot is damaged, use an older "
                              "one", path=where, field="top_xxh3")
    if "top_sha256" in record and fmt.sha256_of(top_bytes) != record["top_sha256"]:
        raise CorruptSnapshot(f"{where}: its SHA-256 is not the remote commit record's "
                              "top_sha256, though its xxh3 is: the file was replaced; "
                              "use an older snapshot", path=where, field="top_sha256")
    if keys is not None:
        keys.check(top_bytes, path=where, what=record["top"])


def verify_pulled(remote: RemoteRoot, run: str, sid: SnapshotId,
                  record: Dict[str, Any], tmp: str,
                  brought: Optional[Dict[str, str]] = None,
                  objects: Optional[List[str]] = None) -> None:
    """Step 5: every checksum, as ``snapd verify`` checks them (of ``objects`` only,
    when given, in every part: a snapshot whose other files are not downloaded yet);
    damage is named by the remote file it came from."""
    with named_remotely(remote, run, sid, tmp, brought):
        if record["world_size"] > 1 and objects is not None:
            snap = GlobalSnapshot(tmp, check_files=False)
            snap.check_references()
            for part in snap.parts():
                part.load_objects([n for n in objects if n in part.objects])
            found = snap.record
        elif record["world_size"] > 1:
            snap = GlobalSnapshot(tmp)
            snap.verify()
            found = snap.record
        elif objects is not None:
            reader = SnapshotReader(tmp, objects=objects)
            reader.load_objects(objects)
            found = reader.manifest
        else:
            reader = SnapshotReader(tmp)
            reader.verify()
            found = reader.manifest
        _check_identity(found, run, sid, record, os.path.join(tmp, record["top"]))


@contextmanager
def named_remotely(remote: RemoteRoot, run: str, sid: SnapshotId, tmp: str,
                   brought: Optional[Dict[str, str]] = None) -> Iterator[None]:
    """A CorruptSnapshot raised inside about a file in ``tmp`` (or a shared file this
    pull brought down) raised again naming the remote file it came from."""
    base = remote.where(remote.snapshot_path(run, sid.name))
    try:
        yield
    except CorruptSnapshot as e:
        if e.path in (brought or {}):   # a shared file this pull brought down
            where = (brought or {})[e.path]
            raise CorruptSnapshot(str(e).replace(e.path, where), path=where,
                                  field=e.field) from e
        where = _remote_name(e.path, tmp, base)
        raise CorruptSnapshot(str(e).replace(tmp, base), path=where,
                              field=e.field) from e


def _check_identity(found: Dict[str, Any], run: str, sid: SnapshotId,
                    record: Dict[str, Any], top: str) -> None:
    """The top file is of this run, step, lineage and world size: a record must not
    vouch for another snapshot's files."""
    lineage = found.get("lineage") or {}
    theirs = (found.get("run"), found.get("step"), lineage.get("id", 0),
              found.get("world_size", 1))
    want = (run, sid.step, sid.lineage, record["world_size"])
    for field, a, b in zip(("run", "step", "lineage", "world_size"), theirs, want):
        if a != b:
            raise CorruptSnapshot(f"{top}: field {field} is {a!r}, but the snapshot is "
                                  f"filed as {b!r}; the remote snapshot was moved or is "
                                  "hostile, use an older one", path=top, field=field)


def _remote_name(path: Optional[str], tmp: str, base: str) -> str:
    if path and (path == tmp or path.startswith(tmp + os.sep)):
        return base + path[len(tmp):]
    return base


def fsync_tree(tmp: str) -> None:
    """Step 6's first half: each file's bytes and each directory's entries durable
    before the rename publishes them."""
    for directory, _, names in os.walk(tmp, topdown=False):
        for n in names:
            fd = os.open(os.path.join(directory, n), os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsio.fsync_dir(directory)

