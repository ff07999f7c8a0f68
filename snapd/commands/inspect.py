"""``snapd inspect SNAPSHOT``: what a snapshot holds, from its manifest alone.

No tensor file is read: objects, tensors (path, dtype, shape, bytes, codecs), RNG
streams, the data cursor, lineage, data_version, metric. The files are only stat'ed
against the sizes the manifest declares, and a mismatch is reported, not fatal, so a
damaged snapshot can still be inspected.

A multi-rank snapshot (snapd/commands/inspectparts.py) adds its parts (rank, bytes)
and each tensor's whole shape and placement: sharded, or replicated (stored once, by
which rank), or per rank. RNG streams and cursor shown are rank 0's.
"""

from __future__ import annotations

import time
from typing import Any, Dict, Optional

import click
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from snapd import keepshared
from snapd.commands import inspectparts
from snapd import format as fmt
from snapd.commands.common import (ROOT_HELP, console, cursor_info, emit_json, fail,
                                   files_bytes, files_info, is_multirank, read_manifest)
from snapd.commands.locate import resolve
from snapd.errors import CorruptSnapshot
from snapd.roots import Root, Snap
from snapd.safefiles import read_manifest_bytes
from snapd.humanize import age, count, human_bytes, iso_time, lineage_text


def summary(path: str, manifest: Dict[str, Any]) -> Dict[str, Any]:
    objects = {}
    for name, obj in manifest["objects"].items():
        tensors = [{"path": t["path"], "dtype": t["dtype"], "shape": t["shape"],
                    "bytes": t["nbytes"], "device": t.get("device"),
                    "stored_bytes": sum(c[1] for c in t["chunks"]),
                    "chunks": len(t["chunks"]),
                    "codecs": sorted({c[3] for c in t["chunks"]}),
                    "shared_from": _shared_from(manifest, t)} for t in obj["tensors"]]
        objects[name] = {"type": obj.get("type"), "file": obj.get("file"),
                         "tensors": tensors, "count": len(tensors),
                         "bytes": sum(t["bytes"] for t in tensors),
                         "stored_bytes": sum(t["stored_bytes"] for t in tensors)}
    use = keepshared.usage(manifest)
    return {"path": path, "run": manifest.get("run"), "step": manifest["step"],
            "rank": manifest.get("rank"), "world_size": manifest.get("world_size"),
            "created": manifest.get("created"), "created_iso": iso_time(manifest.get("created")),
            "data_version": manifest.get("data_version"), "metric": manifest.get("metric"),
            "lineage": manifest.get("lineage"),
            "rng": {k: len(v) for k, v in sorted(manifest["rng"].items())},
            "cursor": cursor_info(manifest.get("cursor")), "objects": objects,
            "parts": None, "bytes": files_bytes(manifest), "owned_bytes": use.owned,
            "shared_bytes": use.shared, "shared_with": use.shared_with,
            "files": files_info(manifest),
            "manifest_sha256": fmt.sha256_of(read_manifest_bytes(path)).hex(),
            "signed_by": _signed_by(read_manifest_bytes(path)),
            "files_problem": None}


def _signed_by(data: bytes) -> Optional[str]:
    """The key id (hex) the manifest is signed with (snapd/signing.py), or None."""
    found = fmt.signature_of(data)
    return found[0].hex() if found is not None else None


def _shared_from(manifest: Dict[str, Any], t: Dict[str, Any]) -> Optional[str]:
    """``<snapshot>/<file>`` an entry reads its chunks from, when not its own file."""
    if t.get("src") is None:
        return None
    where = manifest["shared"][t["src"]]
    return f"{where['snapshot']}/{where['file']}"


def _files_text(obj: Dict[str, Any]) -> str:
    """The object's own file, and the earlier snapshots' files it reads."""
    shared = sorted({t["shared_from"] for t in obj["tensors"] if t.get("shared_from")})
    return escape(", ".join(([obj["file"]] if obj["file"] else []) + shared) or "-")


def _shared_text(info: Dict[str, Any]) -> str:
    if not info.get("shared_bytes"):
        return ""
    return (f"  shares {human_bytes(info['shared_bytes'])} of "
            + ", ".join(info["shared_with"]) + "'s files")


def _render_sha256(info: Dict[str, Any], console: Console) -> None:
    """Each file's SHA-256 as ``sha256sum`` prints it (run in the snapshot directory,
    ``sha256sum -c`` checks these lines), or why there is none."""
    files = {name: entry for name, entry in (info.get("files") or {}).items()}
    for part in info.get("parts") or []:
        files.update((f"{part['dir']}/{name}", entry)
                     for name, entry in (part.get("files") or {}).items())
    if not files:
        return
    if any(entry["sha256"] is None for entry in files.values()):
        console.print("  sha256: no SHA-256 recorded (format 4 or older, or option "
                      "sha256 off)", highlight=False)
        return
    console.print("  sha256 (sha256sum -c in the snapshot directory):", highlight=False)
    for name, entry in files.items():
        console.print(f"    {entry['sha256']}  {escape(name)}", highlight=False)


