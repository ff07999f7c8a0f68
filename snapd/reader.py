"""Read and verify one committed snapshot, object by object.

Opening a snapshot reads only its manifest and stats its files. An object's tensors
are read on demand (the model without the optimizer), each chunk verified against its
checksum, each tensor against the digest of its raw bytes, the padding between chunks
for zeros, and the file against its digest (docs/format.md) while the chunks stream
past. Each byte is read from memory once: the second digest of a chunk is taken while
it is still in cache. Files of format v2 and later are read in parallel, over files and
chunks, by direct I/O where the page cache does not hold them, and optionally straight
into tensors the caller already holds (snapd/fastread.py). A daemon's in-memory copy
(snapd_client/hotrestore.py) is another source of the same bytes: :func:`destinations` decides
for both what tensor an entry becomes and where its bytes land. Nothing is
trusted before it is checked: names are plain file names inside the directory, every
declared size is compared with the file before anything is allocated, and files are
opened without following symlinks.
"""

from __future__ import annotations

import math
import mmap
import os
import stat
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import xxhash

from snapd import fastread
from snapd import format as fmt
from snapd import sharing
from snapd.errors import CorruptSnapshot
from snapd.safefiles import open_regular, read_bounded, read_manifest_bytes
from snapd.store import SNAPSHOT_NAME as _SNAPSHOT_NAME

if TYPE_CHECKING:
    import torch

Progress = Optional[Callable[[int], None]]


def read_commit(snapshot_dir: str) -> Dict[str, Any]:
    """A multi-rank snapshot's commit record, decoded and checked (its parts are not
    opened: snapd/globalsnap.py does that)."""
    path = os.path.join(snapshot_dir, fmt.COMMIT_NAME)
    return fmt.decode_commit(read_bounded(path, "commit record"), path=path)


def read_summary(snapshot_dir: str) -> Dict[str, Any]:
    """What a committed snapshot says of itself without a tensor file: a one-rank
    snapshot's manifest (its files stat-checked), or a multi-rank snapshot's commit
    record (step, lineage, metric, world_size, parts)."""
    if os.path.lexists(os.path.join(snapshot_dir, fmt.COMMIT_NAME)):
        return read_commit(snapshot_dir)
    return SnapshotReader(snapshot_dir).manifest


def check_real_directories(snapshot_dir: str) -> None:
    """The snapshot directory, and in a run layout (``<run>/snapshots/<name>``) its
    ``snapshots/`` and run directories, are directories, not symlinks: a link would
    lead reads (and the writer) outside the root."""
    chain = [snapshot_dir]
    parent = os.path.dirname(snapshot_dir)
    if os.path.basename(parent) == "snapshots":
        chain += [parent, os.path.dirname(parent)]
    for path in chain:
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError as e:
            raise CorruptSnapshot(f"{path}: no such directory", path=path,
                                  field="directory") from e
        if not stat.S_ISDIR(mode):
            raise CorruptSnapshot(f"{path}: a symlink or other non-directory where a "
                                  "snapshot directory is expected; snapd never follows "
                                  "links out of the root. Replace it with the directory "
                                  "itself", path=path, field="directory")


def check_name_matches(snapshot_dir: str, manifest: Dict[str, Any]) -> None:
    """A directory named as a snapshot must hold the manifest of that step and
    lineage: the name orders snapshots, the manifest is what is restored."""
    name = os.path.basename(snapshot_dir)
    match = _SNAPSHOT_NAME.match(name)
    if match is None:
        return  # a copy under another name (an operator's): nothing to compare
    step, lineage = int(match.group(1)), int(match.group(2) or 0)
    path = os.path.join(snapshot_dir, fmt.MANIFEST_NAME)
    found = (manifest["step"], manifest["lineage"].get("id", 0))
    if found != (step, lineage):
        raise CorruptSnapshot(f"{path}: fields step/lineage.id are {found[0]}/{found[1]} "
                              f"but the directory is named {name} (step {step}, lineage "
                              f"{lineage}); the snapshot was moved or is hostile, use "
                              "another one", path=path, field="step")


