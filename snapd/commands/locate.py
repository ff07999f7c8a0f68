"""The SNAPSHOT and ROOT arguments of the operator commands: find what a user means.

ROOT (or --root) is a directory or a URL (``s3://bucket/prefix``, any fsspec URL;
snapd/roots.py reads either). A SNAPSHOT is one of, tried in this order::

    /path/to/root/gpt/snapshots/00001200   a snapshot directory (any path that exists;
                                           one rank's, or a multi-rank snapshot's)
    /path/to/root/gpt                      a run directory: its LATEST
    s3://bucket/prefix/gpt@1200            a snapshot of the root at that URL (also
                                           URL/RUN/NAME, URL/RUN, URL/RUN@latest)
    gpt/00001200   gpt/1200   gpt/1200.L1  RUN/NAME under --root (the step may be unpadded)
    gpt@1200                               the same
    gpt   gpt@latest                       the run's LATEST; if LATEST is missing or names
                                           no committed snapshot, the newest committed one
                                           (on a URL root: its newest remote commit)
    gpt@best                               the run's BEST pointer

Errors exit with code 2 (nothing to act on: no such path, run, snapshot or pointer)
and name the path that was looked for; a snapshot that exists but is damaged is exit
code 1, with the CorruptSnapshot message and a hint to run ``snapd verify``.
"""

from __future__ import annotations

import os
import re
from contextlib import contextmanager
from typing import Iterator, List, NoReturn, Optional, Tuple

from snapd import format as fmt
from snapd.commands.common import fail, given_root
from snapd.errors import CorruptSnapshot, InvalidOption
from snapd.roots import DiskRoot, Root, Snap, open_root, split_target
from snapd.store import PARTS_PREFIX, TMP_PREFIX, SnapshotId

SNAPSHOT_HELP = ("SNAPSHOT is a snapshot directory, RUN/NAME or RUN@STEP (gpt/00001200, "
                 "gpt@1200), RUN or RUN@latest (its LATEST), or RUN@best, relative to "
                 "--root; or URL/RUN@STEP on a root behind a URL.")
_SPEC = re.compile(r"^(?P<run>[^/@]+)(?:/(?P<name>[^/@]+)|@(?P<at>[^/@]+))?/?$")
_LOOSE_NAME = re.compile(r"^(\d+)(?:\.L(\d+))?$")


def parse_name(text: str) -> Optional[SnapshotId]:
    """A snapshot name, allowing an unpadded step: ``1200``, ``00001200``, ``1200.L1``."""
    match = _LOOSE_NAME.match(text)
    if not match:
        return None
    return SnapshotId(int(match.group(2) or 0), int(match.group(1)))


def root_of(root: Optional[str]) -> Root:
    """The root a command was given (ROOT or --root, a directory or a URL), or exit 2
    naming it."""
    text = given_root(root)
    opened = open_root(text)   # a URL with credentials in it: refused, exit 1
    if not opened.exists():
        fail(f"{text}: no such directory; pass the checkpoint root as ROOT or --root", 2)
    return opened


def run_of(root: Root, run: str) -> str:
    """``run``, or exit 2 naming where it was looked for and the runs there are."""
    if not root.has_run(run):
        fail(f"{root.run_where(run)}: no run {run!r} under {root.where}; runs there: "
             f"{', '.join(root.runs()) or 'none'}", 2)
    return run


def every_commit(root: Root, run: Optional[str]) -> List[Snap]:
    """Every committed snapshot of ``run`` (default: of every run), oldest first."""
    runs = [run_of(root, run)] if run else root.runs()
    return [root.snap(r, sid) for r in runs for sid in root.commits(r)]


def resolve(spec: str, root: Optional[str]) -> Tuple[Root, Snap]:
    """The root and the committed snapshot a SNAPSHOT argument names; exits with code
    2 naming what was looked for when there is none.

    A RUN form that exists under the root wins over a same-named path from here."""
    try:
        where, rest = split_target(spec, given_root(root))
    except InvalidOption as e:
        fail(str(e), 2)
    store = open_root(where)   # a URL with credentials in it: refused, exit 1
    match = _SPEC.match(rest)
    if not (match and store.exists() and store.has_run(match["run"])) \
            and os.path.isdir(rest):
        return _from_directory(os.path.abspath(rest))
    if rest.startswith(("/", "./", "../", "~")) or match is None:
        fail(f"{spec}: no such snapshot directory. {SNAPSHOT_HELP} (see snapd ls)", 2)
    if not store.exists():
        fail(f"{where}: no such directory; pass the checkpoint root as ROOT or --root", 2)
    run = run_of(store, match["run"])
    at = match["name"] or match["at"]
    if at in (None, "latest"):
        return store, _latest(store, run)
    if at == "best" and match["at"]:
        return store, _by_pointer(store, run, "BEST")
    return store, _by_name(store, run, at)


