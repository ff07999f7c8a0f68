"""Pins: snapshots that retention keeps whatever its rules say, until ``snapd unpin``.

A client pins the newest snapshot before an anomaly in the logged loss (a NaN, a
spike; snapd_client/anomaly.py), so that the state the bad step started from
survives ``keep_last`` long enough for someone to look, and ``snapd repro`` has a
snapshot to recompute from.

On disk (docs/format.md, "Pins")::

    <root>/<run>/pins/<snapshot name>     one file per pinned snapshot

The file is msgpack: a map with ``snapshot`` (its name), ``step`` (its step),
``anomaly`` (the anomaly record that pinned it, as the log has it) and ``time``. The
file's presence is the pin: retention, local (snapd/retention.py) and remote
(snapd/remote/retention.py), reads only the names. A pin names a snapshot that may
not be committed yet (the daemon may still be writing it when the anomaly is
noticed): retention then keeps it from its commit on. ``snapd unpin ROOT RUN@STEP``
removes the file; the next retention (the next commit, or ``snapd gc``) may delete
the snapshot.
"""

from __future__ import annotations

import os
import time
from typing import Any, Dict, List, Optional

import msgpack

from snapd import fsio
from snapd.errors import CorruptSnapshot
from snapd.store import DIR_MODE, SnapshotId

PINS_DIR = "pins"
# A pin file is a few hundred bytes; a larger one is not read.
MAX_PIN_BYTES = 1 << 16


def pins_path(run_path: str) -> str:
    return os.path.join(run_path, PINS_DIR)


def pinned(run_path: str) -> List[SnapshotId]:
    """The snapshots pinned in a run, oldest first (names only: a pin file that cannot
    be read still pins the snapshot it is named after)."""
    try:
        names = os.listdir(pins_path(run_path))
    except FileNotFoundError:
        return []
    return sorted(sid for sid in map(SnapshotId.parse, names) if sid is not None)


def pin(run_path: str, sid: SnapshotId, anomaly: Dict[str, Any]) -> str:
    """Pin ``sid`` for ``anomaly`` (a log record); returns the pin file's path. An
    existing pin of the same snapshot is kept (the first anomaly that pinned it)."""
    directory = pins_path(run_path)
    os.makedirs(directory, mode=DIR_MODE, exist_ok=True)
    path = os.path.join(directory, sid.name)
    if os.path.exists(path):
        return path
    record = {"snapshot": sid.name, "step": sid.step, "anomaly": anomaly,
              "time": time.time()}
    fsio.replace_file_atomic(path, msgpack.packb(record, use_bin_type=True))
    return path


def unpin(run_path: str, sid: SnapshotId) -> bool:
    """Remove the pin of ``sid``; False when it was not pinned."""
    path = os.path.join(pins_path(run_path), sid.name)
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    fsio.fsync_dir(pins_path(run_path))   # the unpin durable before retention relies on it
    return True


def read_pin(run_path: str, sid: SnapshotId) -> Optional[Dict[str, Any]]:
    """The pin record of ``sid``, or None when it is not pinned. CorruptSnapshot names
    the file when it is pinned but its record cannot be read."""
    path = os.path.join(pins_path(run_path), sid.name)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_PIN_BYTES + 1)
    except FileNotFoundError:
        return None
    try:
        if len(raw) > MAX_PIN_BYTES:
            raise ValueError(f"larger than {MAX_PIN_BYTES} bytes")
        record = msgpack.unpackb(raw, raw=False, strict_map_key=True)
        if not isinstance(record, dict):
            raise ValueError("not a map")
    except (ValueError, msgpack.UnpackException) as e:
        raise CorruptSnapshot(f"{path}: the pin record cannot be read ({e}); the pin "
                              "still holds (the file's name is the pin). Remove it with "
                              "snapd unpin", path=path, field="pin") from e
    return record


def pin_records(run_path: str) -> List[Dict[str, Any]]:
    """Every pin of a run as a record, oldest first; an unreadable one as
    ``{"snapshot": name, "error": why}``."""
    found = []
    for sid in pinned(run_path):
        try:
            found.append(read_pin(run_path, sid) or {"snapshot": sid.name})
        except CorruptSnapshot as e:
            found.append({"snapshot": sid.name, "step": sid.step, "error": str(e)})
    return found
