"""The SNAPSHOT argument of the operator commands: find the snapshot a user means.

A SNAPSHOT is one of, tried in this order::

    /path/to/root/gpt/snapshots/00001200   a snapshot directory (any path that exists;
                                           one rank's, or a multi-rank snapshot's)
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
from typing import List, Optional

from snapd import format as fmt
from snapd.commands.common import fail, given_root, resolve_root, run_dir
from snapd.store import PARTS_PREFIX, TMP_PREFIX, RunStore, SnapshotId

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
    guess = given_root(root)
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
    if name.startswith(PARTS_PREFIX):
        fail(f"{path}: the parts of a multi-rank snapshot not committed globally (a rank's "
             "part is missing); it is never restored and gc removes it. Pick a committed "
             "snapshot with snapd ls", 2)
    if os.path.isdir(os.path.join(path, "snapshots")):  # a run directory
        return latest(RunStore(os.path.dirname(path), name))
    if not any(os.path.lexists(os.path.join(path, n))
               for n in (fmt.MANIFEST_NAME, fmt.COMMIT_NAME)):
        fail(f"{os.path.join(path, fmt.MANIFEST_NAME)}: no manifest (nor "
             f"{fmt.COMMIT_NAME}, the record of a multi-rank snapshot), so {path} is not a "
             "snapshot directory; list snapshots with snapd ls --root ROOT", 2)
    parent = os.path.dirname(path)
    run = os.path.basename(os.path.dirname(parent)) \
        if os.path.basename(parent) == "snapshots" else None
    return Located(path, name, run)


def _by_name(store: RunStore, text: str) -> Located:
    sid = parse_name(text)
    if sid is None:
        fail(f"{text!r} is not a snapshot name (the step, as in 00001200 or 1200, then "
             ".L<lineage> for a warm-start lineage); see snapd ls " + store.run, 2)
    path = store.snapshot_path(sid)
    if not os.path.isdir(path) and os.path.isdir(store.parts_path(sid)):
        fail(f"{path}: not committed; {store.parts_path(sid)} holds the parts of some "
             "ranks only, and is never read (snapd ls shows which ranks are missing)", 2)
    if not os.path.isdir(path):
        have = [s.name for s in store.committed()]
        fail(f"{path}: no such snapshot in run {store.run!r}; it has "
             f"{', '.join(have[-8:]) if have else 'no committed snapshot'}"
             + (" (newest last; snapd ls shows all)" if len(have) > 8 else ""), 2)
    return Located(path, sid.name, store.run)


def _by_pointer(store: RunStore, which: str) -> Located:
    sid = store.read_pointer(which)
    pointer = os.path.join(store.path, which)
    if sid is None:
        hint = (" BEST is written by retention (the daemon after each commit, or snapd "
                f"gc --run {store.run}) when snapshots carry a metric." if which == "BEST"
                else "")
        fail(f"{pointer}: missing or not a snapshot name.{hint} Use RUN/NAME instead "
             f"(snapd ls {store.run})", 2)
    if sid not in store.committed():
        fail(f"{pointer} names {sid.name}, which is not a committed snapshot of "
             f"{store.path}; use RUN/NAME instead (snapd ls {store.run})", 2)
    return Located(store.snapshot_path(sid), sid.name, store.run)


def latest(store: RunStore) -> Located:
    """LATEST when it names a committed snapshot, else the newest committed one."""
    committed = store.committed()
    if not committed:
        fail(f"{store.snapshots_path}: run {store.run!r} has no committed snapshot", 2)
    sid = store.read_pointer("LATEST")
    if sid in committed:
        return Located(store.snapshot_path(sid), sid.name, store.run)
    newest = committed[-1]
    return Located(store.snapshot_path(newest), newest.name, store.run)


def committed_of(store: RunStore) -> List[Located]:
    """Every committed snapshot of a run, oldest first."""
    return [Located(store.snapshot_path(s), s.name, store.run) for s in store.committed()]
