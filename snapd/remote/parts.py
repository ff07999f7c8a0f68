"""Node-local roots: each rank's part goes up, and the global commit happens remotely.

With one root per node, no node ever holds every part of a multi-rank snapshot, so
the local global commit (snapd/globalcommit.py) never completes there. The daemon of
each node uploads the parts its ranks wrote instead, and the commit is made in the
remote root, by the same checks and the same record as the local one
(docs/remote.md, "Many nodes"):

1. :func:`upload_part`: rank R's files to ``snapshots/<name>/rank-R/`` (its manifest
   last), then ``parts/<name>/rank-R.snapd``: the *part record* (the shared fields
   of the part's manifest, the manifest's size and xxh3, the files). The part record
   says "this part is up"; the old one is removed before a part is uploaded again.
2. :func:`try_remote_commit`, by whoever uploaded a part: when every rank's part
   record is there and agrees (globalcommit.SHARED_FIELDS), each uploaded manifest
   is the one its record names, every listed file is up at its size and every
   ``ref`` resolves, it writes ``snapshots/<name>/commit.snapd`` and then the remote
   commit record, listing every part's files. Both are built only from the parts,
   so two daemons that commit at once write the same bytes. With a signing key
   (snapd/signing.py) both are signed, and a part's manifest joins only when an
   accepted key signed it: the record pins every part's manifest by its SHA-256, so
   signing a record over a part nobody with the key wrote would vouch for a forgery.
3. :func:`note_remote_commit`, the daemon on seeing the record: the marker
   ``<run>/snapshots/.remote-<name>`` in its local root, which the client's
   committed check accepts (snapd_client/snapshot_outcomes.py), since no local directory
   ``<name>`` will ever appear there. Never a directory, never a snapshot name.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Dict, List, Optional, Tuple, Union

from snapd import format as fmt
from snapd import fsio
from snapd.errors import CorruptSnapshot, UntrustedSnapshot
from snapd.globalcommit import (SHARED_FIELDS, check_references, commit_record,
                                read_part)
from snapd.remote import layout
from snapd.remote.layout import RECORD_SUFFIX, RemoteFile, RemoteRoot
from snapd.remote.transfer import Progress, put_files
from snapd.signing import Keys
from snapd.store import RunStore, SnapshotId

log = logging.getLogger(__name__)

MARKER_PREFIX = ".remote-"
# Markers kept in a local root: a client looks only for the parts it has pending, and
# the uploader keeps one pending part per run, so older markers are never looked for.
KEEP_MARKERS = 8
PART_FIELDS = SHARED_FIELDS + ("rank", "manifest_size", "manifest_xxh3", "files")

# A part as the remote holds it: its manifest, the manifest's bytes, its part record.
Found = Tuple[Dict[str, Any], bytes, Dict[str, Any]]


def _root(remote: Union[str, RemoteRoot]) -> RemoteRoot:
    return remote if isinstance(remote, RemoteRoot) else RemoteRoot(remote)


def _sid(name: str) -> SnapshotId:
    sid = SnapshotId.parse(name)
    if sid is None:
        raise CorruptSnapshot(f"{name!r} is not a snapshot name (8+ digits, optionally "
                              "'.L<lineage>')", path=str(name), field="name")
    return sid


def part_record_path(remote: RemoteRoot, run: str, name: str, rank: int) -> str:
    return f"{remote.parts_path(run, name)}/{fmt.part_dir_name(rank)}{RECORD_SUFFIX}"


def local_part_dir(store: RunStore, name: str, rank: int) -> Optional[str]:
    """Rank ``rank``'s durable part of ``name`` on this root: in the parts dir, or in
    the snapshot committed locally (then the uploader uploads the snapshot itself)."""
    sid = _sid(name)
    for base in (store.parts_path(sid), store.snapshot_path(sid)):
        path = os.path.join(base, fmt.part_dir_name(rank))
        if os.path.isfile(os.path.join(path, fmt.MANIFEST_NAME)):
            return path
    return None


# --- 1. a part up ----------------------------------------------------------------------

def upload_part(remote: Union[str, RemoteRoot], store: RunStore, name: str, rank: int, *,
                threads: int = 4, progress: Progress = None) -> Optional[Dict[str, Any]]:
    """Upload rank ``rank``'s part of snapshot ``name`` and announce it; returns its
    part record, or None when the snapshot is already committed remotely (its files
    are never touched then). Raises CorruptSnapshot when the local part is absent or
    damaged, RemoteUnavailable when the remote fails (the whole call is repeatable)."""
    remote = _root(remote)
    run = store.run
    if remote.fs.exists(remote.record_path(run, name)):
        return None
    part_dir = local_part_dir(store, name, rank)
    if part_dir is None:
        where = os.path.join(store.parts_path(_sid(name)), fmt.part_dir_name(rank))
        raise CorruptSnapshot(f"{where}: no durable part of rank {rank} to upload",
                              path=where, field="parts")
    manifest, data = read_part(part_dir)
    part = _part_record(manifest, data, part_dir, rank)
    record_path = part_record_path(remote, run, name, rank)
    if _already_up(remote, run, name, part, data):
        return part
    # Un-announce before the files change: a committer never joins a part whose
    # files are being replaced (another session's upload of the same rank).
    if remote.fs.exists(record_path):
        remote.fs.rm_file(record_path)
    _put_part_files(remote, run, name, part_dir, part, data, threads, progress)
    remote.fs.pipe_file(record_path, layout.encode_part(part))
    log.info("run %r: rank %d's part of %s uploaded to %s", run, rank, name, remote.url)
    return part


def _part_record(manifest: Dict[str, Any], data: bytes, part_dir: str,
                 rank: int) -> Dict[str, Any]:
    rank_dir = fmt.part_dir_name(rank)
    files = []
    for fname in sorted(manifest["files"]) + [fmt.MANIFEST_NAME]:
        size = os.path.getsize(os.path.join(part_dir, fname))
        files.append([layout.check_relpath(f"{rank_dir}/{fname}", where=part_dir), size])
    if manifest.get("rank") != rank:
        where = os.path.join(part_dir, fmt.MANIFEST_NAME)
        raise CorruptSnapshot(f"{where}: field rank is {manifest.get('rank')!r}, in the "
                              f"part dir of rank {rank}", path=where, field="rank")
    return {**{k: manifest.get(k) for k in SHARED_FIELDS}, "rank": rank,
            "name": SnapshotId(manifest["lineage"].get("id", 0), manifest["step"]).name,
            "manifest_size": len(data), "manifest_xxh3": fmt.checksum(data),
            "files": files, "uploaded_at": time.time()}


def _already_up(remote: RemoteRoot, run: str, name: str, part: Dict[str, Any],
                data: bytes) -> bool:
    """The same part already announced, and its manifest up as announced: nothing
    to do (a retry after the announcement; a manifest damaged since is re-sent)."""
    record_path = part_record_path(remote, run, name, part["rank"])
    try:
        found = layout.decode_part(remote.read_small(record_path), where=record_path)
    except CorruptSnapshot:
        return False
    manifest = remote.file_path(run, name, f"{fmt.part_dir_name(part['rank'])}/"
                                           f"{fmt.MANIFEST_NAME}")
    same = (found.get("manifest_size"), found.get("manifest_xxh3")) == \
        (part["manifest_size"], part["manifest_xxh3"])
    return same and _same_bytes(remote, manifest, data)


def _put_part_files(remote: RemoteRoot, run: str, name: str, part_dir: str,
                    part: Dict[str, Any], data: bytes, threads: int,
                    progress: Progress) -> None:
    """The tensor files, then the manifest (so a manifest up means its files are up,
    as on disk): an interrupted upload of this same part skips straight to it."""
    rank_dir = os.path.basename(part_dir)
    manifest_rel = f"{rank_dir}/{fmt.MANIFEST_NAME}"
    remote_manifest = remote.file_path(run, name, manifest_rel)
    tensors = [(rel, size) for rel, size in part["files"] if rel != manifest_rel]
    if not _same_bytes(remote, remote_manifest, data):
        put_files(remote.fs, [(os.path.join(part_dir, rel.split("/", 1)[1]),
                               remote.file_path(run, name, rel)) for rel, _ in tensors],
                  threads=threads, sizes=[s for _, s in tensors], progress=progress,
                  where=remote.url)
    remote.fs.pipe_file(remote_manifest, data)


def _same_bytes(remote: RemoteRoot, path: str, data: bytes) -> bool:
    try:
        return remote.fs.size(path) == len(data) and remote.fs.cat_file(path) == data
    except FileNotFoundError:
        return False


# --- 2. the global commit, remotely ------------------------------------------------------

def try_remote_commit(remote: Union[str, RemoteRoot], store: RunStore, name: str,
                      keys: Optional[Keys] = None) -> bool:
    """Commit snapshot ``name`` remotely if every rank's part is up and agrees.

    The shared fields are this root's part's (any rank's, as the local commit takes
    the part just written). ``keys``: the daemon's signing keys; with them, only
    parts whose manifest an accepted key signed are joined, ``commit.snapd`` and the
    record are signed, and a record no accepted key signed counts as not committed
    (it is written again, signed, once the parts are complete). True when the remote
    record exists (written now, or by another committer), False while parts are
    missing or disagree. Raises DanglingReference when the parts are complete but a
    ``ref`` does not resolve (nothing is committed then), RemoteUnavailable when the
    remote fails."""
    remote = _root(remote)
    run, sid = store.run, _sid(name)
    if _committed(remote, run, name, keys):
        return True
    want = _local_fields(store, sid)
    if want is None:
        return False
    parts = _complete_parts(remote, run, name, want, keys)
    if parts is None:
        return False
    check_references({r: m for r, (m, _, _) in parts.items()},
                     remote.where(remote.parts_path(run, name)))
    _write_commit(remote, run, sid, parts, keys)
    log.info("run %r: %s committed globally in %s (%d ranks)", run, name, remote.url,
             want["world_size"])
    return True


def _committed(remote: RemoteRoot, run: str, name: str, keys: Optional[Keys]) -> bool:
    where = remote.where(remote.record_path(run, name))
    try:
        data = remote.record_bytes(run, name)
        layout.decode_record(data, where=where, run=run, name=name)
        if keys is not None:   # one this daemon's clients would refuse is no commit
            keys.check(data, what="remote commit record", path=where)
        return True
    except UntrustedSnapshot as e:
        log.warning("run %r: %s: the remote commit record is not one to trust, it is "
                    "written again, signed, once every part is up: %s", run, name, e)
        return False
    except CorruptSnapshot:   # absent, or a damaged record: committed again below
        return False


def _local_fields(store: RunStore, sid: SnapshotId) -> Optional[Dict[str, Any]]:
    """The shared fields of a part of ``sid`` on this root (None: there is none)."""
    parts_dir = store.parts_path(sid)
    names = sorted(os.listdir(parts_dir)) if os.path.isdir(parts_dir) else []
    for entry in names:
        if entry.startswith("rank-"):
            try:
                manifest, _ = read_part(os.path.join(parts_dir, entry))
            except (CorruptSnapshot, OSError):
                continue
            return {k: manifest.get(k) for k in SHARED_FIELDS}
    return None


def _complete_parts(remote: RemoteRoot, run: str, name: str, want: Dict[str, Any],
                    keys: Optional[Keys]) -> Optional[Dict[int, Found]]:
    """Every rank's (manifest, bytes, part record), checked; None when any is missing,
    of another attempt, not fully up, or (with ``keys``) not signed by an accepted key."""
    uploaded = remote.uploaded_files(run, name)
    found = {}
    for rank in range(want["world_size"]):
        got = _one_part(remote, run, name, rank, want, uploaded, keys)
        if got is None:
            return None
        found[rank] = got
    return found


def _one_part(remote: RemoteRoot, run: str, name: str, rank: int, want: Dict[str, Any],
              uploaded: Dict[str, int], keys: Optional[Keys]) -> Optional[Found]:
    path = part_record_path(remote, run, name, rank)
    where = remote.where(path)
    try:
        part = layout.decode_part(remote.read_small(path), where=where)
    except CorruptSnapshot as e:
        log.debug("run %r: %s: rank %d's part is not up: %s", run, name, rank, e)
        return None
    if any(part.get(k) != want.get(k) for k in SHARED_FIELDS) or part.get("rank") != rank:
        return None   # another attempt's part (a session, a world size): never joined
    files = _part_files(part, rank, where)
    if any(uploaded.get(rel) != size for rel, size in files):
        return None   # announced, but its files are not (all) there: not joined
    manifest_rel = f"{fmt.part_dir_name(rank)}/{fmt.MANIFEST_NAME}"
    data = remote.read_small(remote.file_path(run, name, manifest_rel))
    if (len(data), fmt.checksum(data)) != (part.get("manifest_size"),
                                           part.get("manifest_xxh3")):
        return None   # replaced since it was announced: its uploader announces again
    manifest_where = remote.where(remote.file_path(run, name, manifest_rel))
    manifest = fmt.decode_manifest(data, path=manifest_where)
    if any(manifest.get(k) != want.get(k) for k in SHARED_FIELDS) or \
            manifest.get("rank") != rank:
        return None
    if keys is not None:
        try:
            keys.check(data, path=manifest_where, what=f"manifest of rank {rank}'s part")
        except UntrustedSnapshot as e:   # never joined; its uploader may send it again
            _warn_once(f"run {run!r}: {name}: rank {rank}'s part is not joined: {e}")
            return None
    return manifest, data, part


# The committer polls every part until the snapshot commits: an unsigned part would
# be warned of at every poll. Once per distinct sentence is enough; later ones go to
# debug. Bounded: a long-lived daemon forgets the oldest half.
_WARNED: Dict[str, None] = {}
_WARNED_MAX = 1024


def _warn_once(sentence: str) -> None:
    if sentence in _WARNED:
        log.debug(sentence)
        return
    if len(_WARNED) >= _WARNED_MAX:
        for old in list(_WARNED)[:_WARNED_MAX // 2]:
            del _WARNED[old]
    _WARNED[sentence] = None
    log.warning(sentence)


def _part_files(part: Dict[str, Any], rank: int, where: str) -> List[Tuple[str, int]]:
    files = part.get("files")
    fmt.need(isinstance(files, list) and bool(files), where, "files",
             "is not a list of [path, size]")
    out = []
    for i, entry in enumerate(files):
        fmt.need(isinstance(entry, list) and len(entry) == 2 and fmt.is_uint(entry[1]),
                 where, f"files[{i}]", "is not [path, size]")
        rel = layout.check_relpath(entry[0], where=where)
        fmt.need(rel.startswith(fmt.part_dir_name(rank) + "/"), where, f"files[{i}]",
                 f"is not a file of rank {rank}'s part")
        out.append((rel, entry[1]))
    return out


def _write_commit(remote: RemoteRoot, run: str, sid: SnapshotId,
                  parts: Dict[int, Found], keys: Optional[Keys]) -> None:
    """``commit.snapd``, then the remote commit record, each signed with ``keys``'
    signing key when given; every value comes from the parts (the times too), and an
    HMAC depends on its key and bytes only, so a second committer with the same key
    writes the same bytes."""
    created = max(float(m.get("created") or 0.0) for m, _, _ in parts.values())
    top = fmt.encode_commit(commit_record({r: (m, d) for r, (m, d, _) in parts.items()},
                                          created=created), keys)
    remote.fs.pipe_file(remote.file_path(run, sid.name, fmt.COMMIT_NAME), top)
    files = [RemoteFile(fmt.COMMIT_NAME, len(top))] + [
        RemoteFile(rel, size) for _, _, p in parts.values() for rel, size in p["files"]]
    record = layout.make_record(run, sid, len(parts), files, top)
    record["uploaded_at"] = max(float(p.get("uploaded_at") or 0.0)
                                for _, _, p in parts.values())
    remote.write_record(run, sid.name, record, keys)


# --- 3. the local root learns of it ------------------------------------------------------

def marker_path(store: RunStore, name: str) -> str:
    return os.path.join(store.snapshots_path, f"{MARKER_PREFIX}{_sid(name).name}")


def remote_committed(store: RunStore, sid: SnapshotId) -> bool:
    """Whether this root's daemon saw ``sid`` committed remotely (its marker)."""
    return os.path.isfile(os.path.join(store.snapshots_path, f"{MARKER_PREFIX}{sid.name}"))