class SnapshotReader:
    """A verified manifest and on-demand, verified access to its tensors."""

    def __init__(self, path: str, objects: Optional[List[str]] = None) -> None:
        """``objects``: only these objects' files are checked on open (weights only:
        the optimizer's file may be missing); the default is every file. A file is
        checked again when an object in it is read."""
        self.path = path
        check_real_directories(path)
        manifest_path = os.path.join(path, fmt.MANIFEST_NAME)
        data = read_manifest_bytes(path)
        self.manifest: Dict[str, Any] = fmt.decode_manifest(data, path=manifest_path)
        # What the state log's committed record holds of this manifest (hex), and the
        # bytes a signature covers (snapd/signing.py).
        self.manifest_sha256 = fmt.sha256_of(data).hex()
        self.manifest_bytes = data
        files = None if objects is None else {
            self.objects[n]["file"] for n in objects
            if n in self.objects and self.objects[n].get("file") is not None}
        self._check_file_sizes(files)
        self._check_layouts()

    @property
    def step(self) -> int:
        return self.manifest["step"]

    @property
    def objects(self) -> Dict[str, Any]:
        return self.manifest["objects"]

    def _check_file_sizes(self, only: Optional[set] = None) -> None:
        for name, entry in self.manifest["files"].items():
            if only is not None and name not in only:
                continue
            full = os.path.join(self.path, name)
            try:
                st = os.lstat(full)
            except FileNotFoundError as e:
                raise CorruptSnapshot(f"{full}: listed in the manifest but missing",
                                      path=full, field="files") from e
            if not stat.S_ISREG(st.st_mode):
                raise CorruptSnapshot(f"{full}: not a regular file", path=full,
                                      field="files")
            _check_size(full, st.st_size, entry["size"], name)

    def _check_layouts(self) -> None:
        """Each object's chunks tile its file: checked on open, from the manifest."""
        align = fmt.chunk_alignment(self.manifest["format"])
        for obj in self.objects.values():
            if obj.get("file") is not None and obj["tensors"]:
                entry = self.manifest["files"][obj["file"]]
                _check_tiling(own_entries(obj), entry["size"],
                              os.path.join(self.path, obj["file"]), align)

    def load_object(self, name: str, progress: Progress = None,
                    into: Optional[Dict[str, torch.Tensor]] = None
                    ) -> List[Optional[torch.Tensor]]:
        """Every tensor of one object, on CPU, verified. Raises CorruptSnapshot.
        ``into``: see :meth:`load_objects`.

        In a part of a multi-rank snapshot, an entry another rank stores (``ref``) is
        None here: snapd/globalsnap.py resolves it from that rank's part."""
        return self.load_objects([name], progress, {name: into or {}})[name]

    def load_objects(self, names: List[str], progress: Progress = None,
                     into: Optional[Dict[str, Dict[str, torch.Tensor]]] = None
                     ) -> Dict[str, List[Optional[torch.Tensor]]]:
        """Several objects' tensors, their files read together in parallel
        (snapd/fastread.py; format v1 files one after the other, as written).

        ``into[name][path]``: a tensor to read that entry's bytes into instead of new
        memory, used when it is a CPU tensor of the saved dtype and shape, contiguous
        (others are ignored). It is written before its checksums are known: a
        CorruptSnapshot leaves it holding part of the file."""
        into = into or {}
        if self.manifest["format"] == 1:
            return {n: self._load_sequential(n, progress) for n in names}
        out: Dict[str, List[Optional[torch.Tensor]]] = {}
        reads, fds = [], []
        shared: Dict[int, List[Tuple[Dict[str, Any], torch.Tensor]]] = {}
        try:
            for name in names:
                obj = self.objects[name]
                out[name] = tensors = destinations(obj["tensors"], into.get(name))
                for t, dest in zip(obj["tensors"], tensors):
                    if t.get("src") is not None:
                        shared.setdefault(t["src"], []).append((t, dest))
                if obj.get("file") is not None:
                    reads.append(self._open_file(obj, tensors, fds))
            reads += [self._open_shared(src, group, fds) for src, group in shared.items()]
            fastread.read_files(reads, progress)
        finally:
            for fd in fds:
                os.close(fd)
        return out

    def _tiled_file(self, obj: Dict[str, Any]) -> Tuple[str, str, Dict[str, Any], int]:
        """An object's file: its name, path, manifest entry and format version, its
        chunks' tiling checked from the manifest before it is opened."""
        file_name = obj["file"]
        full = os.path.join(self.path, file_name)
        entry = self.manifest["files"][file_name]
        version = self.manifest["format"]
        _check_tiling(own_entries(obj), entry["size"], full, fmt.chunk_alignment(version))
        return file_name, full, entry, version

    def _open_file(self, obj: Dict[str, Any], tensors: List[Optional[torch.Tensor]],
                   fds: List[int]) -> fastread.FileRead:
        """The object's file opened and checked up to its chunks: type, size (again:
        it may have changed since the manifest was read), tiling, header, file digest."""
        file_name, full, entry, version = self._tiled_file(obj)
        fd, header = _open_tensor_file(full, entry["size"], file_name, version, fds)
        own = [(t, dest) for t, dest in zip(obj["tensors"], tensors) if _is_own(t)]
        digest = fmt.FileDigest(version)
        digest.header(header)
        for t, _ in own:
            for chunk in t["chunks"]:
                digest.chunk(b"", chunk[4])
        if digest.intdigest() != entry["xxh3"]:
            raise CorruptSnapshot(f"{full}: file checksum mismatch (manifest field "
                                  f"files[{file_name!r}].xxh3)", path=full, field="xxh3")
        return fastread.FileRead(full, fd, _direct(full, fd, fds), [t for t, _ in own],
                                 [None if d is None else bytes_of(d) for _, d in own],
                                 sha256=entry.get("sha256"), header=header,
                                 size=entry["size"])

    def _open_shared(self, src: int, group: List[Tuple[Dict[str, Any], Any]],
                     fds: List[int]) -> fastread.FileRead:
        """``shared[src]``, an earlier snapshot's file, opened for the entries that read
        it: found (snapd/sharing.py), checked as a regular file of the listed size and
        version; its chunks are verified as they are read, like this snapshot's own."""
        where = self.manifest["shared"][src]
        manifest_path = os.path.join(self.path, fmt.MANIFEST_NAME)
        full = sharing.locate(sharing.run_dir_of(self.path), where["snapshot"],
                              where["file"], wanted_by=f"{manifest_path} (shared[{src}])")
        fd, _ = _open_tensor_file(full, where["size"], f"shared[{src}]", where["format"],
                                  fds)
        group = sorted(group, key=lambda item: item[0]["chunks"][0][0]
                       if item[0]["chunks"] else 0)
        return fastread.FileRead(full, fd, _direct(full, fd, fds), [t for t, _ in group],
                                 [None if d is None else bytes_of(d) for _, d in group],
                                 partial=True)

    def _load_sequential(self, name: str, progress: Progress = None
                         ) -> List[Optional[torch.Tensor]]:
        """A format v1 object: its file digest covers every byte, in order."""
        obj = self.objects[name]
        if obj.get("file") is None:
            return [None] * len(obj["tensors"])
        file_name, full, entry, version = self._tiled_file(obj)
        fd = open_regular(full)
        try:
            header = os.pread(fd, fmt.HEADER_BYTES, 0)
            fmt.check_tensor_file_header(header, path=full, version=version)
            walk = _FileWalk(full, fd, fmt.FileDigest(version))
            walk.header(header)
            tensors = [None if "ref" in t else self._read_tensor(fd, t, i, full, walk,
                                                                 progress)
                       for i, t in enumerate(obj["tensors"])]
            walk.padding_to(entry["size"])
        finally:
            os.close(fd)
        if walk.digest.intdigest() != entry["xxh3"]:
            raise CorruptSnapshot(f"{full}: file checksum mismatch (manifest field "
                                  f"files[{file_name!r}].xxh3)", path=full, field="xxh3")
        return tensors

    def _read_tensor(self, fd: int, meta: Dict[str, Any], i: int, path: str,
                     walk: "_FileWalk", progress: Progress) -> torch.Tensor:
        out = destination(None, meta)
        view = bytes_of(out)
        raw_digest = xxhash.xxh3_64()
        pos = 0
        for j, chunk in enumerate(meta["chunks"]):
            offset, stored_len, raw_len = chunk[0], chunk[1], chunk[2]
            field = f"tensor {meta['path']!r} chunk {j}"
            walk.padding_to(offset)
            if chunk[3] == fmt.CODEC_RAW:
                target = view[pos:pos + raw_len]
                if os.preadv(fd, [target], offset) != stored_len:
                    raise CorruptSnapshot(f"{path}: short read in {field}", path=path,
                                          field=field)
                stored = target
                fmt.decode_chunk(stored, chunk, path=path, field=field)
            else:
                stored = os.pread(fd, stored_len, offset)
                view[pos:pos + raw_len] = fmt.decode_chunk(stored, chunk, path=path,
                                                           field=field)
            raw_digest.update(view[pos:pos + raw_len])  # just written: still in cache
            walk.chunk(stored, chunk[4])
            pos += raw_len
            if progress:
                progress(stored_len)
        if raw_digest.intdigest() != meta["xxh3"]:
            raise CorruptSnapshot(f"{path}: tensor {meta['path']!r} checksum mismatch "
                                  "after decoding", path=path, field=f"tensor {meta['path']!r}")
        return out

    def verify(self, progress: Progress = None) -> None:
        """Read every object's file and check every checksum."""
        for name in self.objects:
            self.load_object(name, progress)


