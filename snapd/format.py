"""Snapshot format v5: the manifest, tensor files and chunks. Encode, decode, verify.

This module is the code form of docs/format.md; the two change together (the offset
tables there are read by tests/test_format_doc.py). It does no I/O policy (no fsync,
no directory layout): it turns structures into bytes and back, and says whether
bytes are valid.

Manifest file ``manifest.snapd`` (and ``commit.snapd``, the same framing with magic
b"SNAPDGC\\0", versions 3 to 5 read)::

    offset  size  field
    0       8     magic  b"SNAPDMF\\0"
    8       4     format version, u32 little-endian (5; 1 to 4 are still read)
    12      4     flags, u32 (v5: bit 0, SIGNED; below v5 written 0, not read)
    16      8     payload length P, u64
    24      8     xxh3-64 of the payload, u64
    32      P     payload: one msgpack map (see docs/format.md)
    32+P    40    v5, SIGNED only: key id (8 bytes), then the HMAC-SHA-256 of bytes
                  0 .. 32+P under that key (32 bytes); snapd/signing.py checks it

A manifest is valid if and only if the magic matches, the version is in
READABLE_VERSIONS, the file is exactly 32 + P bytes (32 + P + 40 when signed), the checksum holds, and the
payload passes :func:`check_manifest` for that version (its ``format`` equal to the
header's; ``shared`` entries and six-item chunk entries only in v4).

Tensor file ``<object>.tensors``: a 32-byte header (magic b"SNAPDTN\\0", u32 version,
the manifest's; u32 flags, 16 reserved zero bytes), then chunks, each starting at the
first multiple of 4096 at or after the end of the previous one, the padding zero, the
file ending on a multiple of 4096 (so that the writer can use direct I/O); in v1 the
chunks are back to back from byte 32, the last ending the file. Each chunk is the raw bytes of part of one tensor, stored raw or
zstd-compressed; the manifest records its offset, stored length, raw length, codec
and the xxh3-64 of the stored bytes (v4: and of a frozen tensor, the xxh3-128 of the
raw bytes). A chunk is valid if and only if its stored bytes hash to that value and
(zstd) decompress to exactly the raw length. The file digest (``files[name].xxh3``,
:class:`FileDigest`) is, in v1, the xxh3-64 of the whole file; from v2, of the header
and the chunks' digests in file order. From v5 a file's entry may also carry
``sha256``, the SHA-256 of every byte of the file (what ``sha256sum`` prints): xxh3
catches damage, SHA-256 a forgery, since nobody can make other bytes with the same.
"""

from __future__ import annotations

import hashlib
import math
import re
import struct
import threading
from typing import Any, Dict, List, Optional, Tuple

import msgpack
import xxhash
import zstandard

from snapd.errors import CorruptSnapshot