def note_remote_commit(store: RunStore, name: str) -> None:
    """The daemon saw snapshot ``name`` committed remotely: the marker for the
    client's committed check; older parts dirs (they can never complete locally, and
    are up or superseded) and all but the newest markers removed."""
    sid = _sid(name)
    store.ensure()
    fsio.replace_file_atomic(marker_path(store, name), f"{name}\n".encode())
    from snapd.retention import collect_parts, purge   # retention imports much
    _, trash = collect_parts(store, sid)
    purge(trash)
    for old in markers(store)[:-KEEP_MARKERS]:
        try:
            os.unlink(marker_path(store, old.name))
        except FileNotFoundError:
            pass


def markers(store: RunStore) -> List[SnapshotId]:
    """The snapshots this root holds a remote-commit marker of, oldest first."""
    try:
        names = os.listdir(store.snapshots_path)
    except FileNotFoundError:
        return []
    found = [SnapshotId.parse(n[len(MARKER_PREFIX):]) for n in names
             if n.startswith(MARKER_PREFIX)]
    return sorted(sid for sid in found if sid is not None)


def settle_part(remote: Union[str, RemoteRoot], store: RunStore, name: str,
                keys: Optional[Keys] = None) -> bool:
    """Commit remotely if possible and, committed (now or by another node), note it.
    What the uploader runs after :func:`upload_part`, and again while it waits for
    another node's parts (a cheap look at the record once committed). ``keys``: see
    :func:`try_remote_commit`."""
    done = try_remote_commit(remote, store, name, keys)
    if done:
        note_remote_commit(store, name)
    return done
