"""The global commit of a multi-rank snapshot: every rank's part, or nothing.

Each rank's part is written like a one-rank snapshot, but into
``snapshots/.parts-<name>/rank-NNNNN/`` (snapd/writer.py). After its part lands, the
writer calls :func:`try_commit`. Whoever completes the set commits: under an
exclusive ``flock`` on the run's ``<run>/.commit.lock``, when every rank's part is there
(same run, step, lineage, world size, session, data version) and every ``ref`` entry
resolves, it writes ``commit.snapd`` (each part's manifest size and digest), and
publishes ``.parts-<name>`` as ``<name>`` (snapd/commit.py, :func:`publish`, as every
commit does): that rename is the global commit, and LATEST moves after it.
docs/multirank.md numbers the steps and what a crash between any two leaves behind.
Only manifests are read here, never a tensor file.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from contextlib import contextmanager
from typing import Any, Collection, Dict, Iterator, List, Optional, Tuple

from snapd import format as fmt
from snapd import fsio
from snapd.commit import publish
# DanglingReference lives in the error tree (it crosses the daemon's socket); it is
# imported here too, so ``from snapd.globalcommit import DanglingReference`` works.
from snapd.errors import CorruptSnapshot, DanglingReference
from snapd.safefiles import read_manifest_bytes
from snapd.store import RunStore, SnapshotId

log = logging.getLogger(__name__)

LOCK_NAME = ".commit.lock"   # in the run dir, beside the writer locks: made once, kept
# The fields every part of one snapshot shares; a part that differs belongs to another
# attempt (a session) or another job shape and is never joined with the others.
SHARED_FIELDS = ("run", "step", "lineage", "world_size", "session", "data_version")


@contextmanager
def _commit_lock(store: RunStore, parts_dir: str) -> Iterator[bool]:
    """Hold the run's commit lock; yields False when the parts dir is gone (another
    writer committed it, or gc removed it).

    The lock file is the run's (in the run dir, so that snapshots/ holds snapshots
    only), outside every parts dir, and stays: a lock file
    inside ``.parts-<name>`` has to be gone before the rename that commits (it would
    ride into the snapshot), and a writer that came between its unlink and the
    rename made a new one, held it at once, and committed the same parts a second
    time, racing the first writer's rename (seen with two ranks' parts landing
    together: the second writer's part failed on the vanished directory)."""
    try:
        fd = os.open(os.path.join(store.path, LOCK_NAME),
                     os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except FileNotFoundError:   # the run dir is gone: nothing to commit
        yield False
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield os.path.isdir(parts_dir)
    finally:
        os.close(fd)


def read_part(part_dir: str) -> Tuple[Dict[str, Any], bytes]:
    """A committed part's manifest and its bytes (CorruptSnapshot/OSError if absent or
    damaged)."""
    data = read_manifest_bytes(part_dir)
    manifest_path = os.path.join(part_dir, fmt.MANIFEST_NAME)
    return fmt.decode_manifest(data, path=manifest_path), data


def present_parts(parts_dir: str, world_size: int, want: Dict[str, Any]
                  ) -> Dict[int, Tuple[Dict[str, Any], bytes]]:
    """The parts under ``parts_dir`` that belong with ``want`` (the shared fields)."""
    found = {}
    for rank in range(world_size):
        try:
            manifest, data = read_part(os.path.join(parts_dir, fmt.part_dir_name(rank)))
        except (CorruptSnapshot, OSError):
            continue
        if all(manifest.get(k) == want.get(k) for k in SHARED_FIELDS):
            found[rank] = (manifest, data)
    return found


def check_references(parts: Dict[int, Dict[str, Any]], where: str) -> None:
    """Every ``ref`` entry names a rank whose part holds that object and path, stored
    there with the same dtype, shape and shard. From manifests alone."""
    held = {}
    for rank, manifest in parts.items():
        for name, obj in manifest["objects"].items():
            for t in obj["tensors"]:
                if "ref" not in t:
                    held[(rank, name, t["path"], shard_offset(t))] = (t["dtype"], t["shape"])
    for rank, manifest in parts.items():
        for name, obj in manifest["objects"].items():
            for t in obj["tensors"]:
                if "ref" in t and held.get((t["ref"], name, t["path"], shard_offset(t))) \
                        != (t["dtype"], t["shape"]):
                    raise DanglingReference(
                        f"{where}: rank {rank}'s objects.{name}{t['path']} is replicated "
                        f"and left to rank {t['ref']}, whose part does not hold it with "
                        f"dtype {t['dtype']} and shape {t['shape']}: the ranks disagree "
                        "on what is replicated (is the model wrapped the same way on "
                        "every rank?). This snapshot is not committed",
                        path=where, field=f"objects.{name}{t['path']}.ref")


def shard_offset(t: Dict[str, Any]) -> Optional[tuple]:
    """Where a tensor entry's piece starts in the whole tensor (None: unsharded); with
    the object and path, what a ``ref`` entry and the entry it names share."""
    return tuple(t["shard"]["offset"]) if "shard" in t else None


def commit_record(parts: Dict[int, Tuple[Dict[str, Any], bytes]],
                  created: Optional[float] = None) -> Dict[str, Any]:
    """The ``commit.snapd`` of a complete set of parts. ``created``: now by default;
    the remote commit passes a time drawn from the parts, so that every committer
    encodes the same bytes (snapd/remote/parts.py)."""
    first = parts[0][0]
    return {"format": fmt.FORMAT_VERSION, "run": first["run"], "step": first["step"],
            "lineage": first["lineage"], "world_size": first["world_size"],
            "session": first["session"],
            "created": time.time() if created is None else created,
            "metric": first.get("metric"), "data_version": first.get("data_version"),
            # Each part's manifest by size, xxh3 (damage) and SHA-256 (a forgery: a
            # part's manifest rewritten with its files cannot keep this).
            "parts": [{"rank": r, "dir": fmt.part_dir_name(r), "manifest_size": len(data),
                       "manifest_xxh3": fmt.checksum(data),
                       "manifest_sha256": fmt.sha256_of(data)}
                      for r, (_, data) in sorted(parts.items())],
            "bytes": sum(f["size"] for m, _ in parts.values() for f in m["files"].values())}


def try_commit(store: RunStore, sid: SnapshotId, want: Dict[str, Any], *,
               superseded: Collection[str] = (), signer: Any = None) -> bool:
    """Commit snapshot ``sid`` globally if every part of ``want``'s session is there.

    ``want``: the shared fields of the part just written (its manifest);
    ``superseded``: what the writer's restore refused (snapd/commit.py); ``signer``:
    the process's keys (snapd/signing.py), which sign the record. Returns True
    when ``snapshots/<name>`` is committed (now, or by another writer before), False
    while parts are missing. Raises DanglingReference when the parts are complete
    but disagree (nothing is committed then).
    """
    parts_dir, final = store.parts_path(sid), store.snapshot_path(sid)
    with _commit_lock(store, parts_dir) as held:
        if not held or os.path.exists(final):
            return os.path.exists(final)
        found = present_parts(parts_dir, want["world_size"], want)
        if len(found) < want["world_size"]:
            return False
        check_references({r: m for r, (m, _) in found.items()}, parts_dir)
        _remove_strays(store, parts_dir, want["world_size"])
        # 2. The record, durable, inside the parts dir.
        fsio.write_file_durable(os.path.join(parts_dir, fmt.COMMIT_NAME),
                                fmt.encode_commit(commit_record(found), signer))
        fsio.fsync_dir(parts_dir)
        # 3-4. The rename that commits every part at once, then LATEST.
        publish(store, parts_dir, sid, superseded=superseded)
    log.info("run %r: %s committed globally (%d ranks)", store.run, sid.name,
             want["world_size"])
    return True


def _remove_strays(store: RunStore, parts_dir: str, world_size: int) -> None:
    """Parts of other attempts (another session or a larger world size), and tmp dirs,
    must not ride into the committed snapshot: moved out, then removed."""
    keep = {fmt.part_dir_name(r) for r in range(world_size)}
    for name in os.listdir(parts_dir):
        if name not in keep:
            store.discard(os.path.join(parts_dir, name), "stray")


def incomplete(store: RunStore) -> List[Dict[str, Any]]:
    """Each ``.parts-<name>`` dir: its snapshot, world size and the ranks present.
    What ``snapd status``/``ls`` show as incomplete; never restored."""
    out = []
    for sid, path in store.parts_dirs():
        ranks, world, session = [], None, None
        for name in sorted(os.listdir(path)) if os.path.isdir(path) else []:
            if not name.startswith("rank-"):
                continue
            try:
                manifest, _ = read_part(os.path.join(path, name))
            except (CorruptSnapshot, OSError):
                continue
            ranks.append(manifest.get("rank", 0))
            world, session = manifest.get("world_size"), manifest.get("session")
        out.append({"name": sid.name, "step": sid.step, "lineage": sid.lineage,
                    "path": path, "ranks": ranks, "world_size": world,
                    "session": session,
                    "missing": [r for r in range(world or 0) if r not in ranks]})
    return out
