"""The SNAPSHOT argument of the operator commands, and what they share about snapshots.

A SNAPSHOT is one of, tried in this order::

    /path/to/root/gpt/snapshots/00001200   a snapshot directory (any path that exists)
    /path/to/root/gpt                      a run directory: its LATEST
    gpt/00001200   gpt/1200   gpt/1200.L1  RUN/NAME under --root (the step may be unpadded)
    gpt   gpt@latest                       the run's LATEST; if LATEST is missing or names
                                           no committed snapshot, the newest committed one
    gpt@best                               the run's BEST pointer

Errors exit with code 2 (nothing to act on: no such path, run, snapshot or pointer)
and name the path that was looked for; a snapshot that exists but is damaged is exit
code 1, with the CorruptSnapshot message and a hint to run ``snapd verify``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Dict, List, Optional

from snapd import format as fmt
from snapd.commands.common import fail, resolve_root, run_dir
from snapd.errors import CorruptSnapshot
from snapd.reader import SnapshotReader, check_real_directories, read_manifest_bytes
from snapd.store import TMP_PREFIX, RunStore, SnapshotId

SNAPSHOT_HELP = ("SNAPSHOT is a snapshot directory, RUN/NAME (gpt/00001200 or gpt/1200), "
                 "RUN or RUN@latest (its LATEST), or RUN@best, relative to --root.")
_SPEC = re.compile(r"^(?P<run>[^/@]+)(?:/(?P<name>[^/@]+)|@(?P<pointer>latest|best))?/?$")
_LOOSE_NAME = re.compile(r"^(\d+)(?:\.L(\d+))?$")


@dataclass(frozen=True)
class Located:
    """Where a SNAPSHOT argument led: the directory, and its run when known."""

    path: str                    # the snapshot directory, absolute
    name: str                    # its directory name
    run: Optional[str] = None    # None for a directory outside any run layout
    via: str = "path"            # "path", "name", "LATEST", "newest", "BEST"

    @property
    def label(self) -> str:
        return f"{self.run}/{self.name}" if self.run else self.path


def parse_name(text: str) -> Optional[SnapshotId]:
    """A snapshot name, allowing an unpadded step: ``1200``, ``00001200``, ``1200.L1``."""
    match = _LOOSE_NAME.match(text)
    if not match:
        return None
    return SnapshotId(int(match.group(2) or 0), int(match.group(1)))


def locate(spec: str, root: Optional[str]) -> Located:
    """Resolve a SNAPSHOT argument; exits with code 2 naming the path when there is none.

    A RUN form that exists under the root wins over a same-named path from here."""
    match = _SPEC.match(spec)
    guess = root or os.environ.get("SNAPD_ROOT") or "."
    under_root = match is not None and os.path.isdir(os.path.join(guess, match["run"]))
    if not under_root and os.path.isdir(spec):
        return _from_directory(os.path.abspath(spec))
    if spec.startswith(("/", "./", "../", "~")) or match is None:
        fail(f"{spec}: no such snapshot directory. {SNAPSHOT_HELP} (see snapd ls)", 2)
    base = resolve_root(root)
    run = match.group("run")
    run_dir(base, run)  # exits 2 naming the path and listing the runs when absent
    store = RunStore(base, run)
    if match.group("name"):
        return _by_name(store, match.group("name"))
    if match.group("pointer") == "best":
        return _by_pointer(store, "BEST")
    return latest(store)


def _from_directory(path: str) -> Located:
    name = os.path.basename(path)
    if name.startswith(TMP_PREFIX):
        fail(f"{path}: a .tmp- directory is an uncommitted (being written or abandoned) "
             "snapshot and is never read; pick a committed one with snapd ls", 2)
    if os.path.isdir(os.path.join(path, "snapshots")):  # a run directory
        return latest(RunStore(os.path.dirname(path), name))
    if not os.path.lexists(os.path.join(path, fmt.MANIFEST_NAME)):
        fail(f"{os.path.join(path, fmt.MANIFEST_NAME)}: no manifest, so {path} is not a "
             "snapshot directory; list snapshots with snapd ls --root ROOT", 2)
    parent = os.path.dirname(path)
    run = os.path.basename(os.path.dirname(parent)) \
        if os.path.basename(parent) == "snapshots" else None
    return Located(path, name, run, "path")


def _by_name(store: RunStore, text: str) -> Located:
    sid = parse_name(text)
    if sid is None:
        fail(f"{text!r} is not a snapshot name (the step, as in 00001200 or 1200, then "
             ".L<lineage> for a warm-start lineage); see snapd ls " + store.run, 2)
    path = store.snapshot_path(sid)
    if not os.path.isdir(path):
        have = [s.name for s in store.committed()]
        fail(f"{path}: no such snapshot in run {store.run!r}; it has "
             f"{', '.join(have[-8:]) if have else 'no committed snapshot'}"
             + (" (newest last; snapd ls shows all)" if len(have) > 8 else ""), 2)
    return Located(path, sid.name, store.run, "name")


def _by_pointer(store: RunStore, which: str) -> Located:
    sid = store.read_pointer(which)
    pointer = os.path.join(store.path, which)
    if sid is None:
        hint = (" BEST is written by retention (the daemon after each commit, or snapd "
                f"gc --run {store.run}) when snapshots carry a metric" if which == "BEST"
                else "")
        fail(f"{pointer}: missing or not a snapshot name.{hint} Use RUN/NAME instead "
             f"(snapd ls {store.run})", 2)
    if sid not in store.committed():
        fail(f"{pointer} names {sid.name}, which is not a committed snapshot of "
             f"{store.path}; use RUN/NAME instead (snapd ls {store.run})", 2)
    return Located(store.snapshot_path(sid), sid.name, store.run, which)


def latest(store: RunStore) -> Located:
    """LATEST when it names a committed snapshot, else the newest committed one."""
    committed = store.committed()
    if not committed:
        fail(f"{store.snapshots_path}: run {store.run!r} has no committed snapshot", 2)
    sid = store.read_pointer("LATEST")
    if sid in committed:
        return Located(store.snapshot_path(sid), sid.name, store.run, "LATEST")
    newest = committed[-1]
    return Located(store.snapshot_path(newest), newest.name, store.run, "newest")


# --- reading ------------------------------------------------------------------------

def open_reader(loc: Located) -> SnapshotReader:
    """The verified manifest (and checked file sizes), or exit 1 with the reason."""
    try:
        return SnapshotReader(loc.path)
    except CorruptSnapshot as e:
        fail(f"{e}\n  hint: snapd verify {loc.path} checks every file; an older "
             "snapshot is listed by snapd ls", 1)


def read_manifest(path: str) -> Dict[str, Any]:
    """The manifest alone (no tensor file is opened or stat'ed), or exit 1."""
    manifest_path = os.path.join(path, fmt.MANIFEST_NAME)
    try:
        check_real_directories(path)
        return fmt.decode_manifest(read_manifest_bytes(path), path=manifest_path)
    except OSError as e:
        fail(f"{manifest_path}: cannot be read ({e.strerror})", 2)
    except CorruptSnapshot as e:
        fail(f"{e}\n  hint: the manifest is damaged; pick an older snapshot (snapd ls)", 1)


# --- shared formatting -----------------------------------------------------------

def human_bytes(n: Optional[int]) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def iso_time(t: Optional[float]) -> Optional[str]:
    if t is None:
        return None
    return datetime.fromtimestamp(t, tz=timezone.utc).astimezone().isoformat(
        timespec="seconds")


def lineage_text(lineage: Optional[Dict[str, Any]], run: Optional[str] = None) -> str:
    """``0`` for a fresh run; ``1 warm_start from gpt/00001200`` for a warm start, or
    ``1 from 00001200`` when ``run`` (the row's own run) is the parent's: short form."""
    lineage = lineage or {}
    text = str(lineage.get("id", 0))
    parent = lineage.get("parent")
    if run is None and lineage.get("mode") and lineage.get("mode") != "fresh":
        text += f" {lineage['mode']}"
    if parent:
        where = parent.get("snapshot") if run is not None and parent.get("run") == run \
            else f"{parent.get('run')}/{parent.get('snapshot')}"
        text += f" from {where}"
    return text


def files_bytes(manifest: Dict[str, Any]) -> int:
    return sum(int(entry["size"]) for entry in manifest.get("files", {}).values())


def committed_of(store: RunStore) -> List[Located]:
    return [Located(store.snapshot_path(s), s.name, store.run, "name")
            for s in store.committed()]


def state_leaves(tree: Any, prefix: str = "") -> List[tuple]:
    """(path, leaf) of a state tree, paths spelt as the manifest spells tensor paths:
    ``.key`` for a mapping entry, ``[i]`` for a list or tuple item."""
    if isinstance(tree, dict):
        return [leaf for k, v in tree.items() for leaf in state_leaves(v, f"{prefix}.{k}")]
    if isinstance(tree, (list, tuple)):
        return [leaf for i, v in enumerate(tree) for leaf in state_leaves(v, f"{prefix}[{i}]")]
    return [(prefix, tree)]
