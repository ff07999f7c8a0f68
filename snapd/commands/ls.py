"""``snapd ls [RUN]``: the committed snapshots of a root, one row each.

Marks: LATEST and BEST (the pointers), PINNED (kept by retention until ``snapd
unpin``: the newest snapshot before an anomaly in the logged loss, snapd/pins.py).

By default only manifests are read (and the files stat'ed against their declared
sizes), so listing costs milliseconds per snapshot whatever their size; ``--verify``
reads every byte and checks every checksum, as ``snapd verify`` does.

A multi-rank snapshot is one row: its world size and the bytes of all its parts (each
part's manifest checked against the commit record). The ``.parts-<name>`` directories
of snapshots some rank never completed are listed after the table as incomplete, with
the ranks present and missing: they are never restored, and gc removes them.

``size`` is the bytes of a snapshot's own files; ``shared`` the stored bytes of the
chunks it reads from earlier snapshots' files (format v4, snapd/keepshared.py's
``usage``): what it holds only by reference.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional

import click
from rich import box
from rich.markup import escape
from rich.table import Table

from snapd import format as fmt
from snapd import keepshared
from snapd.commands.common import ROOT_HELP, console as out_console, emit_json, files_bytes
from snapd.commands.locate import root_of, run_of
from snapd.commands.verify import check
from snapd.errors import CorruptSnapshot
from snapd.globalsnap import GlobalSnapshot, open_snapshot
from snapd.roots import Root, Snap, root_argument
from snapd.humanize import age, human_bytes, iso_time, lineage_text


def describe(root: Root, snap: Snap, *, verify: bool, marks: List[str]) -> Dict[str, Any]:
    """One snapshot as plain data. ``verified`` is "manifest ok" (its manifests decode
    and its files are there at their sizes), "ok" (--verify), or "DAMAGED" with the
    reason in ``error``."""
    row: Dict[str, Any] = {"run": snap.run, "name": snap.name, "path": snap.where,
                           "marks": marks, "step": None, "lineage": None, "bytes": None,
                           "owned_bytes": None, "shared_bytes": None, "shared_with": [],
                           "metric": None, "created": None, "world_size": None,
                           "verified": "unverified", "error": None,
                           "sha256": None, "signed_by": None}
    try:
        with root.manifests(snap) as path:
            opened = open_snapshot(path, check_files=False)
            m = opened.manifest   # many ranks: every part's manifest, checked against the record
            top = opened.record_bytes if isinstance(opened, GlobalSnapshot) else \
                opened.manifest_bytes
        root.check_files(snap)
    except CorruptSnapshot as e:
        row.update(verified="DAMAGED", error=str(e))
        return row
    except OSError as e:
        row.update(verified="DAMAGED", error=f"{e.filename or snap.where}: cannot be read "
                                             f"({e.strerror})")
        return row
    many = isinstance(opened, GlobalSnapshot)
    row["world_size"] = opened.world_size if many else 1
    # Bytes its own files hold, and those it reads from earlier snapshots' files
    # (many ranks never share).
    use = keepshared.Usage(files_bytes(m), 0, []) if many else keepshared.usage(m)
    row.update(owned_bytes=use.owned, shared_bytes=use.shared, shared_with=use.shared_with)
    row.update(step=m["step"], lineage=m.get("lineage"), bytes=files_bytes(m),
               metric=m.get("metric"), created=m.get("created"),
               data_version=m.get("data_version"), verified="manifest ok")
    # The SHA-256 of its top file (manifest, or many ranks' commit record): it pins
    # every file's (docs/operations.md, "Tamper evidence"); the key id that signed it.
    signature = fmt.signature_of(top)
    row.update(sha256=fmt.sha256_of(top).hex(),
               signed_by=signature[0].hex() if signature is not None else None)
    if verify:  # the same checks as snapd verify: every byte, every skeleton
        result = check(root, snap)
        row.update(verified="ok" if result["ok"] else "DAMAGED", error=result["error"])
    return row


def collect(root: Root, runs: List[str], verify: bool) -> List[Dict[str, Any]]:
    rows = []
    for run in runs:
        pointers = {which: root.pointer(run, which) for which in ("LATEST", "BEST")}
        pinned = set(root.pinned(run))
        for sid in root.commits(run):
            marks = [which for which, target in pointers.items() if target == sid]
            if sid in pinned:   # kept by retention until snapd unpin (snapd/pins.py)
                marks.append("PINNED")
            rows.append(describe(root, root.snap(run, sid), verify=verify, marks=marks))
    return rows


def render(rows: List[Dict[str, Any]], now: float, with_run: bool = True) -> Table:
    """The table; ``with_run=False`` leaves out the run column (one run listed)."""
    table = Table(box=box.SIMPLE_HEAD, padding=(0, 1, 0, 0), pad_edge=False)
    columns = ("run", "snapshot", "marks", "step", "lineage", "ranks", "size", "shared",
               "metric", "created", "age", "verified")[0 if with_run else 1:]
    for column in columns:
        table.add_column(column, no_wrap=column != "lineage",
                         min_width=8 if column == "lineage" else None,
                         justify="right" if column in ("step", "ranks", "size", "shared",
                                                       "metric", "age") else "left")
    for r in rows:
        created = iso_time(r["created"])
        cells = [
            r["run"], r["name"], " ".join(r["marks"]),
            "-" if r["step"] is None else str(r["step"]),
            "-" if r["lineage"] is None else lineage_text(r["lineage"], r["run"]),
            "-" if r["world_size"] is None else str(r["world_size"]),
            human_bytes(r.get("owned_bytes", r["bytes"])),   # a remote row: its bytes
            human_bytes(r["shared_bytes"]) if r.get("shared_bytes") else "-",
            "-" if r["metric"] is None else f"{r['metric']:.4g}",
            created[5:16].replace("T", " ") if created else "-",
            age(None if r["created"] is None else now - r["created"]),
            "[red]DAMAGED[/red]" if r["verified"] == "DAMAGED" else r["verified"]]
        table.add_row(*cells[0 if with_run else 1:])
    return table


@click.command()
@click.argument("run", required=False)
@click.option("--root", help=ROOT_HELP)
@click.option("--verify", is_flag=True,
              help="Read every file and check every checksum (slow: reads all bytes).")
@click.option("--json", "as_json", is_flag=True, help="Print the list as JSON.")
def ls(run: Optional[str], root: Optional[str], verify: bool, as_json: bool) -> None:
    """Committed snapshots of RUN (default: every run): step, lineage, ranks, size
    (all parts), bytes read from earlier snapshots' files (shared), metric, age, verification state, and the LATEST/BEST/PINNED marks; then the
    incomplete multi-rank snapshots (ranks present and missing). Exit code 1 if
    --verify (or a manifest) finds damage.

    ROOT may be a URL (snapd ls s3://bucket/prefix, or RUN --root URL): its remote
    commits, the same columns (--verify pulls each and checks every checksum).

    Example: snapd ls gpt-small --root checkpoints --verify
    """
    base, run = root_argument(run, root)
    found = root_of(base)
    runs = [run_of(found, run)] if run else found.runs()
    rows = collect(found, runs, verify)
    waiting = [entry for r in runs for entry in found.unfinished(r)]
    if as_json:
        emit_json({"root": found.where, "snapshots": rows, "incomplete": waiting})
    else:
        console = out_console()
        if not rows:
            click.echo(f"no committed snapshot under {found.where}"
                       + (f" for run {run!r}" if run else ""))
        else:
            console.print(render(rows, time.time(), with_run=run is None))
        for r in rows:
            if r["error"]:
                console.print(f"[red]{r['run']}/{r['name']}[/red]: {escape(r['error'])}",
                              highlight=False, soft_wrap=True)
        for entry in waiting:
            console.print(escape(entry["line"]), highlight=False, soft_wrap=True)
    if any(r["verified"] == "DAMAGED" for r in rows):
        raise SystemExit(1)
