"""One snapshot, from tensor bytes in memory to a committed directory on disk.

Steps 1-2 of the commit order are written here (tensor files, then the manifest,
into a private directory); steps 3-4 (the rename that commits, LATEST) are the
commit service's :func:`snapd.commit.publish`, shared with the global commit and
pulls. :func:`write_snapshot` is what every path that saves a snapshot calls. The
tensor bytes arrive as buffers (a staging arena, or CPU tensors in the synchronous
path); they go to the file without a Python-level copy unless compressed, by direct
I/O where the buffer and the filesystem allow (``snapd/blockfile.py``).
"""

from __future__ import annotations

import os
import secrets
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, Optional, Tuple

import xxhash

from snapd import format as fmt
from snapd import fsio, globalcommit, sharing, signing
from snapd.blockfile import BlockFile
# CommitResult is the commit service's; writers and their callers meet it here too.
from snapd.commit import CommitResult, Progress, move_latest, publish, uncommit
from snapd.compression import CompressionPolicy
from snapd.errors import CorruptSnapshot, SnapdError, SnapshotExists
from snapd.options import Options
from snapd.plan import ObjectPlan, SnapshotPlan, TensorSource
from snapd.cpulanes import Lanes, shared as shared_lanes
from snapd.shapipe import Sha256Pipe
from snapd.reader import SnapshotReader, read_commit
from snapd.store import DAMAGED_PREFIX, TMP_PREFIX, RunStore


def _write_object_file(directory: str, obj: ObjectPlan, opts: Options,
                       progress: Progress = None,
                       resolver: Optional[sharing.Resolver] = None) -> Dict[str, Any]:
    """Write one object's tensors as chunks; returns its manifest entries.

    A tensor whose bytes a committed snapshot of the run already holds (the client
    says it is unchanged since then, or its chunks' identities match) is not
    written: its entry keeps ``src_at``, the file it reads (snapd/sharing.py), which
    :func:`_manifest` turns into a ``shared`` index. The file is removed when no
    tensor of the object is written to it.

    With ``opts.sha256`` the file's SHA-256 is taken as its bytes pass, in file order
    (header, each chunk, the zeros after each), never by reading the file back, on a
    thread beside the writes (snapd/shapipe.py).

    What needs a CPU (chunks encoded and digested, frozen chunks identified, the
    SHA-256) holds one of the process's CPU lanes while it runs, and none while the
    disk writes (snapd/cpulanes.py)."""
    name = f"{obj.name}{fmt.TENSOR_FILE_SUFFIX}"
    policy = CompressionPolicy(opts.compression)
    file_digest = fmt.FileDigest(fmt.FORMAT_VERSION)
    lanes = shared_lanes()
    sha = Sha256Pipe(lanes) if opts.sha256 else None
    entries, own = [], 0
    out = BlockFile(os.path.join(directory, name))
    try:
        header = fmt.tensor_file_header()
        out.append(header)
        file_digest.header(header)
        _sha_update(sha, header, out.end - len(header))
        for t in obj.tensors:
            if not t.stored:   # replicated, written by another rank: no bytes here
                entries.append(_entry(t, [], 0))
                continue
            with lanes:
                found = _committed_bytes(obj.name, t, opts, resolver)
            if isinstance(found, tuple):
                where, entry = found
                entries.append({**_entry(t, entry["chunks"], entry["xxh3"]), "src_at": where})
                continue
            own += 1
            entries.append(_write_tensor(out, t, found, policy, opts, file_digest, progress,
                                         lanes, sha))
        out.sync()
    except BaseException:
        if sha is not None:
            sha.close()
        raise
    finally:
        out.close()
    if not own:   # every tensor is elsewhere: no file of its own
        if sha is not None:
            sha.close()
        os.unlink(os.path.join(directory, name))
        return {"file": None, "tensors": entries, "size": 0, "xxh3": 0}
    return {"file": name, "tensors": entries, "size": out.end,
            "xxh3": file_digest.intdigest(),
            **({"sha256": sha.digest()} if sha is not None else {})}


