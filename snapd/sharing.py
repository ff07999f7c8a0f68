"""Bytes shared between snapshots of a run: where a shared file is, and how the writer
finds committed bytes to refer to instead of writing them again.

A v4 tensor entry with ``src`` reads its chunks from ``shared[src]``, a tensor file
of an earlier snapshot of the same run (docs/format.md, "Shared files"). That file
lives in its snapshot's directory while the snapshot is committed, and in
``<run>/shared/<snapshot>/`` once retention has deleted the snapshot but a kept one
still refers to it (snapd/keepshared.py hard-links it there first). A reader looks
in ``shared/`` first, then in ``snapshots/``: a file only ever gains the first name
before it loses the second, so one of the two opens at every instant.

The writer refers to committed bytes in two cases (:class:`Resolver`):
- the client says a frozen tensor is unchanged since snapshot H (``reuse``): its
  entry is the newest committed snapshot's, which is H or newer (see
  :meth:`Resolver.reused`);
- content addressing: a frozen tensor whose dtype, shape and chunk identities
  (xxh3-128 of each chunk's raw bytes, with its length) equal a tensor of the newest
  committed snapshot is the same bytes, and is referred to (tensors that train carry
  no identities: they change at every step).
"""

from __future__ import annotations

import os
from typing import Any, Dict, Optional, Sequence, Set, Tuple

from snapd import format as fmt
from snapd.errors import CorruptSnapshot, SnapdError
from snapd.safefiles import read_manifest_bytes
from snapd.store import SnapshotId

SHARED_DIR = "shared"

Where = Dict[str, Any]   # a ``shared`` entry: {snapshot, file, size, format}


def run_dir_of(snapshot_dir: str) -> Optional[str]:
    """The run directory of a snapshot directory in a run layout, else None."""
    parent = os.path.dirname(os.path.abspath(snapshot_dir))
    if os.path.basename(parent) != "snapshots":
        return None
    return os.path.dirname(parent)


def shared_path(run_dir: str, snapshot: str, file: str) -> str:
    return os.path.join(run_dir, SHARED_DIR, snapshot, file)


def locate(run_dir: Optional[str], snapshot: str, file: str, *, wanted_by: str) -> str:
    """The path of ``file`` of earlier snapshot ``snapshot``: kept in ``shared/``, or
    still in its snapshot directory. CorruptSnapshot when neither holds it."""
    if run_dir is None:
        raise CorruptSnapshot(f"{wanted_by}: refers to {file} of snapshot {snapshot}, "
                              "but it is not inside a run's snapshots/ directory, "
                              "where that file would be found. Read it in place, or "
                              "copy the run with its shared/ directory",
                              path=wanted_by, field="shared")
    for candidate in (shared_path(run_dir, snapshot, file),
                      os.path.join(run_dir, "snapshots", snapshot, file)):
        if os.path.lexists(candidate):
            return candidate
    raise CorruptSnapshot(f"{wanted_by}: refers to {file} of snapshot {snapshot}, "
                          f"found neither in {os.path.join(run_dir, SHARED_DIR, snapshot)} "
                          f"nor in {os.path.join(run_dir, 'snapshots', snapshot)}; the "
                          "bytes it shares were deleted: use another snapshot",
                          path=wanted_by, field="shared")


def references(manifest: Dict[str, Any]) -> Set[Tuple[str, str]]:
    """The (snapshot, file) pairs a manifest's entries read through ``src``."""
    shared = manifest.get("shared") or []
    used = {t["src"] for o in manifest["objects"].values() for t in o["tensors"]
            if t.get("src") is not None}
    return {(shared[i]["snapshot"], shared[i]["file"]) for i in used}


def one_rank_manifest(snapshot_dir: str) -> Optional[Dict[str, Any]]:
    """The decoded manifest of a one-rank snapshot directory; None for a multi-rank
    one (its parts never share). Raises what reading or decoding it raises."""
    if os.path.lexists(os.path.join(snapshot_dir, fmt.COMMIT_NAME)):
        return None
    return fmt.decode_manifest(read_manifest_bytes(snapshot_dir),
                               path=os.path.join(snapshot_dir, fmt.MANIFEST_NAME))


def where_own(name: str, manifest: Dict[str, Any], obj: Dict[str, Any]) -> Where:
    """The ``shared`` entry naming an object's own file in snapshot ``name``."""
    return {"snapshot": name, "file": obj["file"],
            "size": manifest["files"][obj["file"]]["size"], "format": manifest["format"]}


def locations(name: str, manifest: Dict[str, Any]
              ) -> Dict[Tuple[str, str], Tuple[Where, Dict[str, Any]]]:
    """Where each stored tensor of a committed snapshot has its bytes: (object, path)
    -> (the file as a ``shared`` entry, the tensor entry). Only files of a shareable
    version: older ones are never referred to (their chunks have no identity)."""
    found = {}
    shared = manifest.get("shared") or []
    for obj_name, obj in manifest["objects"].items():
        for t in obj["tensors"]:
            if "ref" in t:
                continue
            where = shared[t["src"]] if t.get("src") is not None else \
                where_own(name, manifest, obj) if obj.get("file") is not None else None
            if where is not None and where["format"] in fmt.SHAREABLE_VERSIONS:
                found[(obj_name, t["path"])] = (where, t)
    return found


