"""Read tensor files (format v2 and later) in parallel, straight into their destination.

The unit of work is a chunk (at most ``chunk_bytes``, 4 MiB by default) for a tensor
stored raw, or a whole tensor when it holds a compressed chunk (its raw digest is fed
in order). Units of every file are taken in file order by a few threads (the usable
CPUs, at least 2 and at most :data:`MAX_THREADS`): the kernel's copies, the reads
from the device and xxh3 release the GIL, so they overlap.

A raw chunk is read with one ``preadv`` into its slice of the destination (with the
zeros after it, when it is the last before a gap, as a second buffer) and hashed there
at once, while it is still in cache. The read first asks for the bytes only if they
are in the page cache (``RWF_NOWAIT``): a warm file costs one copy and no device
access. What is not cached is read by direct I/O (``O_DIRECT``; chunks start at
4096-byte boundaries and files end at one) into the destination when it is aligned
(new memory for a tensor of 1 MiB or more is page-aligned: ``reader.new_tensor``),
else (live tensors sit 64 bytes past a page boundary) into an aligned buffer of the
thread, from which each 256 KiB piece is copied out, without the GIL, and hashed
while the core's cache still holds it; a filesystem that refuses direct I/O (tmpfs)
is read buffered.

What is checked is what the sequential reader checks: each chunk against its digest,
the padding for zeros, the file digest (in v2 a fold of the header and the chunk
digests in file order: computed from the manifest, equal to the sequential fold once
every chunk has matched its digest), and each tensor's raw digest where it holds a
compressed chunk. A tensor of raw chunks has its raw bytes covered by the chunk
digests already (a one-chunk tensor's digest must equal its chunk's); hashing it again
in one sequential pass would halve the speed for nothing.

A file whose manifest entry carries a SHA-256 (format v5) is also hashed in file
order, by a thread of its own (snapd/filesha.py), from the memory it is read into (the
header, the zeros, each raw chunk's destination once its unit has verified it; a
compressed chunk's stored bytes are read again from the page cache, which holds them:
they were read buffered): no second read of the device, the hashing of each file
beside the reads of the others and of its own later chunks. A unit that fails stops
its file's hashing, so a damaged file is reported by xxh3, the cheaper check. xxh3 finds damage; the SHA-256 finds bytes made to match
a rewritten manifest's xxh3 digests, which nobody can make match a SHA-256.

Every unit has ended when :func:`read_files` returns or raises: the destinations may be
live tensors.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import xxhash

from snapd import format as fmt
from snapd.errors import CorruptSnapshot
from snapd.filesha import FileHasher, end_hashers

BLOCK = fmt.CHUNK_ALIGN
MAX_THREADS = 8
_NOWAIT = getattr(os, "RWF_NOWAIT", 0)
_local = threading.local()


def reader_threads() -> int:
    """The usable CPUs, at least 2 (a read waiting on the device leaves its core
    free) and at most :data:`MAX_THREADS`."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(2, min(MAX_THREADS, cpus))


@dataclass
class FileRead:
    """One tensor file to read: its descriptors and, per tensor, where its raw bytes
    go (a writable memoryview of exactly ``nbytes``, or None to skip: a ``ref``)."""

    path: str
    fd: int
    direct_fd: Optional[int]
    tensors: List[Dict[str, Any]]
    outs: List[Optional[memoryview]]
    units: List[Callable[[], int]] = field(default_factory=list)
    # Per unit, the (offset, stored length, raw bytes or None: read again) of its
    # chunks in file order: what the file's SHA-256 hashes once the unit verified them.
    spans: List[List[Tuple[int, int, Optional[memoryview]]]] = field(default_factory=list)
    # Some of the file's tensors only (an earlier snapshot's file this one shares):
    # what lies between the header and the first of them is other tensors' chunks.
    partial: bool = False
    # The file's SHA-256 as its manifest lists it (v5), checked after every chunk
    # verified; ``header`` is the file's first 32 bytes, ``size`` its length.
    sha256: Optional[bytes] = None
    header: bytes = b""
    size: int = 0


