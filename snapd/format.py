"""Snapshot format v2: the manifest, tensor files and chunks. Encode, decode, verify.

This module is the code form of docs/format.md; the two change together. It does no
I/O policy (no fsync, no directory layout): it turns structures into bytes and back,
and says whether bytes are valid.

Manifest file ``manifest.snapd``::

    offset  size  field
    0       8     magic  b"SNAPDMF\\0"
    8       4     format version, u32 little-endian (2; 1 is still read)
    12      4     flags, u32 (0)
    16      8     payload length P, u64
    24      8     xxh3-64 of the payload, u64
    32      P     payload: one msgpack map (see docs/format.md)

A manifest is valid if and only if the magic and version match, the file is exactly
32 + P bytes, the checksum holds, and the payload passes :func:`check_manifest`.

Tensor file ``<object>.tensors``: a 32-byte header (magic b"SNAPDTN\\0", u32 version,
u32 flags, 16 reserved zero bytes), then chunks, each starting at the first multiple
of 4096 after the previous one ends (v1: back to back), the gaps zero, the file
ending on a multiple of 4096 (so that the writer can use direct I/O). Each chunk is the raw
bytes of part of one tensor, stored raw or zstd-compressed; the manifest records its
offset, stored length, raw length, codec and the xxh3-64 of the stored bytes. A chunk
is valid if and only if its stored bytes hash to that value and (zstd) decompress to
exactly the raw length.
"""

from __future__ import annotations

import math
import re
import struct
import threading
from typing import Any, Dict, List, Tuple

import msgpack
import xxhash
import zstandard

from snapd.errors import CorruptSnapshot

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)  # v1: chunks back to back; v2: each on a 4096-byte boundary
CHUNK_ALIGN = 4096
MANIFEST_NAME = "manifest.snapd"
MANIFEST_MAGIC = b"SNAPDMF\0"
TENSOR_MAGIC = b"SNAPDTN\0"
_MANIFEST_HEADER = struct.Struct("<8sIIQQ")
_TENSOR_HEADER = struct.Struct("<8sII16x")
HEADER_BYTES = 32
TENSOR_FILE_SUFFIX = ".tensors"
CODEC_RAW, CODEC_ZSTD = "raw", "zstd"
MAX_MANIFEST_BYTES = 256 << 20

# The format's element types, by name, and their sizes in bytes. Writing and checking
# a snapshot needs only this table, so the daemon, which moves bytes, never imports
# torch (that import alone takes ~1.4 s and ~150 MiB here).
ITEMSIZES: Dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "complex64": 8,
    "complex128": 16, "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1,
    "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "uint16": 2, "uint32": 4,
    "uint64": 8,
}
_SAFE_FILE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")


def __getattr__(name: str) -> Any:
    """``DTYPES``, the torch dtype of each name in ITEMSIZES, built on first use.

    The only dtypes a reader will construct: names map to torch dtypes through this
    table, never through getattr on a string read from disk.
    """
    if name != "DTYPES":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import torch
    table = {name: getattr(torch, name) for name in ITEMSIZES}  # our names, not the disk's
    globals()["DTYPES"] = table
    return table


def dtype_name(dtype: Any) -> str:
    """The format's name of a torch dtype."""
    name = str(dtype).removeprefix("torch.")
    if name not in ITEMSIZES:
        raise CorruptSnapshot(f"dtype {name} has no snapd encoding", field="dtype")
    return name


def checksum(data) -> int:
    return xxhash.xxh3_64_intdigest(data)


# --- manifest ---------------------------------------------------------------------

def encode_manifest(manifest: Dict[str, Any]) -> bytes:
    payload = msgpack.packb(manifest, use_bin_type=True)
    header = _MANIFEST_HEADER.pack(MANIFEST_MAGIC, FORMAT_VERSION, 0, len(payload),
                                   checksum(payload))
    return header + payload