FORMAT_VERSION = 5
# v1: chunks back to back; v2: each on a 4096-byte boundary; v3: parts of a multi-rank
# snapshot (a session, sharded and referenced tensor entries) and the commit record;
# v4: tensors whose bytes are an earlier snapshot's file (``shared``, ``src``), each
# chunk's identity (xxh3-128 of its raw bytes), the base model's reference (``base``);
# v5: the SHA-256 of each file (``files[name].sha256``) and of each part's manifest in
# the commit record (``parts[r].manifest_sha256``).
READABLE_VERSIONS = (1, 2, 3, 4, 5)
COMMIT_VERSIONS = (3, 4, 5)   # a commit record of a multi-rank snapshot
# A v4 tensor entry may refer to a file of these versions (4096-aligned chunks whose
# entries carry an identity).
SHAREABLE_VERSIONS = (4, 5)
SHA256_FROM = 5     # the first version whose files and parts may carry a SHA-256
SIGNED_FROM = 5     # ... and whose manifests and records may be signed
SHA256_BYTES = 32
CHUNK_ID_BYTES = 16
# A committed snapshot's directory name: the step as 8+ digits, then .L<lineage> when
# the lineage is not 0 (snapd/store.py orders snapshots by it).
SNAPSHOT_NAME = re.compile(r"^(\d{8,})(?:\.L(\d+))?$")
CHUNK_ALIGN = 4096
MANIFEST_NAME = "manifest.snapd"
MANIFEST_MAGIC = b"SNAPDMF\0"
COMMIT_NAME = "commit.snapd"   # a multi-rank snapshot's global commit record
COMMIT_MAGIC = b"SNAPDGC\0"
TENSOR_MAGIC = b"SNAPDTN\0"
_MANIFEST_HEADER = struct.Struct("<8sIIQQ")
_TENSOR_HEADER = struct.Struct("<8sII16x")
HEADER_BYTES = 32
TENSOR_FILE_SUFFIX = ".tensors"
CODEC_RAW, CODEC_ZSTD = "raw", "zstd"
MAX_MANIFEST_BYTES = 256 << 20
FLAG_SIGNED = 1        # v5 header flag: a signature trailer follows the payload
KEY_ID_BYTES = 8
SIGNATURE_BYTES = KEY_ID_BYTES + 32   # key id, HMAC-SHA-256

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


def sha256_of(data) -> bytes:
    """The SHA-256 of ``data``, 32 bytes (a manifest's, a commit record's)."""
    return hashlib.sha256(data).digest()


def is_sha256(v: Any) -> bool:
    return isinstance(v, bytes) and len(v) == SHA256_BYTES


def chunk_id(raw) -> bytes:
    """A chunk's identity (v4): the xxh3-128 of its raw bytes, 16 bytes. With the raw
    length it names the content: two chunks with equal ids are the same bytes (a
    collision needs about 2^64 chunks), so the writer refers to a committed chunk
    instead of writing it again."""
    return xxhash.xxh3_128_digest(raw)


def snapshot_name_of(m: Dict[str, Any]) -> str:
    """The directory name a manifest's step and lineage give."""
    lineage = m["lineage"].get("id", 0)
    return f"{m['step']:08d}" + (f".L{lineage}" if lineage else "")


# --- manifest ---------------------------------------------------------------------

def encode_manifest(manifest: Dict[str, Any], signer: Any = None) -> bytes:
    """``signer``: a key that signs (snapd/signing.py ``Keys`` with a signing key), or
    None for an unsigned manifest."""
    return _framed(MANIFEST_MAGIC, manifest, signer)


def _framed(magic: bytes, value: Dict[str, Any], signer: Any = None) -> bytes:
    payload = msgpack.packb(value, use_bin_type=True)
    header = _MANIFEST_HEADER.pack(magic, FORMAT_VERSION,
                                   FLAG_SIGNED if signer is not None else 0,
                                   len(payload), checksum(payload))
    if signer is None:
        return header + payload
    return header + payload + signer.signature(header + payload)


def signature_of(data: bytes) -> Optional[Tuple[bytes, bytes, bytes]]:
    """A framed file's signature as ``(key id, HMAC, the bytes it covers)``, or None
    when it is unsigned (or of a version before 5). The file must have decoded."""
    _magic, version, flags, length, _digest = _MANIFEST_HEADER.unpack_from(data)
    if version < SIGNED_FROM or not flags & FLAG_SIGNED:
        return None
    end = HEADER_BYTES + length
    return data[end:end + KEY_ID_BYTES], data[end + KEY_ID_BYTES:], data[:end]


def decode_manifest(data: bytes, *, path: str) -> Dict[str, Any]:
    """Bytes of a manifest file to its map, or CorruptSnapshot naming what failed."""
    manifest, version = _unframe(data, MANIFEST_MAGIC, "manifest", READABLE_VERSIONS,
                                 path=path)
    check_manifest(manifest, path=path, version=version)
    return manifest


