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
  entry is found in the newest committed snapshot, located in H, or in H itself;
- content addressing: a tensor whose dtype, shape and chunk identities (xxh3-128 of
  each chunk's raw bytes, with its length) equal a tensor of the newest committed
  snapshot is the same bytes, and is referred to.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

from snapd import format as fmt
from snapd.errors import CorruptSnapshot, SnapdError

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
