"""What the operator commands share: root resolution, JSON output, error exits, and
reading a snapshot (exiting with the reason when it cannot be read)."""

from __future__ import annotations

import importlib
import json
import os
import sys
from typing import Any, Dict, List, NoReturn, Optional, Union

import click
from rich.console import Console

from snapd import format as fmt
from snapd.errors import CorruptSnapshot
from snapd.globalsnap import GlobalSnapshot, open_snapshot
from snapd.reader import SnapshotReader, check_real_directories
from snapd.safefiles import read_manifest_bytes

# Either kind of committed snapshot: one rank's directory, or a multi-rank snapshot
# read through its commit record (snapd/globalsnap.py). Both have ``path``, ``step``,
# ``manifest`` (whole-job summary for many ranks), ``objects`` and ``load_object``.
Snapshot = Union[SnapshotReader, GlobalSnapshot]

ROOT_HELP = "The checkpoint root (default: $SNAPD_ROOT, else the current directory)."

# Piped or redirected output is read by programs and people's pagers: rows are never
# cut to a guessed terminal width (rich assumes 80 columns without a terminal).
PIPE_WIDTH = 1 << 16


def given_root(root: str | None) -> str:
    """The root a command was given: ROOT or --root, else $SNAPD_ROOT, else the
    current directory. The one place SNAPD_ROOT is read; not checked (``watch``
    waits for it to appear, ``pull`` creates it)."""
    return root or os.environ.get("SNAPD_ROOT") or "."


def resolve_root(root: str | None) -> str:
    """The given root as an absolute path; exits 2 when it is not a directory."""
    root = given_root(root)
    if not os.path.isdir(root):
        fail(f"{root}: no such directory; pass the checkpoint root as ROOT or --root", 2)
    return os.path.abspath(root)


def run_dir(root: str, run: str) -> str:
    path = os.path.join(root, run)
    if not os.path.isdir(path):
        runs = sorted(n for n in os.listdir(root) if os.path.isdir(os.path.join(root, n))
                      and not n.startswith("."))
        fail(f"{path}: no run {run!r} under {root}; runs there: {', '.join(runs) or 'none'}",
             2)
    return path


def emit_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2, sort_keys=True, default=str)
    sys.stdout.write("\n")


def console(**kwargs: Any) -> Console:
    """The console a command prints tables to: the terminal's width on a terminal,
    else wide enough that no row is cut or wrapped."""
    if not sys.stdout.isatty():
        kwargs.setdefault("width", PIPE_WIDTH)
    return Console(**kwargs)


def fail(message: str, code: int = 1) -> NoReturn:
    click.echo(f"snapd: error: {message}", err=True)
    sys.exit(code)


def optional_import(module: str, command: str, extra: str) -> Any:
    """A module only one command needs, declared as the extra ``snapd[extra]``; when it
    is not installed, exit 1 with the line that installs it, not a traceback."""
    try:
        return importlib.import_module(module)
    except ImportError:
        fail(f"snapd {command} needs {module.split('.')[0]}: "
             f"pip install 'snapd[{extra}]'", 1)


# --- reading a snapshot ------------------------------------------------------------

def open_reader(path: str, objects: Optional[List[str]] = None) -> Snapshot:
    """Either kind of snapshot, its manifests verified (and file sizes checked; for
    many ranks every part against the commit record), or exit 1 with the reason.
    ``objects``: of a one-rank snapshot, only these objects' files are checked now
    (each file is checked again when read), so that reading the weights does not
    need the optimizer's file."""
    try:
        snap = open_snapshot(path) if objects is None or is_multirank(path) \
            else SnapshotReader(path, objects)
        if isinstance(snap, GlobalSnapshot):
            snap.parts()   # every part now, so a damaged one is named here
        return snap
    except CorruptSnapshot as e:
        fail(f"{e}\n  hint: snapd verify {path} checks every file; an older "
             "snapshot is listed by snapd ls", 1)
    except OSError as e:
        fail(f"{e.filename or path}: cannot be read ({e.strerror})", 2)


def is_multirank(path: str) -> bool:
    """A snapshot directory of many ranks (it holds a commit record)."""
    return os.path.lexists(os.path.join(path, fmt.COMMIT_NAME))


def read_manifest(path: str) -> Dict[str, Any]:
    """The manifest alone (no tensor file is opened or stat'ed), or exit 1. For a
    multi-rank snapshot: the whole job's summary (snapd.globalsnap), from the commit
    record and the parts' manifests."""
    manifest_path = os.path.join(path, fmt.COMMIT_NAME if is_multirank(path)
                                 else fmt.MANIFEST_NAME)
    try:
        check_real_directories(path)
        if is_multirank(path):
            return GlobalSnapshot(path).manifest
        return fmt.decode_manifest(read_manifest_bytes(path), path=manifest_path)
    except OSError as e:
        fail(f"{manifest_path}: cannot be read ({e.strerror})", 2)
    except CorruptSnapshot as e:
        fail(f"{e}\n  hint: the manifest is damaged; pick an older snapshot (snapd ls)", 1)


def files_info(manifest: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    """Each file the manifest lists: size, xxh3 and SHA-256 (hex, what ``sha256sum``
    prints; None when the manifest records none: format 4 or older, option
    ``sha256`` off)."""
    return {name: {"size": entry["size"], "xxh3": entry["xxh3"],
                   "sha256": entry["sha256"].hex() if "sha256" in entry else None}
            for name, entry in sorted(manifest.get("files", {}).items())}


def files_bytes(manifest: Dict[str, Any]) -> int:
    """The bytes a snapshot's files hold, by its manifest."""
    return sum(int(entry["size"]) for entry in manifest.get("files", {}).values())


def cursor_info(cursor: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """The cursor (docs/cursor.md) without its RNG bytes, and how a resume positions it."""
    if cursor is None:
        return None
    stateful = cursor.get("loader_state") is not None
    return {
        "version": cursor.get("version"), "epoch": cursor.get("epoch"),
        "index": cursor.get("index"),
        "epoch_opened": bool(cursor.get("epoch_rng")),
        "epoch_rng_streams": sorted(cursor.get("epoch_rng") or {}),
        "persistent_workers": bool(cursor.get("iter_rng")),
        "loader_state": stateful,
        "positioning": "loader_state (the loader's own state_dict)" if stateful else
                       "skip (sampler indices only) or replay, chosen by the loader at resume",
    }