def encode_commit(record: Dict[str, Any], signer: Any = None) -> bytes:
    """A multi-rank snapshot's global commit record (docs/multirank.md)."""
    return _framed(COMMIT_MAGIC, record, signer)


def decode_commit(data: bytes, *, path: str) -> Dict[str, Any]:
    """Bytes of ``commit.snapd`` to its map, or CorruptSnapshot naming what failed."""
    record, version = _unframe(data, COMMIT_MAGIC, "commit record", COMMIT_VERSIONS,
                               path=path)
    check_commit(record, path=path, version=version)
    return record


def _unframe(data: bytes, magic_wanted: bytes, what: str, versions: Tuple[int, ...], *,
             path: str) -> Tuple[Any, int]:
    if len(data) < HEADER_BYTES:
        raise CorruptSnapshot(f"{path}: {what} is {len(data)} bytes, shorter than its "
                              "32-byte header (truncated write?); use an older snapshot",
                              path=path, field="header")
    magic, version, flags, length, digest = _MANIFEST_HEADER.unpack_from(data)
    if magic != magic_wanted:
        raise CorruptSnapshot(f"{path}: not a snapd {what} (magic {magic!r})",
                              path=path, field="magic")
    if version not in versions:
        raise CorruptSnapshot(f"{path}: {what} format version {version}; this snapd "
                              f"reads versions {list(versions)}. Upgrade snapd",
                              path=path, field="version")
    trailer = SIGNATURE_BYTES if version >= SIGNED_FROM and flags & FLAG_SIGNED else 0
    if length != len(data) - HEADER_BYTES - trailer:
        raise CorruptSnapshot(f"{path}: header declares a {length}-byte payload "
                              f"{'and a signature ' if trailer else ''}but the "
                              f"file holds {len(data) - HEADER_BYTES} (truncated?)",
                              path=path, field="payload_length")
    payload = data[HEADER_BYTES:HEADER_BYTES + length]
    if checksum(payload) != digest:
        raise CorruptSnapshot(f"{path}: {what} checksum mismatch; the file is damaged",
                              path=path, field="checksum")
    try:
        value = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several types for malformed input
        raise CorruptSnapshot(f"{path}: {what} payload is not valid msgpack: {e}",
                              path=path, field="payload") from e
    return value, version


def need(cond: bool, path: str, field: str, what: str) -> None:
    if not cond:
        raise CorruptSnapshot(f"{path}: field {field} {what}; the snapshot is damaged "
                              "or hostile, use an older one", path=path, field=field)


# Bounds of the schema: far above anything snapd writes, low enough that no check
# below can recurse deeply, loop for long or allocate much before it refuses.
MAX_DIMS = 64                  # torch's own limit on a tensor's dimensions
MAX_NAME = 1024                # characters of an object name, tensor path, type name
MAX_SKELETON_DEPTH = 32        # containers nested in a skeleton (tuples, maps, lists)
MAX_PLAIN_DEPTH = 64          # maps and lists nested in the cursor (a loader's state)
MAX_ZSTD_EXPANSION = 1 << 15   # a zstd frame cannot expand more: <= 128 KiB per
                               # block, >= 4 bytes per block