def open_direct(path: str, fd: int) -> Optional[int]:
    """A direct-I/O descriptor of the same file as ``fd``, or None where the
    filesystem refuses it (tmpfs) or the name now leads elsewhere."""
    if not hasattr(os, "O_DIRECT"):
        return None
    try:
        direct = os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_NOFOLLOW | os.O_NONBLOCK
                         | os.O_CLOEXEC)
    except OSError:
        return None
    a, b = os.fstat(fd), os.fstat(direct)
    if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):
        os.close(direct)
        return None
    return direct


def read_files(files: List[FileRead], progress: Optional[Callable[[int], None]] = None,
               threads: Optional[int] = None) -> None:
    """Read and verify every file's tensors into their outputs; raises the first
    CorruptSnapshot in file order, after every unit has ended."""
    units: List[Tuple[int, Callable[[], int]]] = []
    for i, f in enumerate(files):
        _plan(f)
    hashers = [FileHasher(f) for f in files if f.sha256 is not None and not f.partial]
    for i, f in enumerate(files):
        units += [(i, u) for u in f.units]
    if not units:   # no chunk to read; a file's header and zeros are still hashed
        error = end_hashers(hashers)
        if error is not None:
            raise error
        return
    workers = min(threads or reader_threads(), len(units))
    with ThreadPoolExecutor(workers, thread_name_prefix="snapd-read") as pool:
        futures = [pool.submit(u) for _, u in units]
        first: Optional[BaseException] = None
        for future in futures:
            try:
                done = future.result()
            except BaseException as e:  # every unit must end before anything is raised
                if first is None:
                    first = e
                    for rest in futures:
                        rest.cancel()
                continue
            if progress and done:
                progress(done)
    sha_error = end_hashers(hashers)   # every unit has ended or was cancelled
    first = first or sha_error
    if first is not None:
        raise first


def _plan(f: FileRead) -> None:
    """The file's header and the zeros after it, then one unit per raw chunk or
    compressed tensor; each unit also checks the zeros after its last chunk."""
    chunks = [(t, j, c) for t in f.tensors for j, c in enumerate(t["chunks"])]
    first_chunk = chunks[0][2][0] if chunks else None
    if first_chunk is not None and not f.partial:
        _check_padding(f, bytes(os.pread(f.fd, first_chunk, 0))[fmt.HEADER_BYTES:],
                       fmt.HEADER_BYTES)
    for t, out in zip(f.tensors, f.outs):
        if out is None or not t["chunks"]:
            continue
        if any(c[3] != fmt.CODEC_RAW for c in t["chunks"]):
            f.units.append(lambda t=t, out=out: _compressed_tensor(f, t, out))
            f.spans.append([(c[0], c[1], None) for c in t["chunks"]])
            continue
        if len(t["chunks"]) == 1 and t["chunks"][0][4] != t["xxh3"]:
            raise CorruptSnapshot(f"{f.path}: tensor {t['path']!r} checksum mismatch "
                                  "after decoding", path=f.path,
                                  field=f"tensor {t['path']!r}")
        pos = 0
        for j, chunk in enumerate(t["chunks"]):
            f.units.append(lambda t=t, j=j, c=chunk, dst=out[pos:pos + chunk[2]]:
                           _raw_chunk(f, t, j, c, dst))
            f.spans.append([(chunk[0], chunk[1], out[pos:pos + chunk[2]])])
            pos += chunk[2]


def _gap_after(chunk: List[Any]) -> int:
    end = chunk[0] + chunk[1]
    return fmt.align_up(end, BLOCK) - end


def _field(t: Dict[str, Any], j: int) -> str:
    return f"tensor {t['path']!r} chunk {j}"


def _check_padding(f: FileRead, gap, at: int) -> None:
    if bytes(gap).count(0) != len(gap):
        raise CorruptSnapshot(f"{f.path}: padding at bytes {at}..{at + len(gap)} is not "
                              "zero; the file is damaged, use an older snapshot",
                              path=f.path, field="padding")