def decode_manifest(data: bytes, *, path: str) -> Dict[str, Any]:
    """Bytes of a manifest file to its map, or CorruptSnapshot naming what failed."""
    if len(data) < HEADER_BYTES:
        raise CorruptSnapshot(f"{path}: manifest is {len(data)} bytes, shorter than its "
                              "32-byte header (truncated write?); use an older snapshot",
                              path=path, field="header")
    magic, version, _flags, length, digest = _MANIFEST_HEADER.unpack_from(data)
    if magic != MANIFEST_MAGIC:
        raise CorruptSnapshot(f"{path}: not a snapd manifest (magic {magic!r})",
                              path=path, field="magic")
    if version not in READABLE_VERSIONS:
        raise CorruptSnapshot(f"{path}: manifest format version {version}; this snapd "
                              f"reads versions {list(READABLE_VERSIONS)}. Upgrade snapd",
                              path=path, field="version")
    if length != len(data) - HEADER_BYTES:
        raise CorruptSnapshot(f"{path}: header declares a {length}-byte payload but the "
                              f"file holds {len(data) - HEADER_BYTES} (truncated?)",
                              path=path, field="payload_length")
    payload = data[HEADER_BYTES:]
    if checksum(payload) != digest:
        raise CorruptSnapshot(f"{path}: manifest checksum mismatch; the file is damaged",
                              path=path, field="checksum")
    try:
        manifest = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several types for malformed input
        raise CorruptSnapshot(f"{path}: manifest payload is not valid msgpack: {e}",
                              path=path, field="payload") from e
    check_manifest(manifest, path=path, version=version)
    return manifest


def _need(cond: bool, path: str, field: str, what: str) -> None:
    if not cond:
        raise CorruptSnapshot(f"{path}: field {field} {what}; the snapshot is damaged "
                              "or hostile, use an older one", path=path, field=field)


def check_manifest(m: Any, *, path: str, version: int = FORMAT_VERSION) -> None:
    """Structural validation of a decoded manifest; file sizes are checked by the reader."""
    _need(isinstance(m, dict), path, "manifest", "is not a map")
    _need(m.get("format") == version, path, "format",
          f"is not {version}, the version in the manifest's header")
    _need(isinstance(m.get("step"), int) and m["step"] >= 0, path, "step",
          "is not a non-negative integer")
    _need(isinstance(m.get("rng"), dict), path, "rng", "is missing")
    _need(isinstance(m.get("objects"), dict), path, "objects", "is missing")
    files = m.get("files")
    _need(isinstance(files, dict), path, "files", "is missing")
    for name, entry in files.items():
        _need(isinstance(name, str) and bool(_SAFE_FILE.match(name)) and ".." not in name,
              path, f"files[{name!r}]", "is not a plain file name inside the snapshot")
        _need(isinstance(entry, dict) and _is_uint(entry.get("size"))
              and _is_uint(entry.get("xxh3")), path, f"files[{name!r}]",
              "lacks size/xxh3")
    for obj_name, obj in m["objects"].items():
        _check_object(obj_name, obj, files, path)