_ZEROS = bytes(fmt.CHUNK_ALIGN)


def _sha_update(sha: Optional[Sha256Pipe], data, pad: int) -> None:
    """Feed the file's SHA-256 ``data`` and the ``pad`` zeros BlockFile wrote after
    it (the bytes of the file, in its order)."""
    if sha is None:
        return
    sha.update(data)
    if pad:
        sha.update(memoryview(_ZEROS)[:pad])


def _committed_bytes(obj: str, t: TensorSource, opts: Options,
                     resolver: Optional[sharing.Resolver]):
    """Where a committed snapshot holds ``t``'s bytes, as (shared entry, tensor
    entry); else the identities of its chunks for the entries written (None each for
    a tensor that trains: its bytes change at every step, so hashing them once more
    would only slow every snapshot)."""
    if t.reuse is not None:
        if resolver is None:
            raise CorruptSnapshot(f"tensor {t.path!r} of {obj!r} refers to snapshot "
                                  f"{t.reuse}, but a part of a multi-rank snapshot "
                                  "cannot share bytes", field="reuse")
        return resolver.reused(obj, t.path, t.dtype, t.shape, t.reuse)
    starts = range(0, len(t.data), opts.chunk_bytes)
    if not t.frozen:
        return [(None, 0)] * len(starts)
    ids = [(fmt.chunk_id(t.data[start:start + opts.chunk_bytes]),
            min(opts.chunk_bytes, len(t.data) - start)) for start in starts]
    if resolver is not None and ids:
        found = resolver.same_bytes(t.dtype, t.shape, ids)
        if found is not None:
            return found
    return ids


def _write_tensor(out: BlockFile, t: TensorSource, ids: list, policy: CompressionPolicy,
                  opts: Options, file_digest: fmt.FileDigest,
                  progress: Progress, lanes: Lanes,
                  sha: Optional[Sha256Pipe] = None) -> Dict[str, Any]:
    """One tensor's chunks appended to the object's file; returns its entry. ``sha``:
    the file's SHA-256, fed each chunk's stored bytes and the zeros after it.
    ``lanes``: held while a chunk is encoded and digested, not while it is written."""
    with lanes:   # a chunk compressed as a sample, when compression is "auto"
        level = policy.level_for(t.data, opts.chunk_bytes)
    chunks, raw_digest = [], xxhash.xxh3_64()
    for (chunk_id, _), start in zip(ids, range(0, len(t.data), opts.chunk_bytes)):
        raw = t.data[start:start + opts.chunk_bytes]
        with lanes:
            stored, codec = fmt.encode_chunk(raw, level)
            if codec == fmt.CODEC_RAW:
                digest = _raw_chunk_digest(raw, raw_digest)
            else:
                digest = fmt.checksum(stored)
                raw_digest.update(raw)  # just compressed: still in cache
        offset = out.append(stored)
        _sha_update(sha, stored, out.end - offset - len(stored))
        file_digest.chunk(stored, digest)
        chunks.append([offset, len(stored), len(raw), codec, digest] +
                      ([chunk_id] if chunk_id is not None else []))
        if progress is not None:
            progress(len(raw))
    return _entry(t, chunks, raw_digest.intdigest())


HASH_PIECE = 256 << 10   # hashed for both digests while in a core's L2


def _raw_chunk_digest(raw: memoryview, raw_digest: Any) -> int:
    """A raw chunk's digest, feeding the tensor's raw digest the same bytes, piece by
    piece: one pass over memory for the two. Two passes over the whole chunk cost
    180 ms per GiB here, this 135 ms: the daemon's write competes with the trainer's
    memory-bound optimizer step for the same memory."""
    chunk = xxhash.xxh3_64()
    for at in range(0, len(raw), HASH_PIECE):
        piece = raw[at:at + HASH_PIECE]
        chunk.update(piece)
        raw_digest.update(piece)
    return chunk.intdigest()


