"""``snapd verify --sha256``: the quick audit of a snapshot against its SHA-256s.

What it checks, and nothing else (no chunk is decoded, no skeleton read):
- the manifest's own SHA-256 against the ``manifest_sha256`` that the state log's
  committed record holds (snapd/logdigests.py): a manifest rewritten after its commit;
- each file's SHA-256 against the manifest's ``files[name].sha256``, the file read
  once from start to end, as ``sha256sum`` reads it;
- for a multi-rank snapshot, each part's manifest against the commit record's
  ``parts[r].manifest_sha256``, then each part's files as above.

It says what it could not check: a snapshot of format 4 or older, or written with
option ``sha256`` off, has no SHA-256 recorded; a snapshot the log has no committed
record of (see snapd/logdigests.py) is checked against its manifest only.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Dict, Optional

from snapd import format as fmt
from snapd.errors import CorruptSnapshot, SnapdError
from snapd.logdigests import LoggedDigests
from snapd.roots import Root, Snap
from snapd.signing import Keys
from snapd.safefiles import open_regular, read_bounded, read_manifest_bytes

PIECE = 4 << 20


def file_sha256(path: str) -> bytes:
    """The SHA-256 of every byte of ``path`` (opened without following links)."""
    fd = open_regular(path)
    try:
        sha = hashlib.sha256()
        while True:
            piece = os.read(fd, PIECE)
            if not piece:
                return sha.digest()
            sha.update(piece)
    finally:
        os.close(fd)


def check_signature(path: str, keys: Optional[Keys]) -> Optional[str]:
    """The key id (hex) that signed the snapshot at ``path`` (its manifest, or many
    ranks' commit record), or None; with ``keys``, UntrustedSnapshot unless an
    accepted key signed it (snapd/signing.py)."""
    commit = os.path.join(path, fmt.COMMIT_NAME)
    if os.path.lexists(commit):
        top, data = commit, read_bounded(commit, "commit record")
    else:
        top, data = os.path.join(path, fmt.MANIFEST_NAME), read_manifest_bytes(path)
    if keys is not None:
        keys.check(data, path=top, what=os.path.basename(top))
    found = fmt.signature_of(data)   # decoded already: its header is whole
    return found[0].hex() if found is not None else None


def audit(root: Root, snap: Snap, keys: Optional[Keys] = None) -> Dict[str, Any]:
    """One snapshot's SHA-256s against its manifest and the log; a plain verdict:
    ``ok``, ``log`` ("match", "no record"), ``files`` checked, ``unrecorded`` (files
    without a SHA-256), ``signed_by``, and ``error``/``file``/``field`` of the first
    mismatch. ``keys``: signatures checked too (:func:`check_signature`)."""
    result: Dict[str, Any] = {"snapshot": snap.label, "path": snap.where, "ok": False,
                              "log": None, "files": 0, "unrecorded": 0, "error": None,
                              "file": None, "field": None, "signed_by": None}
    try:
        with root.files(snap) as path, root.logs() as logs:
            _audit_directory(path, snap.name, run_dir_of(snap, logs), result)
            result["signed_by"] = check_signature(path, keys)
        result["ok"] = True
    except SnapdError as e:
        result.update(error=str(e), file=e.path, field=e.field)
    except OSError as e:
        result.update(error=f"{e.filename or snap.where}: cannot be read ({e.strerror})",
                      file=e.filename)
    return result


def run_dir_of(snap: Snap, logs: str) -> Optional[str]:
    """Where the run's log is: under the root's logs, or for a directory given by
    path, the run directory above its ``snapshots/`` (None outside a run layout)."""
    if snap.run:
        return os.path.join(logs, snap.run)
    parent = os.path.dirname(os.path.abspath(snap.where))
    return os.path.dirname(parent) if os.path.basename(parent) == "snapshots" else None


def _audit_directory(path: str, name: str, run_dir: Optional[str],
                     result: Dict[str, Any]) -> None:
    commit = os.path.join(path, fmt.COMMIT_NAME)
    if os.path.lexists(commit):
        record = fmt.decode_commit(read_bounded(commit, "commit record"), path=commit)
        result["log"] = "not kept for many ranks"
        for part in record["parts"]:
            part_dir = os.path.join(path, part["dir"])
            data = read_manifest_bytes(part_dir)
            want = part.get("manifest_sha256")
            if want is None:
                result["unrecorded"] += 1
            elif fmt.sha256_of(data) != want:
                where = os.path.join(part_dir, fmt.MANIFEST_NAME)
                raise CorruptSnapshot(
                    f"{where}: SHA-256 {fmt.sha256_of(data).hex()} differs from the "
                    f"commit record's parts[{part['rank']}].manifest_sha256 {want.hex()}: "
                    "the part's manifest was rewritten after the commit", path=where,
                    field=f"parts[{part['rank']}].manifest_sha256")
            _audit_files(part_dir, data, result)
        return
    data = read_manifest_bytes(path)
    manifest = _audit_files(path, data, result)
    result["log"] = _against_log(path, name, data, manifest, run_dir)


def against_log(path: str, snap: Snap, logs: str) -> str:
    """A one-rank snapshot's manifest at ``path`` against the log's record of its
    commit: "match" or "no record"; CorruptSnapshot when they differ."""
    data = read_manifest_bytes(path)
    manifest = fmt.decode_manifest(data, path=os.path.join(path, fmt.MANIFEST_NAME))
    return _against_log(path, snap.name, data, manifest, run_dir_of(snap, logs))


def _against_log(path: str, name: str, data: bytes, manifest: Dict[str, Any],
                 run_dir: Optional[str]) -> str:
    if run_dir is None:
        return "no record"
    logged = LoggedDigests(run_dir, manifest.get("rank", 0))
    try:
        want = logged.get(name)
    finally:
        logged.close()
    if want is None:
        return "no record"
    got = fmt.sha256_of(data).hex()
    if got != want:
        where = os.path.join(path, fmt.MANIFEST_NAME)
        raise CorruptSnapshot(f"{where}: SHA-256 {got} differs from the manifest_sha256 "
                              f"{want} the state log recorded at its commit: the "
                              "manifest was rewritten since; treat the snapshot as forged",
                              path=where, field="manifest_sha256")
    return "match"


def _audit_files(path: str, data: bytes, result: Dict[str, Any]) -> Dict[str, Any]:
    where = os.path.join(path, fmt.MANIFEST_NAME)
    manifest = fmt.decode_manifest(data, path=where)
    for file_name, entry in sorted(manifest["files"].items()):
        want = entry.get("sha256")
        if want is None:
            result["unrecorded"] += 1
            continue
        full = os.path.join(path, file_name)
        got = file_sha256(full)
        if got != want:
            raise CorruptSnapshot(f"{full}: SHA-256 {got.hex()} differs from the "
                                  f"manifest's files[{file_name!r}].sha256 {want.hex()}",
                                  path=full, field=f"files[{file_name!r}].sha256")
        result["files"] += 1
    return manifest


def audit_text(r: Dict[str, Any]) -> str:
    """What the audit of one good snapshot found, in words."""
    files = f"{r['files']} file{'s' if r['files'] != 1 else ''} match their SHA-256"
    if r["unrecorded"]:
        files += f", {r['unrecorded']} with no SHA-256 recorded"
    return f"{files}; manifest against the log: {r['log']}"