def _is_uint(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _check_object(name: str, obj: Any, files: dict, path: str) -> None:
    field = f"objects.{name}"
    _need(isinstance(obj, dict) and isinstance(obj.get("skeleton"), bytes), path,
          f"{field}.skeleton", "is missing")
    tensors = obj.get("tensors")
    _need(isinstance(tensors, list), path, f"{field}.tensors", "is missing")
    if tensors:
        _need(obj.get("file") in files, path, f"{field}.file",
              "names no file listed in files")
    size = files[obj["file"]]["size"] if tensors else 0
    for i, t in enumerate(tensors):
        _check_tensor(t, size, path, f"{field}.tensors[{i}]")


def _check_tensor(t: Any, file_size: int, path: str, field: str) -> None:
    _need(isinstance(t, dict) and t.get("dtype") in ITEMSIZES, path, f"{field}.dtype",
          "is not a known dtype")
    shape = t.get("shape")
    _need(isinstance(shape, list) and all(_is_uint(s) for s in shape), path,
          f"{field}.shape", "is not a list of sizes")
    nbytes = math.prod(shape) * ITEMSIZES[t["dtype"]]
    _need(t.get("nbytes") == nbytes, path, f"{field}.nbytes", "disagrees with shape")
    _need(_is_uint(t.get("xxh3")), path, f"{field}.xxh3", "is missing")
    raw_total = 0
    for chunk in t.get("chunks", []):
        _need(isinstance(chunk, list) and len(chunk) == 5, path, f"{field}.chunks",
              "has a malformed entry")
        offset, stored, raw, codec, digest = chunk
        _need(all(_is_uint(v) for v in (offset, stored, raw, digest))
              and codec in (CODEC_RAW, CODEC_ZSTD), path, f"{field}.chunks",
              "has a malformed entry")
        _need(offset >= HEADER_BYTES and offset + stored <= file_size, path,
              f"{field}.chunks", f"points past the end of its {file_size}-byte file")
        _need(codec == CODEC_ZSTD or stored == raw, path, f"{field}.chunks",
              "declares a raw chunk whose sizes differ")
        raw_total += raw
    _need(raw_total == nbytes, path, f"{field}.chunks",
          f"add up to {raw_total} bytes, not the {nbytes} the shape needs")


# --- tensor files and chunks ------------------------------------------------------

def tensor_file_header() -> bytes:
    return _TENSOR_HEADER.pack(TENSOR_MAGIC, FORMAT_VERSION, 0)


class FileDigest:
    """``files[name].xxh3`` of a tensor file, fed in file order.

    Version 1: the xxh3-64 of every byte of the file. Version 2: the xxh3-64 of the
    32-byte header followed by each chunk's 8-byte little-endian xxh3 in file order,
    so that no byte is hashed twice (each chunk's own digest already covers it) and
    the padding, which no digest covers, must be zero instead.
    """

    def __init__(self, version: int) -> None:
        self.version = version
        self._hasher = xxhash.xxh3_64()

    def header(self, data) -> None:
        self._hasher.update(data)

    def chunk(self, stored, digest: int) -> None:
        self._hasher.update(stored if self.version == 1 else _DIGEST.pack(digest))

    def intdigest(self) -> int:
        return self._hasher.intdigest()


_DIGEST = struct.Struct("<Q")


def align_up(n: int, to: int = CHUNK_ALIGN) -> int:
    """The first multiple of ``to`` at or after ``n``."""
    return (n + to - 1) // to * to


def chunk_alignment(version: int) -> int:
    """Where chunks may start in a tensor file of this version: multiples of this."""
    return 1 if version == 1 else CHUNK_ALIGN


def check_tensor_file_header(data: bytes, *, path: str, version: int) -> None:
    """A tensor file's header must carry the version of the manifest listing it."""
    if len(data) < HEADER_BYTES:
        raise CorruptSnapshot(f"{path}: tensor file shorter than its header",
                              path=path, field="header")
    magic, found, _flags = _TENSOR_HEADER.unpack_from(data)
    if magic != TENSOR_MAGIC or found != version:
        raise CorruptSnapshot(f"{path}: bad tensor file header (magic {magic!r}, "
                              f"version {found}, manifest version {version})", path=path,
                              field="header")


_local = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    """One compressor per thread and level: they are not thread-safe, and costly to make."""
    cache = getattr(_local, "compressors", None)
    if cache is None:
        cache = _local.compressors = {}
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(level=level)
    return cache[level]


def encode_chunk(raw, level: int | None) -> Tuple[bytes | memoryview, str]:
    """Stored bytes and codec for one chunk: zstd at ``level``, or the raw bytes."""
    if level is None:
        return raw, CODEC_RAW
    return _compressor(level).compress(raw), CODEC_ZSTD


def decode_chunk(stored, chunk: List[Any], *, path: str, field: str):
    """Verify one stored chunk and return its raw bytes."""
    _offset, _stored_len, raw_len, codec, digest = chunk
    if checksum(stored) != digest:
        raise CorruptSnapshot(f"{path}: checksum mismatch in {field} at byte offset "
                              f"{chunk[0]}; the file is damaged, use an older snapshot",
                              path=path, field=field)
    if codec == CODEC_RAW:
        return stored
    try:
        # A hostile frame may declare a huge content size: check it before allocating.
        declared = zstandard.frame_content_size(stored)
        if declared not in (-1, raw_len):
            raise zstandard.ZstdError(f"frame declares {declared} bytes")
        raw = zstandard.ZstdDecompressor().decompress(stored, max_output_size=raw_len)
    except zstandard.ZstdError as e:
        raise CorruptSnapshot(f"{path}: {field} does not decompress: {e}",
                              path=path, field=field) from e
    if len(raw) != raw_len:
        raise CorruptSnapshot(f"{path}: {field} decompresses to {len(raw)} bytes, "
                              f"not {raw_len}", path=path, field=field)
    return raw
