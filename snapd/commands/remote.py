"""The operator commands on a remote root (``s3://bucket/prefix``, ``file:///mnt/x``).

``snapd ls/inspect/verify/export/status`` take a URL where they take a root, or a
SNAPSHOT of the form ``URL/RUN@STEP``; each command calls in here when it sees one
(inspect's and status's remote views live in those commands, which import this
module, never the other way).
Only remotely committed snapshots are shown or read (docs/remote.md, the commit
rule). ``ls`` and ``status`` read records (and ``status`` the replicated log);
``inspect`` reads the manifest; ``verify`` and ``export`` pull the snapshot into a
temporary directory (snapd/remote/pull.py, every checksum checked) and work on it
there. A remote snapshot's target is::

    URL/RUN  URL/RUN@latest        the run's newest remote commit
    URL/RUN@1200  URL/RUN/00001200 that snapshot (or RUN@1200 with --root URL)
"""

from __future__ import annotations

import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

from snapd.commands.common import fail
from snapd.commands.locate import Located, locate, parse_name
from snapd.errors import CorruptSnapshot
from snapd.remote.layout import RemoteRoot
from snapd.remote.pull import pull, reaching, refuse_credentials
from snapd.store import RunStore, SnapshotId, check_run_name


def is_url(text: Optional[str]) -> bool:
    return bool(text) and "://" in text


def open_remote(url: str) -> RemoteRoot:
    """The remote root a user named (never with credentials in it)."""
    return RemoteRoot(refuse_credentials(url, where="snapd"))


@dataclass(frozen=True)
class Target:
    remote: RemoteRoot
    run: str
    name: str

    @property
    def label(self) -> str:
        """``URL/RUN@STEP`` (the name where a lineage makes the step ambiguous)."""
        sid = SnapshotId.parse(self.name)
        return f"{self.remote.url}/{self.run}@{sid.step if not sid.lineage else self.name}"


def split(spec: Optional[str], root: Optional[str]) -> Tuple[str, str]:
    """(url, the run part) of ``URL/RUN@STEP``, or of ``RUN@STEP`` with ``--root URL``."""
    if is_url(root):
        if not spec:
            fail("name the run: RUN, RUN@STEP or RUN/NAME with --root URL", 2)
        return root, spec
    url, _, target = (spec or "").rstrip("/").rpartition("/")
    if "@" not in target and parse_name(target) is not None and "/" in url:
        url, _, run = url.rpartition("/")   # URL/RUN/NAME
        target = f"{run}/{target}"
    if not url.partition("://")[2]:
        fail(f"{spec}: name the run after the remote root, as in "
             "s3://bucket/prefix/RUN@1200", 2)
    return url, target


def target(spec: Optional[str], root: Optional[str]) -> Target:
    """The remotely committed snapshot a SNAPSHOT argument names, or exit 2 saying
    what the remote has."""
    url, text = split(spec, root)
    remote = open_remote(url)
    run, _, rest = text.replace("/", "@", 1).partition("@")
    try:
        check_run_name(run)
    except ValueError as e:
        fail(str(e), 2)
    with reaching(remote, f"listing the commits of {run}"):
        commits = remote.commits(run)
    if not commits:
        fail(f"{remote.url}/{run}: no remotely committed snapshot (runs there: "
             f"{', '.join(remote.runs()) or 'none'})", 2)
    if rest in ("", "latest"):
        return Target(remote, run, commits[-1].name)
    sid = parse_name(rest)
    if sid is None or sid not in commits:
        fail(f"{remote.url}/{run}@{rest}: no such remote commit; it has "
             f"{', '.join(s.name for s in commits[-8:])}", 2)
    return Target(remote, run, sid.name)