def _raw_chunk(f: FileRead, t: Dict[str, Any], j: int, chunk: List[Any],
               dst: memoryview) -> int:
    offset, stored_len = chunk[0], chunk[1]
    pad = bytearray(_gap_after(chunk)) if j == len(t["chunks"]) - 1 else bytearray()
    # What the page cache holds, piece by piece, each hashed while in the core's own
    # cache (a 4 MiB chunk hashed after its copy is read back from memory: half the
    # speed); the rest (or all of a cold chunk) read whole, then hashed.
    hasher = xxhash.xxh3_64()
    cached = _read_cached(f, dst, offset, hasher)
    # A cold rest read through the thread's aligned buffer is hashed there, piece by
    # piece, as it is copied out; what could not be read so is read, then hashed.
    done, pad_done = _read_bounced(f, dst[cached:], pad, offset + cached, hasher)
    hashed = cached + done
    if hashed < len(dst) or not pad_done:
        bufs = [b for b in (dst[hashed:], memoryview(pad)) if len(b)]
        if _read_into(f, bufs, offset + hashed) != stored_len - hashed + len(pad):
            raise CorruptSnapshot(f"{f.path}: short read in {_field(t, j)}", path=f.path,
                                  field=_field(t, j))
        hasher.update(dst[hashed:])
    if hasher.intdigest() != chunk[4]:
        raise fmt.chunk_mismatch(chunk, path=f.path, field=_field(t, j))
    if pad:
        _check_padding(f, pad, offset + stored_len)
    return stored_len


PIECE = 256 << 10   # read, then hashed while in a core's L2


def _read_cached(f: FileRead, dst: memoryview, offset: int, hasher: Any) -> int:
    """Read ``dst`` from ``offset`` while the page cache holds it, PIECE by PIECE,
    feeding ``hasher``; returns how far it got (0 where RWF_NOWAIT is missing)."""
    if not _NOWAIT:
        return 0
    done = 0
    while done < len(dst):
        piece = dst[done:done + PIECE]
        try:
            n = os.preadv(f.fd, [piece], offset + done, _NOWAIT)
        except OSError as e:  # EAGAIN: not cached; EOPNOTSUPP: no such flag here
            if e.errno not in (errno.EAGAIN, errno.EOPNOTSUPP, errno.EINVAL):
                raise
            return done
        if n <= 0:
            return done
        hasher.update(piece[:n])
        done += n
    return done


def _compressed_tensor(f: FileRead, t: Dict[str, Any], out: memoryview) -> int:
    """A tensor holding a compressed chunk, its chunks in order, as the sequential
    reader reads it: the raw digest needs the raw bytes in order."""
    raw_digest = xxhash.xxh3_64()
    pos = total = 0
    for j, chunk in enumerate(t["chunks"]):
        offset, stored_len, raw_len = chunk[0], chunk[1], chunk[2]
        stored = os.pread(f.fd, stored_len + _gap_after(chunk), offset)
        if len(stored) != stored_len + _gap_after(chunk):
            raise CorruptSnapshot(f"{f.path}: short read in {_field(t, j)}", path=f.path,
                                  field=_field(t, j))
        _check_padding(f, memoryview(stored)[stored_len:], offset + stored_len)
        out[pos:pos + raw_len] = fmt.decode_chunk(memoryview(stored)[:stored_len], chunk,
                                                  path=f.path, field=_field(t, j))
        raw_digest.update(out[pos:pos + raw_len])
        pos += raw_len
        total += stored_len
    if raw_digest.intdigest() != t["xxh3"]:
        raise CorruptSnapshot(f"{f.path}: tensor {t['path']!r} checksum mismatch after "
                              "decoding", path=f.path, field=f"tensor {t['path']!r}")
    return total