def _is_own(t: Dict[str, Any]) -> bool:
    """Whether an entry's bytes are in its object's own file (not another rank's part,
    not an earlier snapshot's file)."""
    return "ref" not in t and t.get("src") is None


def own_entries(obj: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The entries of an object whose chunks are in its own file, in file order."""
    return [t for t in obj["tensors"] if _is_own(t)]


def _open_tensor_file(full: str, size: int, name: str, version: int,
                      fds: List[int]) -> Tuple[int, bytes]:
    """A tensor file opened as a regular file of ``size`` bytes, its header checked
    against ``version``; returns the descriptor (added to ``fds``) and the header."""
    fd = open_regular(full)
    fds.append(fd)
    _check_size(full, os.fstat(fd).st_size, size, name)
    header = os.pread(fd, fmt.HEADER_BYTES, 0)
    fmt.check_tensor_file_header(header, path=full, version=version)
    return fd, header


def _direct(full: str, fd: int, fds: List[int]) -> Optional[int]:
    direct = fastread.open_direct(full, fd)
    if direct is not None:
        fds.append(direct)
    return direct


# --- stored bytes to tensors ----------------------------------------------------------
# The one place a tensor entry of a manifest (dtype, shape) becomes a tensor and the
# memory its bytes are read into, whatever holds those bytes: this snapshot's files
# (load_objects, and format v1 in order), or a daemon's in-memory copy
# (snapd_client/hotrestore.py). Read either way, a snapshot restores the same tensors.

def destinations(entries: List[Dict[str, Any]], into: Optional[Dict[str, Any]] = None
                 ) -> List[Optional[torch.Tensor]]:
    """Where each entry's bytes go, by :func:`destination`; None for an entry another
    rank stores (``ref``). ``into``: tensors the caller holds now, by path."""
    into = into or {}
    return [None if "ref" in t else destination(into.get(t["path"]), t) for t in entries]


def destination(live: Any, meta: Dict[str, Any]) -> torch.Tensor:
    """``live`` when the entry's bytes can go straight into it: a plain CPU tensor (or
    Parameter) of the saved dtype and shape, contiguous, that does not require grad
    (a leaf of autograd's graph is not written behind its back: load_state_dict
    copies into it under no_grad); else new memory, which never requires grad."""
    import torch  # here, not at the top: the daemon checks manifests without it
    dtype = fmt.DTYPES[meta["dtype"]]
    if type(live) in (torch.Tensor, torch.nn.Parameter) and live.dtype == dtype and \
            list(live.shape) == list(meta["shape"]) and live.device.type == "cpu" and \
            live.is_contiguous() and not live.requires_grad:
        return live
    return new_tensor(meta["shape"], dtype)


# Below this, a tensor is read through the reader thread's page-aligned buffer at the
# cost of one small copy; from it up, it gets page-aligned memory of its own, which
# direct I/O fills without that copy (torch's allocator aligns to 64 bytes only).
ALIGNED_FROM = 1 << 20


def new_tensor(shape: List[int], dtype: Any) -> torch.Tensor:
    """New memory for a tensor the files fill; page-aligned when large."""
    import torch
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes < ALIGNED_FROM:
        return torch.empty(shape, dtype=dtype)
    # An anonymous mapping is page-aligned; the tensor holds it for as long as it lives.
    buf = mmap.mmap(-1, nbytes)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)


def bytes_of(t: torch.Tensor) -> memoryview:
    """A destination's memory as bytes, for a byte source to fill."""
    import torch
    if not t.numel():
        return memoryview(bytearray())
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _check_size(path: str, size: int, listed: int, name: str) -> None:
    if size != listed:
        raise CorruptSnapshot(
            f"{path}: {size} bytes on disk, manifest field files[{name!r}].size says "
            f"{listed} (truncated or replaced); use an older snapshot", path=path,
            field="size")