def render(info: Dict[str, Any], console: Console) -> None:
    created = info["created"]
    metric = "-" if info["metric"] is None else f"{info['metric']:.6g}"
    console.print(
        f"[bold]{escape(info['path'])}[/bold]\n"
        f"  run {escape(str(info['run']))}  step {info['step']}  "
        + (f"{info['world_size']} ranks" if info["parts"] else
           f"rank {info['rank']} of {info['world_size']}") + f"  metric {metric}\n"
        f"  created {info['created_iso']} "
        f"({age(None if created is None else time.time() - created)} ago)"
        f"  data_version {escape(repr(info['data_version']))}\n"
        f"  lineage {escape(lineage_text(info['lineage']))}  files {human_bytes(info['bytes'])}"
        + _shared_text(info), highlight=False)
    if info["files_problem"]:
        console.print(f"  [red]files: {escape(info['files_problem'])}[/red]", highlight=False)
    if info["parts"]:
        console.print("  parts: " + ", ".join(f"rank {p['rank']} {human_bytes(p['bytes'])}"
                                              for p in info["parts"]), highlight=False)
    _render_sha256(info, console)
    objects = Table(title="objects", title_justify="left", box=box.SIMPLE_HEAD,
                    padding=(0, 1, 0, 0), pad_edge=False)
    for column in ("object", "type", "tensors", "bytes", "stored", "file"):
        objects.add_column(column, justify="right" if column in ("tensors", "bytes",
                                                                  "stored") else "left")
    for name, obj in info["objects"].items():
        objects.add_row(name, obj["type"], str(obj["count"]), human_bytes(obj["bytes"]),
                        human_bytes(obj["stored_bytes"]), _files_text(obj))
    console.print(objects)
    for name, obj in info["objects"].items():
        if not obj["tensors"]:
            continue
        table = Table(title=f"{name} tensors", title_justify="left",
                      box=box.SIMPLE_HEAD, padding=(0, 1, 0, 0), pad_edge=False)
        columns = ("path", "dtype", "shape", "bytes", "codec") + \
            (("placement",) if info["parts"] else ())
        for column in columns:
            table.add_column(column, justify="right" if column == "bytes" else "left")
        for t in obj["tensors"]:
            codec = "+".join(t["codecs"]) + (f" x{t['chunks']}" if t["chunks"] > 1 else "")
            cells = [escape(t["path"]), t["dtype"], str(tuple(t["shape"])),
                     human_bytes(t["bytes"]), codec]
            if info["parts"]:
                cells.append(inspectparts.placement_text(t))
            table.add_row(*cells)
        console.print(table)
    console.print("rng streams: " + (", ".join(f"{k} ({v} B)" for k, v in info["rng"].items())
                                     or "none"), highlight=False)
    cursor = info["cursor"]
    if cursor is None:
        console.print("cursor: none (the run does not use Client.batches)", highlight=False)
    else:
        console.print(f"cursor: epoch {cursor['epoch']}, "
                      f"{count(cursor['index'], 'batch', 'batches')} consumed"
                      f"{'' if cursor['epoch_opened'] else ' (epoch not opened yet)'}; "
                      f"positioning: {cursor['positioning']}"
                      f"{'; persistent workers' if cursor['persistent_workers'] else ''}",
                      highlight=False)


@click.command()
@click.argument("snapshot")
@click.option("--root", help=ROOT_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
def inspect(snapshot: str, root: Optional[str], as_json: bool) -> None:
    """What SNAPSHOT holds, from its manifest only: objects, tensors (dtype, shape,
    bytes, codec), RNG streams, data cursor, lineage, data_version, metric. A
    multi-rank snapshot: its parts (rank, bytes), whole shapes, and which tensors
    are sharded and which replicated (stored once, by which rank).

    SNAPSHOT is a snapshot directory, RUN/NAME (gpt/00001200 or gpt/1200), RUN or
    RUN@latest (its LATEST), or RUN@best, relative to --root; or URL/RUN@STEP on a
    root behind a URL (its manifests fetched, the files checked in the listing).

    Example: snapd inspect gpt-small@latest --root checkpoints
    """
    found, snap = resolve(snapshot, root)
    try:
        with found.manifests(snap) as path:
            info = inspectparts.summary(path) if is_multirank(path) else \
                summary(path, read_manifest(path))
    except CorruptSnapshot as e:
        fail(f"{e}\n  hint: the manifest is damaged; pick an older snapshot (snapd ls)", 1)
    info.update(path=snap.where, snapshot=snap.label,
                files_problem=info["files_problem"] or _files_problem(found, snap))
    info.setdefault("owned_bytes", info.get("bytes"))   # many ranks, remote: never shared
    info.setdefault("shared_bytes", 0)
    info.setdefault("shared_with", [])
    if as_json:
        emit_json(info)
    else:
        render(info, console())


def _files_problem(root: Root, snap: Snap) -> Optional[str]:
    """What is wrong with the snapshot's files (each listed file there at its size;
    behind a URL, in the listing), or None; nothing is read."""
    try:
        root.check_files(snap)
    except CorruptSnapshot as e:
        return str(e)
    return None