def _read_into(f: FileRead, bufs: List[memoryview], offset: int) -> int:
    """Fill ``bufs`` from ``offset``: what the page cache holds with one copy, the
    rest from the device. Returns the bytes read (short only at the end of file)."""
    want = sum(len(b) for b in bufs)
    done = 0
    if _NOWAIT:
        try:
            done = os.preadv(f.fd, bufs, offset, _NOWAIT)
        except OSError as e:  # EAGAIN: not cached; EOPNOTSUPP: no such flag here
            if e.errno not in (errno.EAGAIN, errno.EOPNOTSUPP, errno.EINVAL):
                raise
            done = 0
    while done < want:
        rest = _skip(bufs, done)
        n = _read_direct(f, rest, offset + done) if f.direct_fd is not None else 0
        if n <= 0:
            n = os.preadv(f.fd, rest, offset + done)
        if n <= 0:
            break  # end of file: the caller reports the short read
        done += n
    return done


def _skip(bufs: List[memoryview], n: int) -> List[memoryview]:
    out = []
    for b in bufs:
        if n >= len(b):
            n -= len(b)
            continue
        out.append(b[n:])
        n = 0
    return out


def _address(view: memoryview) -> int:
    return np.frombuffer(view, dtype=np.uint8).ctypes.data


def _bounce(size: int) -> memoryview:
    """This thread's page-aligned buffer of at least ``size`` bytes."""
    buf = getattr(_local, "bounce", None)
    if buf is None or len(buf) < size:
        _local.bounce = buf = mmap.mmap(-1, fmt.align_up(size, BLOCK))
    return memoryview(buf)


def _aligned(dst: memoryview, offset: int) -> bool:
    """Whether direct I/O can read ``dst`` at ``offset`` straight into it."""
    return offset % BLOCK == 0 and len(dst) % BLOCK == 0 and _address(dst) % BLOCK == 0


def _read_bounced(f: FileRead, dst: memoryview, pad: bytearray, offset: int,
                  hasher: Any) -> Tuple[int, bool]:
    """Read ``dst`` (and the zeros after it into ``pad``) by direct I/O through this
    thread's aligned buffer, copying each piece out and (with a ``hasher``) hashing
    it while the core's cache holds it. Returns the bytes of ``dst`` done and whether
    ``pad`` was filled (0 and not: not this way; the caller reads the rest).

    For a destination direct I/O cannot reach (live tensors sit 64 bytes past a page
    boundary): the copy out releases the GIL (``ctypes.memmove``), so the other
    threads' reads go on beside it; a copy by slice assignment held it."""
    if f.direct_fd is None or not dst or _aligned(dst, offset):
        return 0, not pad   # nothing cold, or aligned: _read_into reads into dst
    start = offset - offset % BLOCK
    span = fmt.align_up(offset + len(dst) + len(pad), BLOCK) - start
    bounce = _bounce(span)[:span]
    try:
        got = os.preadv(f.direct_fd, [bounce], start)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        return 0, not pad
    lead = offset - start
    n = max(0, min(len(dst), got - lead))
    at, to = _address(bounce) + lead, _address(dst)
    for p in range(0, n, PIECE):
        k = min(PIECE, n - p)
        ctypes.memmove(to + p, at + p, k)
        if hasher is not None:
            hasher.update(bounce[lead + p:lead + p + k])
    if n < len(dst) or not pad:
        return n, not pad
    if got - lead - n < len(pad):
        return n, False   # the file ends before its zeros: the caller's read says so
    pad[:] = bounce[lead + n:lead + n + len(pad)]
    return n, True


def _read_direct(f: FileRead, bufs: List[memoryview], offset: int) -> int:
    """Read the first buffer (at least) by direct I/O; 0 when that cannot be done
    (then the caller reads buffered). An unaligned one goes through the thread's
    aligned buffer."""
    dst = bufs[0]
    if not _aligned(dst, offset):
        return _read_bounced(f, dst, bytearray(), offset, None)[0]
    try:
        return os.preadv(f.direct_fd, [dst], offset)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        return 0