def identity(entry: Dict[str, Any]) -> Optional[Tuple[Any, ...]]:
    """What makes two tensors the same bytes: dtype, shape and each chunk's identity
    with its raw length. None for an entry whose chunks carry no identity."""
    if any(len(c) < 6 for c in entry["chunks"]):
        return None
    return (entry["dtype"], tuple(entry["shape"]),
            tuple((bytes(c[5]), c[2]) for c in entry["chunks"]))


class Resolver:
    """The committed bytes one write may refer to: the run's newest committed one-rank
    snapshot, read once per write by :meth:`prepare` (the daemon writes a run's
    snapshots one at a time, so nothing it holds is deleted meanwhile)."""

    def __init__(self, store: Any, avoid: Sequence[str] = ()) -> None:
        """``avoid``: snapshots restore refused as damaged: nothing refers to them."""
        self.store = store
        self.avoid = set(avoid)
        self._newest: Optional[Tuple[str, Dict[str, Any]]] = None
        self._loaded = False
        self._present: Dict[Tuple[str, str], bool] = {}
        self._where: Dict[Tuple[str, str], Tuple[Where, Dict[str, Any]]] = {}
        self._by_identity: Dict[Tuple[Any, ...], Tuple[Where, Dict[str, Any]]] = {}

    def newest(self) -> Optional[Tuple[str, Dict[str, Any]]]:
        if not self._loaded:
            self._loaded = True
            for sid in reversed(self.store.committed()):
                if sid.name in self.avoid:
                    continue
                manifest = self._manifest(sid.name)
                if manifest is not None:
                    self._newest = (sid.name, manifest)
                    break
        return self._newest

    def _manifest(self, name: str) -> Optional[Dict[str, Any]]:
        """A committed one-rank snapshot's manifest, or None (multi-rank, unreadable:
        nothing there is referred to)."""
        try:
            return one_rank_manifest(os.path.join(self.store.snapshots_path, name))
        except (SnapdError, OSError):
            return None

    def reused(self, obj: str, path: str, dtype: str, shape: Sequence[int],
               home: str) -> Tuple[Where, Dict[str, Any]]:
        """The entry of tensor ``path`` of ``obj`` as snapshot ``home`` holds it.

        The newest committed snapshot has it when it is ``home`` or newer: the client
        says "unchanged since ``home``" only while every snapshot it took since
        referred to ``home`` for it (one copy makes the copy the home), and the daemon
        writes one run's snapshots in order; so from ``home`` on, each holds the same
        entry. A newest snapshot older than ``home`` means ``home`` failed or was
        skipped: CorruptSnapshot (field ``reuse``), and the client copies next time."""
        newest = self.newest()
        wanted = SnapshotId.parse(home)
        if newest is not None and wanted is not None and \
                SnapshotId.parse(newest[0]) >= wanted:
            found = self._where.get((obj, path))
            if found is not None and self.present(found[0]) and \
                    (found[1]["dtype"], list(found[1]["shape"])) == (dtype, list(shape)):
                return found
        raise CorruptSnapshot(
            f"tensor {path!r} of {obj!r} was sent as unchanged since snapshot {home}, "
            f"but no committed snapshot in {self.store.snapshots_path} holds it from "
            "there on (that snapshot failed, was skipped or deleted). This snapshot is "
            "not written; the client copies the tensor in the next one",
            path=self.store.snapshots_path, field="reuse")

    def prepare(self) -> "Resolver":
        """Read what the lookups need, once per write, before the writer's threads
        share it: the newest snapshot's tensors by name and by identity, and which of
        the files they lie in are there."""
        newest = self.newest()
        if newest is not None:
            self._where = locations(*newest)
            for where, entry in self._where.values():
                key = identity(entry)
                if key is not None:
                    self._by_identity.setdefault(key, (where, entry))
                self.present(where)
        return self

    def same_bytes(self, dtype: str, shape: Sequence[int],
                   ids: Sequence[Tuple[bytes, int]]) -> Optional[Tuple[Where, Dict[str, Any]]]:
        """A tensor of the newest committed snapshot with these bytes, or None."""
        if not self._by_identity:
            return None
        found = self._by_identity.get((dtype, tuple(shape), tuple(ids)))
        return found if found is not None and self.present(found[0]) else None

    def present(self, where: Where) -> bool:
        """Whether the file ``where`` names is there, at its size: a reference to a
        file that is gone would commit a snapshot that cannot be read."""
        key = (where["snapshot"], where["file"])
        if key not in self._present:
            try:
                path = locate(self.store.path, *key, wanted_by=self.store.snapshots_path)
                self._present[key] = os.lstat(path).st_size == where["size"]
            except (SnapdError, OSError):
                self._present[key] = False
        return self._present[key]