def _check_tiling(tensors: List[Dict[str, Any]], size: int, path: str, align: int) -> None:
    """Chunks must follow the header in order, each at the first multiple of ``align``
    after the previous one (v1: ``align`` 1, back to back), and end the file likewise."""
    end = fmt.HEADER_BYTES
    for t in tensors:
        for chunk in t["chunks"]:
            expected = fmt.align_up(end, align)
            if chunk[0] != expected:
                raise CorruptSnapshot(f"{path}: chunk of tensor {t['path']!r} at offset "
                                      f"{chunk[0]}, expected {expected}", path=path,
                                      field="chunks")
            end = chunk[0] + chunk[1]
    if fmt.align_up(end, align) != size:
        raise CorruptSnapshot(f"{path}: chunks end at byte {end}, so the file should "
                              f"be {fmt.align_up(end, align)} bytes, not {size}",
                              path=path, field="chunks")


class _FileWalk:
    """Follows a tensor file in order: feeds the file digest, and checks the bytes
    between chunks. Version 2 requires them to be zero (no digest covers them);
    version 1 has none (tiling is checked before)."""

    def __init__(self, path: str, fd: int, digest: fmt.FileDigest) -> None:
        self.path, self.fd, self.digest = path, fd, digest
        self.pos = 0

    def header(self, data: bytes) -> None:
        self.digest.header(data)
        self.pos = len(data)

    def chunk(self, stored, chunk_digest: int) -> None:
        self.digest.chunk(stored, chunk_digest)
        self.pos += len(stored)

    def padding_to(self, offset: int) -> None:
        if offset <= self.pos:
            return
        gap = os.pread(self.fd, offset - self.pos, self.pos)
        if len(gap) != offset - self.pos:
            raise CorruptSnapshot(f"{self.path}: short read at byte {self.pos}",
                                  path=self.path, field="size")
        if gap.count(0) != len(gap):
            raise CorruptSnapshot(f"{self.path}: padding at bytes {self.pos}..{offset} "
                                  "is not zero; the file is damaged, use an older "
                                  "snapshot", path=self.path, field="padding")
        self.pos = offset
