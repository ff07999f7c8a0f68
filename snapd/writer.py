"""One snapshot, from tensor bytes in memory to a committed directory on disk.

The commit order is the invariant this module exists for; it is written once, in
:func:`write_snapshot`, and every path that saves a snapshot calls it. The tensor bytes
arrive as buffers (a staging arena, or CPU tensors in the synchronous path); they go
to the file without a Python-level copy unless compressed, by direct I/O where the
buffer and the filesystem allow (``snapd/blockfile.py``).
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

import xxhash

from snapd import format as fmt
from snapd import fsio
from snapd.blockfile import BlockFile
from snapd.compression import CompressionPolicy
from snapd.errors import SnapdError, SnapshotExists
from snapd.options import Options
from snapd.plan import ObjectPlan, SnapshotPlan
from snapd.reader import SnapshotReader
from snapd.store import RunStore, SnapshotId


Progress = Optional[Callable[[int], None]]


@dataclass
class CommitResult:
    sid: SnapshotId
    path: str
    bytes_written: int
    seconds: float


def _write_object_file(directory: str, obj: ObjectPlan, opts: Options,
                       progress: Progress = None) -> Dict[str, Any]:
    """Write one object's tensors as chunks; returns its manifest entries."""
    name = f"{obj.name}{fmt.TENSOR_FILE_SUFFIX}"
    policy = CompressionPolicy(opts.compression)
    file_digest = fmt.FileDigest(fmt.FORMAT_VERSION)
    entries = []
    out = BlockFile(os.path.join(directory, name))
    try:
        header = fmt.tensor_file_header()
        out.append(header)
        file_digest.header(header)
        for t in obj.tensors:
            level = policy.level_for(t.data, opts.chunk_bytes)
            chunks, raw_digest = [], xxhash.xxh3_64()
            for start in range(0, len(t.data), opts.chunk_bytes):
                raw = t.data[start:start + opts.chunk_bytes]
                stored, codec = fmt.encode_chunk(raw, level)
                digest = fmt.checksum(stored)
                raw_digest.update(raw)  # just hashed or compressed: still in cache
                offset = out.append(stored)
                file_digest.chunk(stored, digest)
                chunks.append([offset, len(stored), len(raw), codec, digest])
                if progress is not None:
                    progress(len(raw))
            entries.append({"path": t.path, "dtype": t.dtype, "shape": list(t.shape),
                            "nbytes": len(t.data), "device": t.device, "chunks": chunks,
                            "xxh3": raw_digest.intdigest()})
        out.sync()
    finally:
        out.close()
    return {"file": name, "tensors": entries, "size": out.end,
            "xxh3": file_digest.intdigest()}


def _manifest(plan: SnapshotPlan, written: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    objects, files = {}, {}
    for obj in plan.objects:
        entry = written.get(obj.name)
        if entry is not None:
            files[entry["file"]] = {"size": entry["size"], "xxh3": entry["xxh3"]}
        objects[obj.name] = {"type": obj.type, "skeleton": obj.skeleton,
                             "metadata": obj.metadata,
                             "file": entry["file"] if entry else None,
                             "tensors": entry["tensors"] if entry else []}
    return {"format": fmt.FORMAT_VERSION, "run": plan.run, "step": plan.step,
            "rank": plan.rank, "world_size": plan.world_size, "created": time.time(),
            "data_version": plan.data_version, "metric": plan.metric,
            "lineage": plan.lineage, "rng": plan.rng, "cursor": plan.cursor,
            "objects": objects, "files": files}


def _same_snapshot_committed(store: RunStore, plan: SnapshotPlan, final: str,
                             t0: float) -> Optional[CommitResult]:
    """A snapshot of this step and lineage is already committed at ``final``.

    That happens when a trainer resumes below a step whose write finished after it
    died (or after the restore chose), recomputes it and snapshots it again. The
    existing snapshot is kept and reported as this commit, not replaced: it is
    durable, the log's committed record may name it, a replay-exact resume computes
    the same bytes, and a directory cannot be replaced atomically (there would be a
    window with no snapshot of this step). LATEST moves to it as after a write.

    Returns None when the directory is damaged (its manifest or a file's size does
    not check): the caller sets it aside and writes anew. Another lineage under the
    same name (a different warm-start parent), or another rank's, is refused.
    """
    try:
        manifest = SnapshotReader(final).manifest
    except (SnapdError, OSError):
        return None
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
    store.write_pointer("LATEST", plan.sid)
    size = sum(int(f.get("size", 0)) for f in manifest.get("files", {}).values())
    return CommitResult(plan.sid, final, size, time.perf_counter() - t0)


def write_snapshot(store: RunStore, plan: SnapshotPlan, opts: Options,
                   progress: Progress = None) -> CommitResult:
    """Write and commit one snapshot. On any failure nothing is published.

    ``progress(n)`` is called (from writer threads) as each chunk's ``n`` raw bytes
    reach the file: what a progress bar shows against ``plan.nbytes``.

    A failure leaves at most a ``.tmp-*`` directory, which no reader lists and the
    next collection removes; LATEST still names the previous committed snapshot.
    """
    t0 = time.perf_counter()
    final = store.snapshot_path(plan.sid)
    if os.path.exists(final):
        if plan.sid.name not in plan.supersedes:
            existing = _same_snapshot_committed(store, plan, final, t0)
            if existing is not None:
                return existing
        store.set_aside(plan.sid)  # refused as damaged (at restore or here): kept, renamed
    tmp = store.new_tmp_dir(plan.sid)
    # 1. Tensor files into the private tmp dir, each fsynced before the manifest.
    with_tensors = [o for o in plan.objects if o.tensors]
    workers = max(1, min(opts.writer_threads, len(with_tensors)))
    with ThreadPoolExecutor(workers) as pool:
        results = list(pool.map(lambda o: _write_object_file(tmp, o, opts, progress),
                                with_tensors))
    written = {o.name: r for o, r in zip(with_tensors, results)}
    # 2. The manifest last: its presence means every file it lists is durable.
    fsio.write_file_durable(os.path.join(tmp, fmt.MANIFEST_NAME),
                            fmt.encode_manifest(_manifest(plan, written)))
    # 3. The tmp dir's entries durable, then the rename that commits the snapshot,
    #    then the parent fsynced so that the rename survives a power loss.
    fsio.fsync_dir(tmp)
    fsio.publish_directory(tmp, final)
    # 4. Only now move LATEST (atomically); it is a hint, verified on use.
    store.write_pointer("LATEST", plan.sid)
    total = sum(r["size"] for r in results)
    return CommitResult(plan.sid, final, total, time.perf_counter() - t0)