@contextmanager
def located(spec: str, root: Optional[str]) -> Iterator[Located]:
    """Where SNAPSHOT is on a local disk: as :func:`locate` finds it, or pulled from
    the remote into a temporary directory removed afterwards (exit 1 on damage)."""
    if not (is_url(spec) or is_url(root)):
        yield locate(spec, root)
        return
    t = target(spec, root)
    with tempfile.TemporaryDirectory(prefix="snapd-pull-") as tmp:
        try:
            path = pull(t.remote, RunStore(tmp, t.run), t.name, min_free_bytes=0)
        except CorruptSnapshot as e:
            fail(f"{e}\n  hint: snapd verify {t.label} names the damage; snapd ls "
                 f"{t.remote.url} lists the older remote commits", 1)
        yield Located(path, t.name, t.run)


# --- ls -------------------------------------------------------------------------------

def ls_rows(url: str, run: Optional[str], verify: bool) -> Tuple[List[Dict[str, Any]],
                                                                 List[Dict[str, Any]]]:
    """The rows ``snapd ls`` shows for a remote root: one per remote commit, from its
    record (``--verify``: pulled and every checksum checked), and the names with files
    but no record (an upload in progress or abandoned)."""
    remote = open_remote(url)
    with reaching(remote, "listing the runs"):
        runs = [run] if run else remote.runs()
        rows, waiting = [], []
        for r in runs:
            commits = remote.commits(r)
            rows += [_record_row(remote, r, sid, verify, sid == commits[-1])
                     for sid in commits]
            waiting += [{"run": r, "name": n, "path": remote.where(remote.snapshot_path(r, n))}
                        for n in remote.snapshot_names(r)
                        if SnapshotId.parse(n) not in commits]
    return rows, waiting


def _record_row(remote: RemoteRoot, run: str, sid: SnapshotId, verify: bool,
                newest: bool) -> Dict[str, Any]:
    row: Dict[str, Any] = {"run": run, "name": sid.name, "marks": ["NEWEST"] if newest else [],
                           "path": remote.where(remote.record_path(run, sid.name)),
                           "step": sid.step, "lineage": {"id": sid.lineage}, "bytes": None,
                           "metric": None, "created": None, "world_size": None,
                           "verified": "record ok", "error": None}
    try:
        record = remote.read_record(run, sid.name)
    except CorruptSnapshot as e:
        row.update(verified="DAMAGED", error=str(e))
        return row
    row.update(bytes=record["bytes"], created=record["uploaded_at"],
               world_size=record["world_size"])
    if verify:
        result = verify_one(Target(remote, run, sid.name))
        row.update(verified="ok" if result["ok"] else "DAMAGED", error=result["error"])
    return row


def waiting_line(entry: Dict[str, Any]) -> str:
    return (f"{entry['run']}/{entry['name']}: files without a remote commit record "
            f"({entry['path']}): an upload in progress or abandoned; never read")


# --- verify ---------------------------------------------------------------------------

def verify_targets(spec: Optional[str], all_: bool, run: Optional[str],
                   root: Optional[str]) -> List[Target]:
    if spec and not (all_ or run):
        return [target(spec, root)]
    url = root if is_url(root) else spec
    remote = open_remote(url)
    with reaching(remote, "listing the runs"):
        return [Target(remote, r, sid.name) for r in ([run] if run else remote.runs())
                for sid in remote.commits(r)]


def verify_one(t: Target) -> Dict[str, Any]:
    """``snapd verify``'s verdict for a remote commit: pulled into a temporary
    directory, which checks every file, size and checksum, then removed."""
    result: Dict[str, Any] = {"snapshot": t.label, "path": t.remote.where(
        t.remote.snapshot_path(t.run, t.name)), "ok": False, "bytes": None, "error": None,
        "file": None, "field": None, "world_size": None, "rank": None}
    with tempfile.TemporaryDirectory(prefix="snapd-verify-") as tmp:
        try:
            record = t.remote.read_record(t.run, t.name)
            result.update(bytes=record["bytes"], world_size=record["world_size"])
            pull(t.remote, RunStore(tmp, t.run), t.name, min_free_bytes=0)
            result["ok"] = True
        except CorruptSnapshot as e:
            result.update(error=str(e), file=e.path, field=e.field)
    return result