def _entry(t: TensorSource, chunks: list, digest: int) -> Dict[str, Any]:
    """A tensor's manifest entry (a ``ref`` one has no chunks and digest 0)."""
    return {"path": t.path, "dtype": t.dtype, "shape": list(t.shape), "nbytes": t.nbytes,
            "device": t.device, "chunks": chunks, "xxh3": digest, **t.placement()}


def _manifest(plan: SnapshotPlan, written: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    objects, files = {}, {}
    shared: list = []
    for obj in plan.objects:
        entry = written.get(obj.name)
        if entry is not None:
            if entry["file"] is not None:
                files[entry["file"]] = {"size": entry["size"], "xxh3": entry["xxh3"],
                                        **({"sha256": entry["sha256"]}
                                           if "sha256" in entry else {})}
            entry["tensors"] = [_shared_index(t, shared) for t in entry["tensors"]]
        objects[obj.name] = {"type": obj.type, "skeleton": obj.skeleton,
                             "metadata": obj.metadata,
                             "file": entry["file"] if entry else None,
                             "tensors": entry["tensors"] if entry else
                             [_entry(t, [], 0) for t in obj.tensors]}
    return {"format": fmt.FORMAT_VERSION, "run": plan.run, "step": plan.step,
            "rank": plan.rank, "world_size": plan.world_size, "session": plan.session,
            "created": time.time(),
            "data_version": plan.data_version, "metric": plan.metric,
            "lineage": plan.lineage, "rng": plan.rng, "cursor": plan.cursor,
            "objects": objects, "files": files, "shared": shared, "base": plan.base}


def _shared_index(entry: Dict[str, Any], shared: list) -> Dict[str, Any]:
    """An entry's ``src_at`` (the file it reads) as ``src``, an index into ``shared``."""
    where = entry.pop("src_at", None)
    if where is None:
        return entry
    if where not in shared:
        shared.append(where)
    return {**entry, "src": shared.index(where)}


def _same_snapshot_committed(store: RunStore, plan: SnapshotPlan, final: str,
                             t0: float, opts: Options) -> Optional[CommitResult]:
    """A snapshot of this step and lineage is already committed at ``final``.

    That happens when a trainer resumes below a step whose write finished after it
    died (or after the restore chose), recomputes it and snapshots it again. The
    existing snapshot is kept and reported as this commit, not replaced: it is
    durable, the log's committed record may name it, a replay-exact resume computes
    the same bytes, and a directory cannot be replaced atomically (there would be a
    window with no snapshot of this step). LATEST moves to it by the rule of a write
    (:func:`snapd.commit.move_latest`).

    Returns None when the directory is damaged (its manifest or a file's size does
    not check): the caller sets it aside and writes anew. Another lineage under the
    same name (a different warm-start parent), or another rank's, is refused.
    """
    try:
        reader = SnapshotReader(final)
    except (SnapdError, OSError):
        return None
    manifest = reader.manifest
    theirs = (manifest.get("step"), manifest.get("lineage"), manifest.get("rank"))
    if theirs != (plan.step, plan.lineage, plan.rank):
        field = next(name for name, a, b in zip(("step", "lineage", "rank"), theirs,
                                                 (plan.step, plan.lineage, plan.rank))
                     if a != b)
        raise SnapshotExists(
            f"{final} already exists with fields step, lineage, rank = {theirs!r}, not "
            f"this snapshot's {(plan.step, plan.lineage, plan.rank)!r}: a snapshot of "
            f"another history holds the name. Move it out of "
            f"{store.snapshots_path} to keep it, or snapshot under another run name",
            path=os.path.join(final, fmt.MANIFEST_NAME), field=field)
    move_latest(store, plan.sid, plan.supersedes)
    size = sum(int(f.get("size", 0)) for f in manifest.get("files", {}).values())
    return CommitResult(plan.sid, final, size, time.perf_counter() - t0,
                        manifest_sha256=reader.manifest_sha256 if opts.sha256 else None)


def write_snapshot(store: RunStore, plan: SnapshotPlan, opts: Options,
                   progress: Progress = None) -> CommitResult:
    """Write and commit one snapshot. On any failure nothing is published.

    ``progress(n)`` is called (from writer threads) as each chunk's ``n`` raw bytes
    reach the file: what a progress bar shows against ``plan.nbytes``.

    A failure leaves at most a ``.tmp-*`` directory, which no reader lists and the
    next collection removes; LATEST still names the previous committed snapshot.
    A plan of a multi-rank job (``world_size > 1``) is one rank's part: see
    :func:`write_part`.
    """
    if plan.world_size > 1:
        return write_part(store, plan, opts, progress)
    t0 = time.perf_counter()
    final = store.snapshot_path(plan.sid)
    if os.path.exists(final):
        if plan.sid.name not in plan.supersedes:
            existing = _same_snapshot_committed(store, plan, final, t0, opts)
            if existing is not None:
                return existing
        # Refused as damaged (at restore, or just now): set aside, kept.
        uncommit(store, plan.sid, DAMAGED_PREFIX)
    tmp = store.new_tmp_dir(plan.sid)
    total, manifest_sha = _write_directory(tmp, plan, opts, progress,
                                           sharing.Resolver(store, avoid=plan.supersedes)
                                           if opts.share_unchanged else None)
    # 3-4. The rename that commits, then LATEST: the commit service's, written once.
    publish(store, tmp, plan.sid, superseded=plan.supersedes)
    return CommitResult(plan.sid, final, total, time.perf_counter() - t0,
                        manifest_sha256=manifest_sha)


def _write_directory(tmp: str, plan: SnapshotPlan, opts: Options, progress: Progress,
                     resolver: Optional[sharing.Resolver] = None
                     ) -> Tuple[int, Optional[str]]:
    """Steps 1-2 of the commit order into ``tmp``, and its entries fsynced; returns
    the bytes of its tensor files and the manifest's SHA-256 (hex; None with
    ``opts.sha256`` off), which the state log records. ``resolver``: committed bytes
    of the run that this snapshot may refer to (one rank only; parts never share)."""
    # 1. Tensor files into the private tmp dir, each fsynced before the manifest.
    with_tensors = [o for o in plan.objects if any(t.stored for t in o.tensors)]
    workers = max(1, min(opts.writer_threads, len(with_tensors)))
    if resolver is not None:
        resolver.prepare()
    with ThreadPoolExecutor(workers) as pool:
        results = list(pool.map(lambda o: _write_object_file(tmp, o, opts, progress,
                                                             resolver), with_tensors))
    written = {o.name: r for o, r in zip(with_tensors, results)}
    # 2. The manifest last: its presence means every file it lists is durable.
    # Signed when this process has a signing key (snapd/signing.py).
    manifest = fmt.encode_manifest(_manifest(plan, written),
                                   signing.load_keys(opts.signing_key_file))
    fsio.write_file_durable(os.path.join(tmp, fmt.MANIFEST_NAME), manifest)
    fsio.fsync_dir(tmp)
    return (sum(r["size"] for r in results),
            fmt.sha256_of(manifest).hex() if opts.sha256 else None)


def write_part(store: RunStore, plan: SnapshotPlan, opts: Options,
               progress: Progress = None) -> CommitResult:
    """One rank's part of a multi-rank snapshot, then the global commit attempt.

    The part is written like a snapshot into ``.parts-<name>/.tmp-rank-R-<nonce>/``
    and renamed to ``rank-R``; then :func:`snapd.globalcommit.try_commit` commits the
    snapshot if this part completed the set (docs/multirank.md, steps 1-4). The
    result's ``complete`` says whether the snapshot is committed.
    """
    t0 = time.perf_counter()
    sid, final = plan.sid, store.snapshot_path(plan.sid)
    if os.path.exists(final):
        existing = _global_committed(store, plan, final, t0)
        if existing is not None:
            return existing
    parts_dir = store.parts_path(sid)
    store.ensure()
    os.makedirs(parts_dir, mode=0o700, exist_ok=True)
    mine = os.path.join(parts_dir, fmt.part_dir_name(plan.rank))
    total = _reusable_part(store, plan, mine)
    if total is None:
        tmp = os.path.join(parts_dir, f"{TMP_PREFIX}{fmt.part_dir_name(plan.rank)}-"
                                      f"{secrets.token_hex(4)}")
        os.mkdir(tmp, 0o700)
        try:
            total, _ = _write_directory(tmp, plan, opts, progress)
            os.rename(tmp, mine)   # step 1's rename
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _fsync_parts_dir(parts_dir, final)
    want = {"run": plan.run, "step": plan.step, "lineage": plan.lineage,
            "world_size": plan.world_size, "session": plan.session,
            "data_version": plan.data_version}
    complete = globalcommit.try_commit(store, sid, want, superseded=plan.supersedes,
                                       signer=signing.load_keys(opts.signing_key_file))
    return CommitResult(sid, final, total, time.perf_counter() - t0, complete=complete)


def _fsync_parts_dir(parts_dir: str, final: str) -> None:
    """Step 1's rename made durable. Between the rename and this fsync another rank's
    writer may have found the set complete and committed it: the parts dir is then
    the committed snapshot, and that commit fsynced it after it saw this part (its
    record's fsync), so this part's rename is durable already; the commit reads as
    one (try_commit finds it committed)."""
    try:
        fsio.fsync_dir(parts_dir)
    except FileNotFoundError:
        if not os.path.isdir(final):
            raise


def _reusable_part(store: RunStore, plan: SnapshotPlan, part: str) -> Optional[int]:
    """A part of this rank already at ``part``: kept when it is this session's (a
    retry of the same submit), its bytes returned; else moved out and removed (an
    older attempt's, or damaged). None: write the part."""
    if not os.path.lexists(part):
        return None
    try:
        manifest, _ = globalcommit.read_part(part)
        if manifest.get("session") == plan.session and manifest.get("rank") == plan.rank:
            return sum(f["size"] for f in manifest["files"].values())
    except (SnapdError, OSError):
        pass
    store.discard(part, "old-part")
    return None


def _global_committed(store: RunStore, plan: SnapshotPlan, final: str,
                      t0: float) -> Optional[CommitResult]:
    """``final`` is already committed: kept and reported as this commit (as
    :func:`_same_snapshot_committed` does for one rank), unless restore refused it
    as damaged or its record does not read: then it is set aside, and None returned."""
    record = None
    if plan.sid.name not in plan.supersedes:
        try:
            record = read_commit(final)
        except (SnapdError, OSError):
            record = None
    if record is None:
        try:
            uncommit(store, plan.sid, DAMAGED_PREFIX)
        except FileNotFoundError:
            pass   # another rank's writer set it aside first
        return None
    if (record["step"], record["lineage"]) != (plan.step, plan.lineage):
        raise SnapshotExists(
            f"{final} already exists with step, lineage = "
            f"{(record['step'], record['lineage'])!r}, not this snapshot's "
            f"{(plan.step, plan.lineage)!r}. Move it out of {store.snapshots_path} to "
            "keep it, or snapshot under another run name",
            path=os.path.join(final, fmt.COMMIT_NAME), field="lineage")
    move_latest(store, plan.sid, plan.supersedes)
    return CommitResult(plan.sid, final, int(record["bytes"]), time.perf_counter() - t0)
