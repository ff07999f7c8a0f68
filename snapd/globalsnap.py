"""Read a committed multi-rank snapshot: its commit record, its parts, whole tensors.

A multi-rank snapshot directory holds ``commit.snapd`` and one part per rank
(``rank-NNNNN/``, each a snapshot directory of its own; docs/format.md). Nothing in a
part is trusted before the record vouches for it: each part's manifest must have the
size and xxh3 the record lists, and the run, step, lineage, world size and session
the record has. A part's entries may be pieces of a sharded tensor (``shard``) or
refer to a replicated tensor another rank stores (``ref``).

:meth:`GlobalSnapshot.load_object` gives each tensor whole (``snapd export``, ``diff``,
``inspect``), its shards assembled, in rank 0's entry order; :meth:`shards` lists the
saved pieces of one tensor for a reader that wants only some of them (a restore,
snapd_client/distrestore.py, which also resolves each rank's ``ref`` entries).

:func:`open_snapshot` opens either kind of snapshot directory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple, Union

from snapd import format as fmt
from snapd.errors import CorruptSnapshot
from snapd.globalcommit import SHARED_FIELDS, check_references
from snapd.reader import Progress, SnapshotReader, check_real_directories
from snapd.safefiles import read_bounded, read_manifest_bytes
from snapd.store import SNAPSHOT_NAME

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Piece:
    """One saved piece of a tensor: which rank stores it, where it lies in the whole."""

    rank: int                 # the part that stores its bytes
    index: int                # its entry's index in that part's object
    offset: Tuple[int, ...]   # its first element in the whole tensor (zeros: unsharded)
    shape: Tuple[int, ...]


class GlobalSnapshot:
    """A committed multi-rank snapshot, read through its commit record."""

    def __init__(self, path: str, check_files: bool = True) -> None:
        """``check_files=False``: the parts' files are not stat'ed on open (a view of
        the manifests alone, snapd/roots.py); each is checked when read."""
        self.path = path
        self._check_files = check_files
        check_real_directories(path)
        where = os.path.join(path, fmt.COMMIT_NAME)
        # The record's bytes: what a signature covers (snapd/signing.py).
        self.record_bytes = read_bounded(where, "commit record")
        self.record: Dict[str, Any] = fmt.decode_commit(self.record_bytes, path=where)
        self.world_size: int = self.record["world_size"]
        self._check_name()
        self._parts: Dict[int, SnapshotReader] = {}
        self._summary: Optional[Dict[str, Any]] = None

    @property
    def step(self) -> int:
        return self.record["step"]

    def _check_name(self) -> None:
        match = SNAPSHOT_NAME.match(os.path.basename(self.path))
        if match is None:
            return   # a copy under another name: nothing to compare
        found = (self.record["step"], self.record["lineage"].get("id", 0))
        named = (int(match.group(1)), int(match.group(2) or 0))
        if found != named:
            where = os.path.join(self.path, fmt.COMMIT_NAME)
            raise CorruptSnapshot(f"{where}: fields step/lineage.id are {found[0]}/"
                                  f"{found[1]} but the directory is named "
                                  f"{os.path.basename(self.path)}; the snapshot was moved "
                                  "or is hostile, use another one", path=where, field="step")

    # --- parts ---------------------------------------------------------------------

    def part(self, rank: int) -> SnapshotReader:
        """Rank ``rank``'s part, opened once and checked against the record."""
        if rank not in self._parts:
            self._parts[rank] = self._open_part(rank)
        return self._parts[rank]

    def _open_part(self, rank: int) -> SnapshotReader:
        if not 0 <= rank < self.world_size:
            raise IndexError(f"{self.path}: rank {rank} of a {self.world_size}-rank snapshot")
        listed = self.record["parts"][rank]
        part_dir = os.path.join(self.path, listed["dir"])
        manifest_path = os.path.join(part_dir, fmt.MANIFEST_NAME)
        data = read_manifest_bytes(part_dir)
        if (len(data), fmt.checksum(data)) != (listed["manifest_size"],
                                               listed["manifest_xxh3"]):
            raise CorruptSnapshot(f"{manifest_path}: not the manifest the commit record "
                                  f"lists (field parts[{rank}] of {fmt.COMMIT_NAME}: size "
                                  f"{listed['manifest_size']}, xxh3 "
                                  f"{listed['manifest_xxh3']}); rank {rank}'s part is "
                                  "damaged or replaced, use an older snapshot",
                                  path=manifest_path, field=f"parts[{rank}]")
        want = listed.get("manifest_sha256")
        if want is not None and fmt.sha256_of(data) != want:
            raise CorruptSnapshot(f"{manifest_path}: SHA-256 {fmt.sha256_of(data).hex()} "
                                  f"differs from field parts[{rank}].manifest_sha256 of "
                                  f"{fmt.COMMIT_NAME} ({want.hex()}), though its size and "
                                  f"xxh3 match: rank {rank}'s manifest was forged; use an "
                                  "older snapshot", path=manifest_path,
                                  field=f"parts[{rank}].manifest_sha256")
        reader = SnapshotReader(part_dir, None if self._check_files else [])
        for key in SHARED_FIELDS:
            if reader.manifest.get(key) != self.record.get(key):
                raise CorruptSnapshot(f"{manifest_path}: field {key} is "
                                      f"{reader.manifest.get(key)!r}, the commit record "
                                      f"says {self.record.get(key)!r}", path=manifest_path,
                                      field=key)
        if reader.manifest.get("rank") != rank:
            raise CorruptSnapshot(f"{manifest_path}: field rank is "
                                  f"{reader.manifest.get('rank')!r} in the part of rank "
                                  f"{rank}", path=manifest_path, field="rank")
        return reader

    def parts(self) -> List[SnapshotReader]:
        return [self.part(r) for r in range(self.world_size)]

    def check_references(self) -> None:
        """Every ``ref`` resolves (reads every part's manifest, no tensor file)."""
        check_references({r: p.manifest for r, p in enumerate(self.parts())}, self.path)

    # --- the whole snapshot as one ---------------------------------------------------

    @property
    def manifest(self) -> Dict[str, Any]:
        """Rank 0's manifest as the whole job's: tensors at their global shapes (no
        chunks: they live in several parts), files of every part as ``rank-N/name``,
        ``world_size`` and ``parts`` from the record. What status views show."""
        if self._summary is None:
            first = self.part(0).manifest
            objects = {name: {**obj, "tensors": [_whole_entry(t) for t in obj["tensors"]]}
                       for name, obj in first["objects"].items()}
            files = {f"{os.path.basename(p.path)}/{n}": f
                     for p in self.parts() for n, f in p.manifest["files"].items()}
            self._summary = {**first, "objects": objects, "files": files,
                             "world_size": self.world_size, "parts": self.record["parts"],
                             "metric": self.record.get("metric"),
                             "created": self.record.get("created")}
        return self._summary

    @property
    def objects(self) -> Dict[str, Any]:
        return self.manifest["objects"]

    def shards(self, name: str, path: str) -> List[Piece]:
        """Every saved piece of tensor ``path`` of object ``name``, once each (a piece
        replicated over ranks is stored once, by the rank its refs name)."""
        pieces: Dict[Tuple[int, ...], Piece] = {}
        for rank in range(self.world_size):
            obj = self.part(rank).objects.get(name)
            for i, t in enumerate(obj["tensors"] if obj else []):
                if t["path"] != path or "ref" in t:
                    continue
                offset = tuple(t["shard"]["offset"]) if "shard" in t \
                    else (0,) * len(t["shape"])
                pieces.setdefault(offset, Piece(rank, i, offset, tuple(t["shape"])))
        return sorted(pieces.values(), key=lambda p: p.offset)

    def load_object(self, name: str, progress: Progress = None) -> List["torch.Tensor"]:
        """Every tensor of object ``name`` whole (shards assembled, refs resolved), in
        rank 0's entry order, verified. Raises CorruptSnapshot."""
        import torch  # here: the daemon reads commit records without torch
        cache: Dict[int, List[Any]] = {}
        out = []
        for t in self.part(0).objects[name]["tensors"]:
            pieces = self.shards(name, t["path"])
            whole = _whole_entry(t)
            tensor = torch.empty(whole["shape"], dtype=fmt.DTYPES[t["dtype"]])
            _check_cover(pieces, whole["shape"], self.path, f"objects.{name}{t['path']}")
            for piece in pieces:
                if piece.rank not in cache:
                    cache[piece.rank] = self.part(piece.rank).load_object(name, progress)
                window = tensor
                for dim, (start, size) in enumerate(zip(piece.offset, piece.shape)):
                    window = window.narrow(dim, start, size)
                window.copy_(cache[piece.rank][piece.index])
            out.append(tensor)
        return out

    def verify(self, progress: Progress = None) -> None:
        """Every part's every file and checksum, and every reference."""
        self.check_references()
        for part in self.parts():
            part.verify(progress)


