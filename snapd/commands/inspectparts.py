"""``snapd inspect`` of a multi-rank snapshot: its parts, and where each tensor lies.

From the commit record and the parts' manifests only (no tensor file). Each tensor is
shown whole (its global shape) with its placement across the ranks:

- ``sharded``: the parts hold pieces of it (``shard`` entries), each stored once;
- ``replicated``: the same on every rank, stored once, by the rank the others' ``ref``
  entries name;
- ``per rank``: each rank stores its own (RNG-like state, a rank's own counters).

The manifests are decoded without the checks against the record and the files, so a
damaged snapshot can still be inspected; those checks run after, and what they find
is reported in ``files_problem``, as for one rank.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Tuple

from snapd import format as fmt
from snapd.commands.common import cursor_info, fail, files_bytes, files_info
from snapd.errors import CorruptSnapshot, SnapdError
from snapd.globalcommit import read_part
from snapd.globalsnap import GlobalSnapshot
from snapd.reader import read_commit
from snapd.humanize import iso_time

Entry = Tuple[int, Dict[str, Any]]   # (rank, that rank's tensor entry)


def read_parts(path: str) -> Tuple[Dict[str, Any], Dict[int, Dict[str, Any]]]:
    """The commit record and every part's manifest (decoded, not yet checked against
    the record), or exit 1 naming the rank and file that cannot be read."""
    try:
        record = read_commit(path)
    except (CorruptSnapshot, OSError) as e:
        fail(f"{e}\n  hint: the commit record is damaged; pick an older snapshot (snapd ls)",
             1)
    parts = {}
    for listed in record["parts"]:
        try:
            parts[listed["rank"]] = read_part(os.path.join(path, listed["dir"]))[0]
        except (CorruptSnapshot, OSError) as e:
            fail(f"rank {listed['rank']}: {e}\n  hint: that rank's part is damaged; pick an "
                 "older snapshot (snapd ls)", 1)
    return record, parts


def placement(entries: List[Entry]) -> Dict[str, Any]:
    """Where one tensor's bytes lie, from every rank's entry of it."""
    stored = [(rank, t) for rank, t in entries if "ref" not in t]
    by = sorted({rank for rank, _ in stored})
    if any("shard" in t for _, t in entries):
        pieces = len({tuple(t["shard"]["offset"]) for _, t in stored if "shard" in t})
        kind = "sharded"
    elif len(entries) > 1 and any("ref" in t for _, t in entries):
        pieces, kind = 1, "replicated"
    else:
        pieces, kind = len(stored), "per rank" if len(entries) > 1 else "whole"
    return {"placement": kind, "stored_by": by, "pieces": pieces,
            "stored_bytes": sum(c[1] for _, t in stored for c in t["chunks"]),
            "chunks": sum(len(t["chunks"]) for _, t in stored),
            "codecs": sorted({c[3] for _, t in stored for c in t["chunks"]})}


def _entries(parts: Dict[int, Dict[str, Any]], name: str, path: str) -> List[Entry]:
    return [(rank, t) for rank, m in sorted(parts.items())
            for t in (m["objects"].get(name) or {}).get("tensors", []) if t["path"] == path]


def _whole_shape(t: Dict[str, Any]) -> List[int]:
    return list(t["shard"]["global_shape"]) if "shard" in t else list(t["shape"])


def objects_info(parts: Dict[int, Dict[str, Any]]) -> Dict[str, Any]:
    """Rank 0's objects, each tensor whole with its placement over the ranks."""
    objects = {}
    for name, obj in parts[0]["objects"].items():
        tensors = []
        for t in obj["tensors"]:
            shape = _whole_shape(t)
            nbytes = fmt.ITEMSIZES[t["dtype"]]
            for n in shape:
                nbytes *= n
            tensors.append({"path": t["path"], "dtype": t["dtype"], "shape": shape,
                            "bytes": nbytes, "device": t.get("device"),
                            **placement(_entries(parts, name, t["path"]))})
        objects[name] = {"type": obj.get("type"), "file": obj.get("file"),
                         "tensors": tensors, "count": len(tensors),
                         "bytes": sum(t["bytes"] for t in tensors),
                         "stored_bytes": sum(t["stored_bytes"] for t in tensors)}
    return objects


def summary(path: str) -> Dict[str, Any]:
    """What ``snapd inspect --json`` prints for a multi-rank snapshot."""
    record, parts = read_parts(path)
    if 0 not in parts:
        fail(f"{os.path.join(path, fmt.COMMIT_NAME)}: field parts lists no rank 0", 1)
    first = parts[0]
    files_problem = None
    try:   # the manifests against the record, and the references; files: the caller
        snap = GlobalSnapshot(path, check_files=False)
        for rank in range(snap.world_size):
            _checked_part(snap, rank)
        snap.check_references()
    except SnapdError as e:   # CorruptSnapshot, DanglingReference
        files_problem = str(e)
    return {"path": path, "run": record.get("run"), "step": record["step"], "rank": None,
            "world_size": record["world_size"], "session": record.get("session"),
            "created": record.get("created"), "created_iso": iso_time(record.get("created")),
            "data_version": record.get("data_version"), "metric": record.get("metric"),
            "lineage": record.get("lineage"),
            "rng": {k: len(v) for k, v in sorted(first["rng"].items())},
            "cursor": cursor_info(first.get("cursor")), "objects": objects_info(parts),
            "parts": [{"rank": rank, "dir": fmt.part_dir_name(rank),
                       "bytes": files_bytes(m), "session": m.get("session"),
                       "files": files_info(m),
                       "manifest_sha256": _part_sha256(record, rank)}
                      for rank, m in sorted(parts.items())],
            "bytes": sum(files_bytes(m) for m in parts.values()),
            "files_problem": files_problem}


def _part_sha256(record: Dict[str, Any], rank: int) -> Optional[str]:
    """The SHA-256 (hex) of rank ``rank``'s manifest the commit record lists (v5)."""
    listed = record["parts"][rank] if rank < len(record["parts"]) else {}
    sha = listed.get("manifest_sha256")
    return sha.hex() if sha is not None else None


def _checked_part(snap: GlobalSnapshot, rank: int) -> None:
    """One part's manifest against the record (and its files against its manifest
    when ``snap`` checks files)."""
    try:
        snap.part(rank)
    except CorruptSnapshot as e:
        raise CorruptSnapshot(f"rank {rank}: {e}", path=e.path, field=e.field) from e


def placement_text(t: Dict[str, Any]) -> str:
    """``sharded x4 (ranks 0-3)``, ``replicated, stored by rank 1``, ``per rank``."""
    by = t["stored_by"]
    ranks = (f"rank {by[0]}" if len(by) == 1 else
             f"ranks {by[0]}-{by[-1]}" if by == list(range(by[0], by[-1] + 1)) else
             "ranks " + ", ".join(map(str, by))) if by else "no rank"
    if t["placement"] == "sharded":
        return f"sharded x{t['pieces']} ({ranks})"
    if t["placement"] == "replicated":
        return f"replicated, stored by {ranks}"
    return t["placement"]
