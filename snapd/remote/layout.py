"""Where things are in a remote root, and the remote commit rule (docs/remote.md).

Layout under the URL's prefix ``<url>``::

    <url>/<run>/snapshots/<name>/<file>        a snapshot's files, at the relative
                                               paths they have on the local disk
    <url>/<run>/shared/<snapshot>/<file>       a tensor file of an earlier snapshot
                                               that later snapshots read (format v4)
    <url>/<run>/committed/<name>.snapd         the remote commit record, written last
    <url>/<run>/log/rank-NNNNN/<segment>       the state log, replicated
    <url>/<run>/parts/<name>/rank-NNNNN.snapd  node-local roots: a rank's part is up

Object stores have no rename, so the commit is the record: one small object written
after every file of the snapshot is uploaded, listing each file and its size and the
digest of the snapshot's top file (its manifest, or a multi-rank snapshot's commit
record; from v5 also its SHA-256, ``top_sha256``, which with the SHA-256s the manifest
lists for its files covers every byte of the snapshot), and the shared files its
tensors read (``shared``: each up before the record).
A snapshot is committed remotely if and only if its record exists and
decodes; files under ``snapshots/<name>/`` without a record are an upload in progress
or abandoned, and no reader ever looks at them. Deleting goes the other way: the
record first, then the files.

Everything read from a remote root is untrusted: names are checked against the local
rules before they name a local path, sizes before anything is allocated.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple
from urllib.parse import urlsplit, urlunsplit

from snapd import format as fmt
from snapd.errors import CorruptSnapshot, RemoteUnavailable
from snapd.store import SnapshotId, check_run_name

RECORD_SUFFIX = ".snapd"
RECORD_MAGIC = b"SNAPDRC\0"   # a remote commit record (framed like a manifest)
PART_MAGIC = b"SNAPDRP\0"     # a rank's part uploaded (node-local roots)
MAX_RECORD_BYTES = 16 << 20
# A file inside a snapshot: a plain name, or one level down in a rank's part.
_RELPATH = re.compile(r"^(?:rank-\d{5}/)?[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
# A shared file: a plain tensor file name (one-rank snapshots only share).
_PLAIN = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")


def redact(url: str) -> str:
    """``url`` without any user or password, for messages, status and events."""
    parts = urlsplit(url)
    if not (parts.username or parts.password):
        return url
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment))


def check_relpath(relpath: Any, *, where: str) -> str:
    """A file's path inside a snapshot, as the remote lists or records it: refused
    unless it is a plain name or ``rank-NNNNN/<name>`` (never ``..``, never absolute)."""
    if not isinstance(relpath, str) or not _RELPATH.match(relpath):
        raise CorruptSnapshot(f"{where}: {relpath!r} is not a file name snapd writes; "
                              "the remote snapshot is damaged or hostile, use an older "
                              "one", path=where, field="files")
    return relpath


@dataclass(frozen=True)
class RemoteFile:
    relpath: str   # e.g. "model.tensors", "rank-00001/manifest.snapd"
    size: int


@dataclass(frozen=True)
class SharedFile:
    """A tensor file of an earlier snapshot of the run that a snapshot's tensors read
    (a manifest's ``shared`` entry), kept remotely at ``shared/<snapshot>/<file>``."""
    snapshot: str
    file: str
    size: int

    @property
    def key(self) -> Tuple[str, str]:
        return (self.snapshot, self.file)


def check_shared_file(entry: Any, *, where: str, field: str, name: str) -> SharedFile:
    """A record's ``shared`` entry, refused unless its snapshot is a snapshot name other
    than ``name`` and its file a plain name (never ``..``, a ``/`` or absolute)."""
    ok = (isinstance(entry, dict) and isinstance(entry.get("snapshot"), str)
          and SnapshotId.parse(entry["snapshot"]) is not None
          and entry["snapshot"] != name and isinstance(entry.get("file"), str)
          and bool(_PLAIN.match(entry["file"])) and ".." not in entry["file"]
          and fmt.is_uint(entry.get("size")))
    if not ok:
        raise CorruptSnapshot(f"{where}: field {field} is not {{snapshot, file, size}} "
                              "naming a tensor file of an earlier snapshot; the remote "
                              "snapshot is damaged or hostile, use an older one",
                              path=where, field=field)
    return SharedFile(entry["snapshot"], entry["file"], entry["size"])


def top_file(world_size: int) -> str:
    """The file a reader opens first: the manifest, or the multi-rank commit record."""
    return fmt.COMMIT_NAME if world_size > 1 else fmt.MANIFEST_NAME


def make_record(run: str, sid: SnapshotId, world_size: int, files: List[RemoteFile],
                top_bytes: bytes, shared: Sequence[SharedFile] = ()) -> Dict[str, Any]:
    """The remote commit record of one snapshot (docs/remote.md, "The record").
    ``bytes`` counts the snapshot's own files; ``shared`` lists the files of earlier
    snapshots it reads, which are not its own (records before format v4: absent)."""
    return {"run": run, "name": sid.name, "step": sid.step, "lineage": sid.lineage,
            "world_size": world_size,
            "files": [[f.relpath, f.size] for f in sorted(files, key=lambda f: f.relpath)],
            "bytes": sum(f.size for f in files), "top": top_file(world_size),
            "top_xxh3": fmt.checksum(top_bytes), "top_sha256": fmt.sha256_of(top_bytes),
            "uploaded_at": time.time(),
            "shared": [{"snapshot": s.snapshot, "file": s.file, "size": s.size}
                       for s in sorted(shared, key=lambda s: s.key)]}


def encode_record(record: Dict[str, Any], signer: Any = None) -> bytes:
    return _framed(RECORD_MAGIC, record, signer)


def decode_record(data: bytes, *, where: str, run: str, name: str) -> Dict[str, Any]:
    """A remote commit record's bytes to its map, checked; CorruptSnapshot otherwise."""
    record, version = fmt._unframe(data, RECORD_MAGIC, "remote commit record",
                                   fmt.READABLE_VERSIONS, path=where)
    need = lambda ok, field, what: fmt.need(ok, where, field, what)  # noqa: E731
    need(isinstance(record, dict), "record", "is not a map")
    need(record.get("run") == run, "run", f"is not {run!r}, the run it is filed under")
    need(record.get("name") == name, "name", f"is not {name!r}, its object's name")
    sid = SnapshotId.parse(name)
    need(sid is not None and record.get("step") == sid.step
         and record.get("lineage") == sid.lineage, "step", "does not match the name")
    need(fmt.is_uint(record.get("world_size")) and record["world_size"] >= 1,
         "world_size", "is not a positive count")
    need(record.get("top") == top_file(record["world_size"]), "top",
         "is not the manifest (one rank) or commit.snapd (many)")
    files = record.get("files")
    need(isinstance(files, list) and files, "files", "is not a list of [path, size]")
    for i, entry in enumerate(files):
        need(isinstance(entry, list) and len(entry) == 2 and fmt.is_uint(entry[1]),
             f"files[{i}]", "is not [path, size]")
        check_relpath(entry[0], where=where)
    need(record["top"] in {e[0] for e in files}, "files", "does not list the top file")
    need(fmt.is_uint(record.get("top_xxh3")), "top_xxh3", "is not a digest")
    need("top_sha256" not in record or (version >= fmt.SHA256_FROM
                                        and fmt.is_sha256(record["top_sha256"])),
         "top_sha256", "is not 32 bytes (of a version 5 record)")
    need(fmt.is_uint(record.get("bytes")), "bytes", "is not a byte count")
    _check_record_shared(record, where, name, version)
    return record


def _check_record_shared(record: Dict[str, Any], where: str, name: str,
                         version: int) -> None:
    """``shared`` (format v4 records; absent before): distinct files of other
    snapshots, only in a one-rank record."""
    shared = record.setdefault("shared", [])
    fmt.need(isinstance(shared, list) and (not shared or version >= 4), where, "shared",
             "is not a list (of a version 4 record)")
    fmt.need(not shared or record["world_size"] == 1, where, "shared",
             "is not empty in a multi-rank record (only one-rank snapshots share)")
    seen = set()
    for i, entry in enumerate(shared):
        key = check_shared_file(entry, where=where, field=f"shared[{i}]", name=name).key
        fmt.need(key not in seen, where, f"shared[{i}]", "lists a file twice")
        seen.add(key)


def record_files(record: Dict[str, Any]) -> List[RemoteFile]:
    return [RemoteFile(p, s) for p, s in record["files"]]


def record_shared(record: Dict[str, Any]) -> List[SharedFile]:
    """The shared files a decoded record lists (none for a record before v4)."""
    return [SharedFile(e["snapshot"], e["file"], e["size"])
            for e in record.get("shared") or []]


def encode_part(part: Dict[str, Any]) -> bytes:
    return _framed(PART_MAGIC, part)


def decode_part(data: bytes, *, where: str) -> Dict[str, Any]:
    part, _ = fmt._unframe(data, PART_MAGIC, "remote part record",
                           fmt.READABLE_VERSIONS, path=where)
    fmt.need(isinstance(part, dict), where, "part", "is not a map")
    return part


def _framed(magic: bytes, value: Dict[str, Any], signer: Any = None) -> bytes:
    return fmt._framed(magic, value, signer)


class RemoteRoot:
    """A remote root reached through fsspec: paths, listings, the records, files.

    ``url`` is any fsspec URL (``s3://bucket/prefix``, ``file:///mnt/shared/snapd``).
    Every listing bypasses fsspec's listing cache: other daemons write here too.
    ``timeout`` (seconds; restore()'s ``remote_timeout``) bounds each S3 call: its
    connect and each read, with one attempt, not botocore's and s3fs's retries.
    """

    def __init__(self, url: str, fs: Any = None, timeout: Optional[float] = None) -> None:
        if not isinstance(url, str) or "://" not in url:
            raise RemoteUnavailable(f"remote {url!r}: not a URL; use s3://bucket/prefix or "
                              "file:///path (any fsspec URL)", path=str(url),
                              field="remote")
        self.url = redact(url.rstrip("/"))
        if fs is None:
            import fsspec  # imported here: a root with no remote never pays for it
            # A local (shared, mounted) filesystem makes parent directories as it
            # writes, as object stores do. fsspec would hand back one instance per
            # set of arguments, made under the environment of its first use (the
            # endpoint, the credentials); a remote root takes the environment of now.
            local = url.startswith(("file://", "local://"))
            kwargs = {"auto_mkdir": True} if local else _bounded(url, timeout)
            try:
                fs, base = fsspec.core.url_to_fs(url, skip_instance_cache=True, **kwargs)
            except (ImportError, ValueError) as e:
                raise RemoteUnavailable(f"remote {self.url}: {e}; for s3:// install s3fs "
                                  "(pip install 'snapd[remote]')", path=self.url,
                                  field="remote") from e
        else:
            base = urlsplit(url).netloc + urlsplit(url).path
        if timeout is not None and url.startswith(("s3://", "s3a://")):
            fs.retries = 1   # s3fs's own retry loop, above botocore's: one attempt
        self.fs = fs
        self.base = base.rstrip("/")

    # -- paths ------------------------------------------------------------------
    def run_path(self, run: str) -> str:
        return f"{self.base}/{check_run_name(run)}"

    def snapshot_path(self, run: str, name: str) -> str:
        return f"{self.run_path(run)}/snapshots/{_checked_name(name)}"

    def file_path(self, run: str, name: str, relpath: str) -> str:
        return f"{self.snapshot_path(run, name)}/{check_relpath(relpath, where=self.url)}"

    def record_path(self, run: str, name: str) -> str:
        return f"{self.run_path(run)}/committed/{_checked_name(name)}{RECORD_SUFFIX}"

    def shared_path(self, run: str, snapshot: str, file: str) -> str:
        """Where a shared file of earlier snapshot ``snapshot`` is kept remotely."""
        return f"{self.shared_root(run)}/{_checked_name(snapshot)}/{_checked_file(file)}"

    def shared_root(self, run: str) -> str:
        return f"{self.run_path(run)}/shared"

    def log_path(self, run: str) -> str:
        return f"{self.run_path(run)}/log"

    def parts_path(self, run: str, name: str) -> str:
        return f"{self.run_path(run)}/parts/{_checked_name(name)}"

    def where(self, path: str) -> str:
        """A store path as the user wrote the URL, for messages."""
        scheme = self.url.split("://", 1)[0]
        return f"{scheme}://{path}" if scheme != "file" else f"file://{path}"

    # -- listings ---------------------------------------------------------------
    def runs(self) -> List[str]:
        """Runs with anything in the remote root, by name."""
        names = [p.rstrip("/").rsplit("/", 1)[-1] for p in self._ls(self.base)]
        return sorted(n for n in names if _is_run(n))

    def commits(self, run: str) -> List[SnapshotId]:
        """The run's remotely committed snapshots (their records exist), oldest first."""
        out = []
        for path in self._ls(f"{self.run_path(run)}/committed"):
            leaf = path.rsplit("/", 1)[-1]
            if leaf.endswith(RECORD_SUFFIX):
                sid = SnapshotId.parse(leaf[:-len(RECORD_SUFFIX)])
                if sid is not None:
                    out.append(sid)
        return sorted(out)

    def uploaded_files(self, run: str, name: str) -> Dict[str, int]:
        """What is under ``snapshots/<name>/`` now, committed or not: relpath -> size."""
        prefix = self.snapshot_path(run, name) + "/"
        self.fs.invalidate_cache()
        try:
            found = self.fs.find(prefix, detail=True)
        except FileNotFoundError:
            return {}
        return {p[len(prefix):]: int(info.get("size") or 0)
                for p, info in found.items() if p.startswith(prefix)}

    def shared_files(self, run: str) -> Dict[Tuple[str, str], int]:
        """What is under ``shared/`` now, listed or not: (snapshot, file) -> size.
        Anything not named ``<snapshot name>/<plain file name>`` is left out."""
        prefix = self.shared_root(run) + "/"
        self.fs.invalidate_cache()
        try:
            found = self.fs.find(prefix, detail=True)
        except FileNotFoundError:
            return {}
        out = {}
        for path, info in found.items():
            snapshot, _, file = path[len(prefix):].partition("/")
            if (path.startswith(prefix) and SnapshotId.parse(snapshot) is not None
                    and _PLAIN.match(file) and ".." not in file):
                out[(snapshot, file)] = int(info.get("size") or 0)
        return out

    def snapshot_names(self, run: str) -> List[str]:
        """Names with files under ``snapshots/``: committed, in progress or abandoned."""
        leaves = [p.rstrip("/").rsplit("/", 1)[-1]
                  for p in self._ls(f"{self.run_path(run)}/snapshots")]
        return sorted(n for n in leaves if SnapshotId.parse(n) is not None)

    def _ls(self, path: str) -> List[str]:
        self.fs.invalidate_cache()
        try:
            return list(self.fs.ls(path, detail=False))
        except FileNotFoundError:
            return []

    # -- records ----------------------------------------------------------------
    def read_record(self, run: str, name: str) -> Dict[str, Any]:
        """The snapshot's remote commit record, decoded and checked."""
        path = self.record_path(run, name)
        return decode_record(self.read_small(path), where=self.where(path), run=run,
                             name=name)

    def write_record(self, run: str, name: str, record: Dict[str, Any],
                     signer: Any = None) -> None:
        """The remote commit: one small object, written after every file is up;
        signed with ``signer``'s key when given (snapd/signing.py)."""
        self.fs.pipe_file(self.record_path(run, name), encode_record(record, signer))

    def record_bytes(self, run: str, name: str) -> bytes:
        """The snapshot's remote commit record as stored (its signature is checked on
        these bytes)."""
        return self.read_small(self.record_path(run, name))

    def read_small(self, path: str, limit: int = MAX_RECORD_BYTES) -> bytes:
        """A small object (a record, a manifest), refused unread beyond ``limit``."""
        where = self.where(path)
        try:
            size = int(self.fs.size(path))
        except FileNotFoundError as e:
            raise CorruptSnapshot(f"{where}: missing", path=where, field="files") from e
        if size > limit:
            raise CorruptSnapshot(f"{where}: {size} bytes, larger than any such file "
                                  "snapd writes", path=where, field="size")
        return self.fs.cat_file(path)

    def delete_snapshot(self, run: str, name: str) -> None:
        """Un-commit first (the record), then the files: a crash in between leaves
        files no reader looks at, which the next sweep removes."""
        record = self.record_path(run, name)
        if self.fs.exists(record):
            self.fs.rm_file(record)
        self.remove_files(run, name)

    def remove_shared(self, run: str, snapshot: str, file: str) -> None:
        """One shared file; on a mounted filesystem its emptied directory too (object
        stores have no directories)."""
        path = self.shared_path(run, snapshot, file)
        try:
            self.fs.rm_file(path)
        except FileNotFoundError:
            pass
        if "file" in _protocols(self.fs):
            try:
                self.fs.rmdir(path.rsplit("/", 1)[0])
            except OSError:   # not empty: another file of that snapshot is kept
                pass

    def remove_files(self, run: str, name: str) -> None:
        path = self.snapshot_path(run, name)
        try:
            self.fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass


def _bounded(url: str, timeout: Optional[float]) -> Dict[str, Any]:
    """S3 client settings for calls bounded by ``timeout`` seconds each (botocore's
    connect and read timeouts, one attempt); other schemes: none."""
    if timeout is None or not url.startswith(("s3://", "s3a://")):
        return {}
    return {"config_kwargs": {"connect_timeout": timeout, "read_timeout": timeout,
                              "retries": {"total_max_attempts": 1}}}


def _checked_name(name: str) -> str:
    if SnapshotId.parse(name) is None:
        raise CorruptSnapshot(f"{name!r} is not a snapshot name (8+ digits, optionally "
                              "'.L<lineage>')", path=str(name), field="name")
    return name


def _checked_file(file: str) -> str:
    if not isinstance(file, str) or not _PLAIN.match(file) or ".." in file:
        raise CorruptSnapshot(f"{file!r} is not a tensor file name snapd writes",
                              path=str(file), field="shared")
    return file


def _protocols(fs: Any) -> Tuple[str, ...]:
    protocol = getattr(fs, "protocol", ())
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


def _is_run(name: str) -> bool:
    try:
        check_run_name(name)
        return True
    except ValueError:
        return False


def newest(commits: List[SnapshotId]) -> Optional[SnapshotId]:
    return commits[-1] if commits else None