def _from_directory(path: str) -> Tuple[Root, Snap]:
    name = os.path.basename(path)
    if name.startswith(TMP_PREFIX):
        fail(f"{path}: a .tmp- directory is an uncommitted (being written or abandoned) "
             "snapshot and is never read; pick a committed one with snapd ls", 2)
    if name.startswith(PARTS_PREFIX):
        fail(f"{path}: the parts of a multi-rank snapshot not committed globally (a rank's "
             "part is missing); it is never restored and gc removes it. Pick a committed "
             "snapshot with snapd ls", 2)
    if os.path.isdir(os.path.join(path, "snapshots")):  # a run directory
        store = DiskRoot(os.path.dirname(path))
        return store, _latest(store, name)
    if not any(os.path.lexists(os.path.join(path, n))
               for n in (fmt.MANIFEST_NAME, fmt.COMMIT_NAME)):
        fail(f"{os.path.join(path, fmt.MANIFEST_NAME)}: no manifest (nor "
             f"{fmt.COMMIT_NAME}, the record of a multi-rank snapshot), so {path} is not a "
             "snapshot directory; list snapshots with snapd ls --root ROOT", 2)
    parent = os.path.dirname(path)
    in_run = os.path.basename(parent) == "snapshots"
    run = os.path.basename(os.path.dirname(parent)) if in_run else None
    store = DiskRoot(os.path.dirname(os.path.dirname(parent)) if in_run else parent)
    return store, Snap(run, name, path, f"{run}/{name}" if run else path)


def _by_name(store: Root, run: str, text: str) -> Snap:
    sid = parse_name(text)
    if sid is None:
        fail(f"{text!r} is not a snapshot name (the step, as in 00001200 or 1200, then "
             ".L<lineage> for a warm-start lineage); see snapd ls " + run, 2)
    where = store.snapshot_where(run, sid)
    committed = store.commits(run)
    if sid in committed:
        return store.snap(run, sid)
    parts = store.parts_where(run, sid)
    if parts is not None:
        fail(f"{where}: not committed; {parts} holds the parts of some "
             "ranks only, and is never read (snapd ls shows which ranks are missing)", 2)
    have = [s.name for s in committed]
    fail(f"{where}: no such snapshot in run {run!r}; it has "
         f"{', '.join(have[-8:]) if have else 'no committed snapshot'}"
         + (" (newest last; snapd ls shows all)" if len(have) > 8 else ""), 2)


def _by_pointer(store: Root, run: str, which: str) -> Snap:
    sid = store.pointer(run, which)
    pointer = f"{store.run_where(run)}/{which}"
    if sid is None:
        hint = (" BEST is written by retention (the daemon after each commit, or snapd "
                f"gc --run {run}) when snapshots carry a metric." if which == "BEST"
                else "")
        fail(f"{pointer}: missing or not a snapshot name.{hint} Use RUN/NAME instead "
             f"(snapd ls {run})", 2)
    if sid not in store.commits(run):
        fail(f"{pointer} names {sid.name}, which is not a committed snapshot of "
             f"{store.run_where(run)}; use RUN/NAME instead (snapd ls {run})", 2)
    return store.snap(run, sid)


def _latest(store: Root, run: str) -> Snap:
    """LATEST when it names a committed snapshot, else the newest committed one."""
    sid = store.latest(run)
    if sid is None:
        _no_commit(store, run)
    return store.snap(run, sid)


def _no_commit(store: Root, run: str) -> NoReturn:
    fail(f"{store.run_where(run)}/snapshots: run {run!r} has no committed snapshot", 2)


@contextmanager
def files_of(root: Root, snap: Snap) -> Iterator[str]:
    """The directory with every file of ``snap`` (pulled and verified from a root behind
    a URL), or exit 1 naming the damage and what to do."""
    try:
        with root.files(snap) as path:
            yield path
    except CorruptSnapshot as e:
        fail(f"{e}\n  hint: snapd verify {snap.label} names the damage; snapd ls "
             f"{root.where} lists the older snapshots", 1)