def is_uint(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < (1 << 64)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def is_name(v: Any) -> bool:
    return isinstance(v, str) and 0 < len(v) <= MAX_NAME


def check_manifest(m: Any, *, path: str, version: int = FORMAT_VERSION) -> None:
    """The manifest's schema, every field: types, ranges, lengths, and sizes against
    the sizes the manifest declares for its files. The reader checks those against
    the disk; nothing reads a field this has not checked."""
    need(isinstance(m, dict), path, "manifest", "is not a map")
    need(m.get("format") == version, path, "format",
          f"is not {version}, the version in the manifest's header")
    check_header_fields(m, path)
    check_lineage(m.get("lineage"), path)
    check_rng_map(m.get("rng"), path=path, field="rng")
    need(m.get("cursor") is None or isinstance(m.get("cursor"), dict), path, "cursor",
          "is neither nil nor a map")
    need(nests_within(m.get("cursor"), MAX_PLAIN_DEPTH), path, "cursor",
          f"nests deeper than {MAX_PLAIN_DEPTH} levels")
    need(isinstance(m.get("objects"), dict), path, "objects", "is missing")
    files = m.get("files")
    need(isinstance(files, dict), path, "files", "is missing")
    for name, entry in files.items():
        need(isinstance(name, str) and bool(_SAFE_FILE.match(name)) and ".." not in name,
              path, f"files[{name!r}]", "is not a plain file name inside the snapshot")
        need(isinstance(entry, dict) and is_uint(entry.get("size"))
              and is_uint(entry.get("xxh3")), path, f"files[{name!r}]",
              "lacks size/xxh3")
        need("sha256" not in entry or (version >= SHA256_FROM and is_sha256(entry["sha256"])),
             path, f"files[{name!r}].sha256", "is not 32 bytes (of version 5)")
    need(m.get("session") is None or is_name(m["session"]), path, "session",
          "is neither nil nor a name")
    check_shared(m, path, version)
    check_base(m.get("base"), path)
    for obj_name, obj in m["objects"].items():
        need(is_name(obj_name), path, f"objects[{obj_name!r}]", "is not a name")
        _check_object(obj_name, obj, files, path, m)


def check_header_fields(m: Dict[str, Any], path: str) -> None:
    need(is_uint(m.get("step")) and m["step"] < (1 << 63), path, "step",
          "is not a non-negative integer")
    need(m.get("run") is None or is_name(m.get("run")), path, "run", "is not a name")
    for key in ("rank", "world_size"):
        need(key not in m or is_uint(m[key]), path, key, "is not a count")
    need(m.get("world_size", 1) >= 1 and m.get("rank", 0) < m.get("world_size", 1),
          path, "rank", "is not below world_size")
    for key in ("created", "metric"):
        need(m.get(key) is None or _is_number(m[key]), path, key, "is not a number")
    need(m.get("data_version") is None or isinstance(m["data_version"], str), path,
          "data_version", "is neither nil nor a string")


def check_lineage(lineage: Any, path: str) -> None:
    need(isinstance(lineage, dict), path, "lineage", "is not a map")
    need(is_uint(lineage.get("id", 0)) and lineage.get("id", 0) < (1 << 63), path,
          "lineage.id", "is not a non-negative integer")
    need(lineage.get("mode") is None or isinstance(lineage["mode"], str), path,
          "lineage.mode", "is not a string")
    parent = lineage.get("parent")
    need(parent is None or (isinstance(parent, dict)
                             and all(isinstance(parent.get(k), (str, type(None)))
                                     for k in ("run", "snapshot"))
                             and (parent.get("step") is None or is_uint(parent["step"]))),
          path, "lineage.parent", "is neither nil nor {run, snapshot, step}")


def nests_within(value: Any, limit: int) -> bool:
    """Whether maps and lists nest at most ``limit`` deep (walked without recursion,
    so that the code that later walks the value recursively cannot overflow)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > limit:
                return False
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return True


def check_rng_map(rng: Any, *, path: str, field: str) -> None:
    """A map of stream name to encoded state (their lengths are the client's check)."""
    need(isinstance(rng, dict), path, field, "is not a map")
    for name, blob in rng.items():
        need(is_name(name), path, f"{field}[{name!r}]", "is not a stream name")
        need(isinstance(blob, bytes), path, f"{field}.{name}", "is not bytes")


def _check_object(name: str, obj: Any, files: dict, path: str,
                  m: Dict[str, Any]) -> None:
    field = f"objects.{name}"
    need(isinstance(obj, dict), path, field, "is not a map")
    need(obj.get("type") is None or is_name(obj["type"]), path, f"{field}.type",
          "is not a type name")
    need(isinstance(obj.get("skeleton"), bytes), path, f"{field}.skeleton", "is missing")
    check_skeleton(obj["skeleton"], path=path, field=f"{field}.skeleton")
    if obj.get("metadata") is not None:
        need(isinstance(obj["metadata"], bytes), path, f"{field}.metadata",
              "is neither nil nor bytes")
        check_skeleton(obj["metadata"], path=path, field=f"{field}.metadata")
    tensors = obj.get("tensors")
    need(isinstance(tensors, list), path, f"{field}.tensors", "is missing")
    # Entries whose bytes are another rank's part (ref) or an earlier snapshot's file
    # (src) have no bytes here: an object of only those has no file.
    stored_here = [t for t in tensors if not (isinstance(t, dict)
                                              and ("ref" in t or "src" in t))]
    if stored_here:
        need(isinstance(obj.get("file"), str) and obj["file"] in files, path,
              f"{field}.file", "names no file listed in files")
    else:
        need(obj.get("file") is None or isinstance(obj["file"], str), path,
              f"{field}.file", "is neither nil nor a file name")
    size = files[obj["file"]]["size"] if stored_here else 0
    shared = m.get("shared") or []
    for i, t in enumerate(tensors):
        where = f"{field}.tensors[{i}]"
        src = t.get("src") if isinstance(t, dict) else None
        if src is not None:
            need(is_uint(src) and src < len(shared) and "ref" not in t, path,
                 f"{where}.src", "is not an index into shared (nor beside ref)")
        _check_tensor(t, size if src is None else shared[src]["size"], path, where,
                      m["format"])
        check_placement(t, m, path, where)


def check_placement(t: Dict[str, Any], m: Dict[str, Any], path: str, field: str) -> None:
    """Version 3's optional keys: ``shard`` (a piece of a sharded tensor) and ``ref``
    (a replicated tensor whose bytes are in another rank's part)."""
    if "shard" in t:
        shard, shape = t["shard"], t["shape"]
        need(isinstance(shard, dict) and isinstance(shard.get("global_shape"), list)
             and isinstance(shard.get("offset"), list)
             and len(shard["global_shape"]) == len(shard["offset"]) == len(shape)
             and all(is_uint(v) for v in shard["global_shape"] + shard["offset"])
             and all(o + n <= g for o, n, g in
                     zip(shard["offset"], shape, shard["global_shape"])),
             path, f"{field}.shard", "is not a piece {global_shape, offset} that holds "
             "the entry's shape")
    if "ref" in t:
        need(is_uint(t["ref"]) and t["ref"] < m.get("world_size", 1)
             and t["ref"] != m.get("rank", 0), path, f"{field}.ref",
             "is not another rank of this snapshot")
        need(t.get("chunks") == [], path, f"{field}.chunks",
             "is not empty in an entry stored by another rank (ref)")


def check_shared(m: Dict[str, Any], path: str, version: int) -> None:
    """v4's ``shared``: the earlier snapshots' tensor files this one's ``src`` entries
    read, each ``{snapshot, file, size, format}``; never this snapshot itself."""
    shared = m.get("shared", [])
    need(isinstance(shared, list) and (not shared or version >= 4), path, "shared",
         "is not a list (of version 4)")
    seen = set()
    for i, s in enumerate(shared):
        need(isinstance(s, dict) and isinstance(s.get("snapshot"), str)
             and bool(SNAPSHOT_NAME.match(s["snapshot"]))
             and isinstance(s.get("file"), str) and bool(_SAFE_FILE.match(s["file"]))
             and ".." not in s["file"] and is_uint(s.get("size"))
             and s.get("format") in SHAREABLE_VERSIONS, path, f"shared[{i}]",
             "is not {snapshot, file, size, format} naming a tensor file of a "
             "committed snapshot")
        need((s["snapshot"], s["file"]) not in seen, path, f"shared[{i}]",
             "lists a file twice")
        need(s["snapshot"] != snapshot_name_of(m), path, f"shared[{i}].snapshot",
             "names this snapshot itself")
        seen.add((s["snapshot"], s["file"]))


BASE_KEYS = ("name", "revision", "digest")


def check_base(base: Any, path: str) -> None:
    """v4's ``base``: nil, or the base model's ``{name, revision, digest}`` (strings;
    the digest is snapd's own, 32 hex digits, snapd_client/basemodel.py)."""
    need(base is None or (isinstance(base, dict)
                          and all(isinstance(base.get(k), str) and len(base[k]) <= MAX_NAME
                                  for k in BASE_KEYS)
                          and bool(re.fullmatch(r"[0-9a-f]{32}", base["digest"]))),
         path, "base", "is neither nil nor {name, revision, digest}")


def check_commit(r: Any, *, path: str, version: int = FORMAT_VERSION) -> None:
    """The global commit record's schema (docs/format.md, "commit.snapd")."""
    need(isinstance(r, dict), path, "commit", "is not a map")
    need(r.get("format") == version, path, "format",
         f"is not {version}, the version in the record's header")
    check_header_fields(r, path)
    check_lineage(r.get("lineage"), path)
    need(is_name(r.get("session")), path, "session", "is not a name")
    parts = r.get("parts")
    need(isinstance(parts, list) and len(parts) == r.get("world_size")
         and r.get("world_size", 0) >= 2, path, "parts",
         "does not list one part per rank of world_size (at least 2)")
    for i, part in enumerate(parts):
        need(isinstance(part, dict) and part.get("rank") == i
             and part.get("dir") == part_dir_name(i)
             and is_uint(part.get("manifest_size")) and is_uint(part.get("manifest_xxh3")),
             path, f"parts[{i}]", f"is not {{rank: {i}, dir: {part_dir_name(i)!r}, "
             "manifest_size, manifest_xxh3}")
        need("manifest_sha256" not in part or (version >= SHA256_FROM
                                               and is_sha256(part["manifest_sha256"])),
             path, f"parts[{i}].manifest_sha256", "is not 32 bytes (of version 5)")
    need(is_uint(r.get("bytes")), path, "bytes", "is not a byte count")


def part_dir_name(rank: int) -> str:
    """The directory of rank ``rank``'s part inside a multi-rank snapshot."""
    return f"rank-{rank:05d}"


def _check_tensor(t: Any, file_size: int, path: str, field: str,
                  version: int = FORMAT_VERSION) -> None:
    need(isinstance(t, dict), path, field, "is not a map")
    need(is_name(t.get("path")) or t.get("path") == "", path, f"{field}.path",
          "is not a string")
    need(isinstance(t.get("dtype"), str) and t["dtype"] in ITEMSIZES, path,
          f"{field}.dtype", "is not a known dtype")
    need(t.get("device") is None or is_name(t["device"]), path, f"{field}.device",
          "is not a device name")
    shape = t.get("shape")
    need(isinstance(shape, list) and len(shape) <= MAX_DIMS
          and all(is_uint(s) for s in shape), path, f"{field}.shape",
          "is not a list of sizes")
    nbytes = math.prod(shape) * ITEMSIZES[t["dtype"]]
    need(is_uint(t.get("nbytes")) and t["nbytes"] == nbytes, path, f"{field}.nbytes",
          "disagrees with shape")
    need(is_uint(t.get("xxh3")), path, f"{field}.xxh3", "is missing")
    need(t.get("frozen", True) is True, path, f"{field}.frozen", "is not true when present")
    chunks = t.get("chunks", [])
    need(isinstance(chunks, list), path, f"{field}.chunks", "is not a list")
    raw_total = 0
    for chunk in chunks:
        raw_total += _check_chunk(chunk, file_size, path, f"{field}.chunks", version)
    need(raw_total == nbytes or "ref" in t, path, f"{field}.chunks",
          f"add up to {raw_total} bytes, not the {nbytes} the shape needs")


def _check_chunk(chunk: Any, file_size: int, path: str, field: str,
                 version: int = FORMAT_VERSION) -> int:
    """One ``[offset, stored, raw, codec, xxh3]`` entry, with v4's optional sixth
    item, the chunk's identity (16 bytes); returns its raw length."""
    need(isinstance(chunk, list) and (len(chunk) == 5 or (
        version >= 4 and len(chunk) == 6 and isinstance(chunk[5], bytes)
        and len(chunk[5]) == CHUNK_ID_BYTES)), path, field, "has a malformed entry")
    offset, stored, raw, codec, digest = chunk[:5]
    need(all(is_uint(v) for v in (offset, stored, raw, digest))
          and codec in (CODEC_RAW, CODEC_ZSTD), path, field, "has a malformed entry")
    need(offset >= HEADER_BYTES and offset + stored <= file_size, path, field,
          f"points past the end of its {file_size}-byte file")
    need(codec == CODEC_ZSTD or stored == raw, path, field,
          "declares a raw chunk whose sizes differ")
    # What a chunk may declare is bounded by the bytes it occupies: no allocation is
    # ever sized by a number the file cannot back.
    need(raw <= stored * MAX_ZSTD_EXPANSION, path, field,
          f"declares {raw} raw bytes from {stored} stored, more than zstd can expand")
    return raw


# --- skeletons --------------------------------------------------------------------

# The skeleton's extension codes (docs/format.md, "Skeleton extension types"). They are
# defined here, beside the scanner that must know which ones hold msgpack; the codec
# that gives them meaning is snapd/skeleton.py.
EXT_TENSOR = 1     # u32 index into the object's tensor list
EXT_TUPLE = 2      # msgpack array of the items
EXT_DTYPE = 3      # dtype name, utf-8
EXT_NDARRAY = 4    # u32 index; the tensor comes back as a numpy array
EXT_NPSCALAR = 5   # msgpack [dtype name, raw bytes]
EXT_DEVICE = 6     # device string, utf-8
EXT_ORDERED = 7    # msgpack array of [key, value] pairs (OrderedDict, order kept)
_EXT_CONTAINERS = (EXT_TUPLE, EXT_NPSCALAR, EXT_ORDERED)  # msgpack inside


def check_skeleton(data: bytes, *, path: str, field: str) -> None:
    """A skeleton is one msgpack container (a state dict is a map, an ordered-map
    extension; restore requires that of a tracked object) whose containers,
    extension containers included, nest at most MAX_SKELETON_DEPTH deep.

    Scanned without recursion through msgpack (its decoder recurses through the
    extension hook once per nested extension, on the C stack): this runs before
    any decoder sees the bytes, so no hostile skeleton can exhaust a stack.
    """
    try:
        first = data[0] if data else None
        is_container = first is not None and (
            0x80 <= first <= 0x9f or first in _COUNTED
            or _ext_code_at(data, 0) in (EXT_TUPLE, EXT_ORDERED))
        need(is_container, path, field, "is not a map or an array")
        end = _scan(data, 0, 0, path, field)
    except (IndexError, struct.error) as e:
        raise CorruptSnapshot(f"{path}: field {field} is truncated msgpack; the snapshot "
                              "is damaged or hostile, use an older one", path=path,
                              field=field) from e
    need(end == len(data), path, field, "has bytes after its value")


# msgpack type bytes: (bytes of length or count that follow, kind)
_FIXED = {0xc0: 0, 0xc2: 0, 0xc3: 0, 0xca: 4, 0xcb: 8, 0xcc: 1, 0xcd: 2, 0xce: 4,
          0xcf: 8, 0xd0: 1, 0xd1: 2, 0xd2: 4, 0xd3: 8}
_SIZED = {0xc4: 1, 0xc5: 2, 0xc6: 4, 0xd9: 1, 0xda: 2, 0xdb: 4}   # bin, str: length
_COUNTED = {0xdc: (2, 1), 0xdd: (4, 1), 0xde: (2, 2), 0xdf: (4, 2)}  # array, map
_EXT_SIZED = {0xc7: 1, 0xc8: 2, 0xc9: 4}
_FIXEXT = {0xd4: 1, 0xd5: 2, 0xd6: 4, 0xd7: 8, 0xd8: 16}


def _uint_at(data: bytes, pos: int, width: int) -> int:
    if pos + width > len(data):
        raise IndexError("truncated")
    return int.from_bytes(data[pos:pos + width], "big")


def _ext_code_at(data: bytes, pos: int) -> int | None:
    """The extension code of the value at ``pos``, or None if it is no extension."""
    first = data[pos]
    if first in _FIXEXT:
        return data[pos + 1]
    if first in _EXT_SIZED:
        return data[pos + 1 + _EXT_SIZED[first]]
    return None


def _scan(data: bytes, pos: int, depth: int, path: str, field: str) -> int:
    """Walk one msgpack value from ``pos``; returns where it ends. Containers are
    walked with an explicit count of items left per level; only an extension that
    holds msgpack (a tuple) recurses, and only below the depth bound."""
    pending: List[int] = [1]  # values left to read at each open level
    while pending:
        if pending[-1] == 0:
            pending.pop()
            continue
        pending[-1] -= 1
        need(depth + len(pending) <= MAX_SKELETON_DEPTH, path, field,
              f"nests deeper than {MAX_SKELETON_DEPTH} levels")
        first = data[pos]
        pos += 1
        if first <= 0x7f or first >= 0xe0 or first in _FIXED:
            pos += _FIXED.get(first, 0)
        elif 0xa0 <= first <= 0xbf:
            pos += first & 0x1f
        elif first in _SIZED:
            pos += _SIZED[first] + _uint_at(data, pos, _SIZED[first])
        elif 0x80 <= first <= 0x9f:
            pending.append((first & 0x0f) * (2 if first <= 0x8f else 1))
        elif first in _COUNTED:
            width, per_item = _COUNTED[first]
            pending.append(_uint_at(data, pos, width) * per_item)
            pos += width
        elif first in _EXT_SIZED or first in _FIXEXT:
            pos = _scan_ext(data, pos - 1, depth + len(pending), path, field)
        else:
            need(False, path, field, f"holds the invalid msgpack byte 0x{first:02x}")
        if pos > len(data):
            raise IndexError("truncated")
    return pos


def _scan_ext(data: bytes, pos: int, depth: int, path: str, field: str) -> int:
    first = data[pos]
    if first in _FIXEXT:
        length, start = _FIXEXT[first], pos + 2
    else:
        width = _EXT_SIZED[first]
        length, start = _uint_at(data, pos + 1, width), pos + 2 + width
    end = start + length
    if end > len(data):
        raise IndexError("truncated")
    if data[start - 1] in _EXT_CONTAINERS:
        inner = data[start:end]
        need(_scan(inner, 0, depth, path, field) == len(inner), path, field,
              "has an extension with bytes after its value")
    return end


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


def chunk_mismatch(chunk: List[Any], *, path: str, field: str) -> CorruptSnapshot:
    """The error of a chunk whose stored bytes do not hash to its digest."""
    return CorruptSnapshot(f"{path}: checksum mismatch in {field} at byte offset "
                           f"{chunk[0]}; the file is damaged, use an older snapshot",
                           path=path, field=field)


def decode_chunk(stored, chunk: List[Any], *, path: str, field: str):
    """Verify one stored chunk and return its raw bytes."""
    raw_len, codec, digest = chunk[2], chunk[3], chunk[4]
    if checksum(stored) != digest:
        raise chunk_mismatch(chunk, path=path, field=field)
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