def _whole_entry(t: Dict[str, Any]) -> Dict[str, Any]:
    """A part's tensor entry as the whole tensor: global shape, no chunks, no ref."""
    shape = list(t["shard"]["global_shape"]) if "shard" in t else list(t["shape"])
    nbytes = fmt.ITEMSIZES[t["dtype"]]
    for n in shape:
        nbytes *= n
    return {"path": t["path"], "dtype": t["dtype"], "shape": shape, "nbytes": nbytes,
            "device": t.get("device"), "chunks": [], "xxh3": 0,
            "sharded": "shard" in t}


def _check_cover(pieces: List[Piece], shape: List[int], where: str, field: str) -> None:
    """The pieces tile the whole tensor: no element left unset, none written twice."""
    volume = 1
    for n in shape:
        volume *= n
    have, inside = 0, True
    for i, p in enumerate(pieces):
        size = 1
        for n in p.shape:
            size *= n
        have += size
        inside = inside and len(p.offset) == len(shape) and all(
            o + n <= g for o, n, g in zip(p.offset, p.shape, shape))
        inside = inside and not any(_overlap(p, q) for q in pieces[:i])
    if not inside or have != volume:
        raise CorruptSnapshot(f"{where}: the saved pieces of {field} do not cover its "
                              f"shape {shape} exactly once; the snapshot is damaged",
                              path=where, field=field)


def _overlap(a: Piece, b: Piece) -> bool:
    return all(x < y + m and y < x + n for x, n, y, m in
               zip(a.offset, a.shape, b.offset, b.shape)) and 0 not in a.shape + b.shape


def open_snapshot(path: str, check_files: bool = True
                  ) -> Union[SnapshotReader, GlobalSnapshot]:
    """A snapshot directory of either kind: one rank's (``manifest.snapd``) or many
    ranks' (``commit.snapd``). ``check_files=False``: no file is stat'ed on open."""
    if os.path.lexists(os.path.join(path, fmt.COMMIT_NAME)):
        return GlobalSnapshot(path, check_files)
    return SnapshotReader(path, None if check_files else [])
