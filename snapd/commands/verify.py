"""``snapd verify SNAPSHOT | --all``: read every byte, check every checksum.

The manifest's header checksum and structure, each file's size, every chunk's xxh3
(and zstd length), every tensor's checksum after decoding, every file's own
checksum and (format 5) SHA-256, and that each object's skeleton decodes against its tensors: everything a
restore would check, without loading anything into a training process. Exit code 1
names the first damaged file, tensor and chunk of each bad snapshot.

A multi-rank snapshot is checked whole: its commit record, every part's manifest
against it, every ``ref`` entry (the rank it names holds the tensor), then every
part's files as above. A failure names the rank and the file.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

import click
from rich.console import Console
from rich.markup import escape
from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn,
                           TimeRemainingColumn, TransferSpeedColumn)

from snapd import keepshared
from snapd.commands import verifysha
from snapd.commands.common import ROOT_HELP, emit_json
from snapd.commands.locate import every_commit, resolve, root_of
from snapd.errors import SnapdError
from snapd.options import Options
from snapd.signing import Keys, load_keys
from snapd.globalsnap import GlobalSnapshot, open_snapshot
from snapd.reader import SnapshotReader, check_name_matches
from snapd.roots import Root, Snap
from snapd.skeleton import unflatten
from snapd.humanize import human_bytes


Advance = Optional[Callable[[int], None]]


def check(root: Root, snap: Snap, advance: Advance = None,
          logs: Optional[str] = None, keys: Optional[Keys] = None) -> Dict[str, Any]:
    """Verify one snapshot; a plain-data verdict (``ok``, and ``error``/``file``/``field``,
    and for a multi-rank snapshot ``world_size`` and the ``rank`` whose part failed).
    On a root behind a URL the files are pulled into a temporary directory (which
    checks every size and checksum as it commits them there) and checked there.
    ``logs``: the root's logs (``root.logs()``), against which a one-rank manifest's
    SHA-256 is checked as restore checks it (``log``: "match", "no record");
    ``keys``: this process's signing keys, with which the manifest (or commit record)
    must be signed, as a client with them requires (``signed_by``: the key id)."""
    result: Dict[str, Any] = {"snapshot": snap.label, "path": snap.where, "ok": False,
                              "bytes": None, "error": None, "file": None, "field": None,
                              "world_size": None, "rank": None, "owned_bytes": None,
                              "shared_bytes": 0, "shared_with": [], "sha256": None,
                              "log": None, "signed_by": None}
    try:
        with root.files(snap) as path:
            _check_directory(path, result, advance)
            result["signed_by"] = verifysha.check_signature(path, keys)
            if logs is not None and result["world_size"] == 1:
                result["log"] = verifysha.against_log(path, snap, logs)
        result["ok"] = True
    except SnapdError as e:   # CorruptSnapshot, and DanglingReference (refs check)
        where = f"rank {result['rank']}: " if result["rank"] is not None else ""
        result.update(error=where + str(e), file=e.path, field=e.field)
    except OSError as e:
        result.update(error=f"{e.filename or snap.where}: cannot be read ({e.strerror})",
                      file=e.filename)
    return result


def _check_directory(path: str, result: Dict[str, Any], advance: Advance) -> None:
    snap = open_snapshot(path)
    if isinstance(snap, GlobalSnapshot):
        _check_parts(snap, result, advance)
        result["sha256"] = _sha256_word([snap.part(r) for r in range(snap.world_size)])
        return
    result["sha256"] = _sha256_word([snap])
    check_name_matches(path, snap.manifest)
    use = keepshared.usage(snap.manifest)
    # Checked: its own files, and the chunks it reads from earlier snapshots'.
    result.update(world_size=1, bytes=use.owned + use.shared, owned_bytes=use.owned,
                  shared_bytes=use.shared, shared_with=use.shared_with)
    _check_files(snap, advance)


def _sha256_word(readers: List[SnapshotReader]) -> str:
    """Whether the files' SHA-256s are checked too: "checked" when every file has one
    (format 5, option sha256 on), else "no SHA-256 recorded" (for some files)."""
    entries = [e for r in readers for e in r.manifest["files"].values()]
    if entries and all("sha256" in e for e in entries):
        return "checked"
    return "no SHA-256 recorded" if not any("sha256" in e for e in entries) else \
        "no SHA-256 recorded for some files"


def _check_files(reader: SnapshotReader, advance: Advance) -> None:
    """Every object's file read and checked, its skeleton decoded against its tensors
    (in a part, a ``ref`` entry is None: its bytes are checked in the owner's part)."""
    for name, entry in reader.objects.items():
        tensors = reader.load_object(name, advance)
        unflatten(entry["skeleton"], tensors,
                  source=os.path.join(reader.path, entry.get("file") or "manifest.snapd"))


def _check_parts(snap: GlobalSnapshot, result: Dict[str, Any], advance: Advance) -> None:
    """Every part's manifest against the record, every reference, every part's files.
    ``result["rank"]`` is the rank being checked when an error escapes."""
    result.update(world_size=snap.world_size, bytes=snap.record.get("bytes"),
                  owned_bytes=snap.record.get("bytes"))
    for rank in range(snap.world_size):
        result["rank"] = rank
        snap.part(rank)
    result["rank"] = None
    snap.check_references()   # its message names the rank that refers
    for rank in range(snap.world_size):
        result["rank"] = rank
        _check_files(snap.part(rank), advance)
    result["rank"] = None


def checked_text(r: Dict[str, Any]) -> str:
    """``1.2 MiB checked``, and how much of it other snapshots' files hold."""
    text = f"{human_bytes(r['bytes'])} checked"
    if r.get("sha256"):
        text += f", SHA-256 {r['sha256']}" if r["sha256"] == "checked" else \
            f", {r['sha256']}"
    if r.get("log") == "match":
        text += ", manifest as logged"
    if r.get("shared_bytes"):
        text += (f", {human_bytes(r['shared_bytes'])} of them shared with "
                 + ", ".join(r["shared_with"]))
    return text


def _targets(snapshot: Optional[str], all_: bool, run: Optional[str],
             root: Optional[str]) -> Tuple[Root, List[Snap]]:
    if snapshot and (all_ or run):
        raise click.UsageError("give a SNAPSHOT, or --all (with --run RUN), not both")
    if snapshot:
        found, snap = resolve(snapshot, root)
        return found, [snap]
    if not all_ and not run:
        raise click.UsageError("give a SNAPSHOT to verify, or --all (--run RUN: one run)")
    found = root_of(root)
    return found, every_commit(found, run)


def _planned_bytes(root: Root, targets: List[Snap]) -> int:
    """Bytes the chunks of every target hold (what the bar advances by); 0 if unknown."""
    total = 0
    for snap in targets:
        try:
            with root.manifests(snap) as path:
                opened = open_snapshot(path, check_files=False)
                parts = opened.parts() if isinstance(opened, GlobalSnapshot) else [opened]
        except (SnapdError, OSError):
            continue
        total += sum(c[1] for part in parts for obj in part.objects.values()
                     for t in obj["tensors"] for c in t["chunks"])
    return total


def run_checks(root: Root, targets: List[Snap], show_progress: bool,
               keys: Optional[Keys] = None) -> List[Dict[str, Any]]:
    with root.logs() as logs:
        return _run_checks(root, targets, show_progress, logs, keys)


def _run_checks(root: Root, targets: List[Snap], show_progress: bool,
                logs: str, keys: Optional[Keys]) -> List[Dict[str, Any]]:
    if not show_progress:
        return [check(root, snap, logs=logs, keys=keys) for snap in targets]
    progress = Progress(TextColumn("verify {task.description}"), BarColumn(),
                        DownloadColumn(binary_units=True), TransferSpeedColumn(),
                        TimeRemainingColumn(), console=Console(stderr=True),
                        transient=True)
    results = []
    with progress:
        task = progress.add_task("", total=_planned_bytes(root, targets) or None)
        for snap in targets:
            progress.update(task, description=snap.label)
            results.append(check(root, snap, lambda n: progress.advance(task, n), logs,
                                 keys))
    return results


@click.command()
@click.argument("snapshot", required=False)
@click.option("--all", "all_", is_flag=True,
              help="Verify every committed snapshot of every run (or of --run).")
@click.option("--run", help="Verify every committed snapshot of this run (implies --all).")
@click.option("--root", help=ROOT_HELP)
@click.option("--progress/--no-progress", default=None,
              help="Progress bar on stderr (default: when stderr is a terminal).")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
@click.option("--sha256", "sha256_only", is_flag=True,
              help="Only the quick audit: each file's SHA-256 against the manifest, and "
                   "the manifest's against the state log's record of its commit.")
def verify(snapshot: Optional[str], all_: bool, run: Optional[str], root: Optional[str],
           progress: Optional[bool], as_json: bool, sha256_only: bool) -> None:
    """Read every file of SNAPSHOT and check every checksum. Exit code 0 when all is
    good, 1 when any snapshot is damaged (naming the file, tensor and chunk), 2 when
    there is nothing to verify. Files of format 5 are checked against their SHA-256
    too ("no SHA-256 recorded" for older ones); --sha256 checks only those, and the
    manifest against the state log (docs/operations.md, "Tamper evidence"). With a
    signing key in the environment (SNAPD_SIGNING_KEY or SNAPD_SIGNING_KEY_FILE), each
    manifest or commit record must be signed with an accepted key.

    SNAPSHOT is a snapshot directory, RUN/NAME or RUN@STEP (gpt/00001200, gpt@1200),
    RUN or RUN@latest (its LATEST), or RUN@best, relative to --root. On a root behind
    a URL (URL/RUN@STEP, or RUN@STEP --root URL; --all --root URL) each snapshot is
    pulled into a temporary directory and checked there.

    Example: snapd verify --all --root checkpoints
    """
    found, targets = _targets(snapshot, all_, run, root)
    if not targets:
        click.echo("no committed snapshot to verify", err=True)
        raise SystemExit(2)
    show = sys.stderr.isatty() if progress is None else progress
    # With a signing key (SNAPD_SIGNING_KEY, SNAPD_SIGNING_KEY_FILE), signatures too.
    keys = load_keys(Options.resolve().signing_key_file)
    results = [verifysha.audit(found, snap, keys) for snap in targets] if sha256_only \
        else run_checks(found, targets, show, keys)
    bad = [r for r in results if not r["ok"]]
    if as_json:
        emit_json({"ok": not bad, "snapshots": results})
    else:
        console = Console(highlight=False, soft_wrap=True)
        for r in results:
            if r["ok"]:
                said = verifysha.audit_text(r) if sha256_only else checked_text(r)
                console.print(f"[green]ok[/green]      {escape(r['snapshot'])}  "
                              f"({escape(said)})")
            else:
                console.print(f"[red]DAMAGED[/red] {escape(r['snapshot'])}: "
                              f"{escape(r['error'])}")
        if bad:
            console.print(f"{len(bad)} of {len(results)} damaged. A damaged snapshot is "
                          "never restored from (restore falls back to the previous good "
                          "one); keep it for diagnosis or remove its directory. See "
                          "docs/operations.md, 'damaged snapshot'.")
    if bad:
        raise SystemExit(1)
