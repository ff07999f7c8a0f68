"""The state log: one append-only, framed stream of msgpack records per (run, rank).

Why: recovery must learn the last step reached, the last committed snapshot and what was
lost in between in milliseconds, without opening a tensor file. So each step appends a
small record (one ``os.write``, no fsync), a thread fsyncs at most once per interval, and
readers answer from the tail with bounded reads. Full spec: ``docs/format.md``, "The state log" (v1)::

    <run_dir>/log/rank-<rank:05d>/<seq:012d>.log                 seq = 1, 2, 3 ...
    segment header, 48 bytes, little-endian       frame, n + 12 bytes, n <= 16 MiB
      0  8  magic b"SNAPDLOG"                       0  4  u32 n, payload length
      8  2  u16 format version = 1                  4  4  u32 xxh32(payload||footer, seed)
     10  2  u16 header size = 48                    8  n  payload: one msgpack map
     12  4  u32 rank                              8+n  4  u32 n again (footer)
     16  8  u64 segment sequence number          seed = xxh32(u32 rank || u64 seq), so a
     24  8  i64 first_step (no "step" record      frame copied from another segment fails
            in the segment has a smaller step)
     32 12  reserved, zero;  44 4  u32 xxh32(bytes 0..44)

    A frame is valid if and only if its header length equals its footer, is at most
    MAX_RECORD, the frame lies inside the file (before U, inside [48, U): see below), its
    checksum holds, and, when it starts at or after U, every frame from U up to it is
    valid.

After each fsync the writer appends a sync mark ``{"kind": "sync", "upto": U}``: every
byte before U was durable. A crash damages only bytes written after the last fsync, so
after the newest mark's U readers keep exactly the valid prefix (the torn tail is never
parsed) and agree with the writer, which cuts there. Before U, damage can only be rot or
a hostile edit: readers warn (LogDamageWarning: path and offset), skip to the next valid
frame and go on; a segment with a bad header is skipped whole, with a warning. A writer
opening a damaged newest segment moves it aside (``<seq>.log.damaged-<n>``) and copies
its valid records into a new one. Marks are never returned as records.
"""

from __future__ import annotations

import os
import re
import struct
import warnings
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

import msgpack
import xxhash

from snapd.errors import CorruptLog, InvalidOption

# The public API. Readers: read_records, newest_first, last_record, find_last, find_step,
# read_tail, tail_report, scan_segment. For the writer (snapd/logwriter.py), which
# shares the framing and must resume exactly where readers stop: encode_record,
# encode_frame, encode_header, segment_seed, is_step, tail_state, warn_torn.
__all__ = ["HEADER_SIZE", "MAX_RECORD", "VERSION", "IOStats", "LogDamageWarning", "LogScan",
           "SegmentTail", "TornTailWarning", "encode_frame", "encode_header", "encode_record",
           "find_last", "find_step", "is_step", "last_record", "list_ranks", "list_segments",
           "newest_first", "rank_dir", "read_records", "read_tail", "scan_segment",
           "segment_seed", "tail_report", "tail_state", "warn_torn"]

MAGIC, VERSION, HEADER_SIZE = b"SNAPDLOG", 1, 48
MAX_RECORD = 16 << 20  # a garbage length can never make a reader allocate more
_HEADER = struct.Struct("<8sHHIQq12sI")
_U32, _FRAME_HEAD, _SEED = struct.Struct("<I"), struct.Struct("<II"), struct.Struct("<IQ")
_BLOCK = 4096  # read granularity: one page, so bounded reads stay small
_MARK = b"\x82\xa4kind\xa4sync\xa4upto"  # the first payload bytes of every sync mark
_SEGMENT_NAME, _RANK_NAME = re.compile(r"^(\d{12})\.log$"), re.compile(r"^rank-(\d{5,})$")
Frames = list[tuple[int, bytes]]


class TornTailWarning(UserWarning):
    """Bytes after a segment's valid prefix were ignored (normal after a crash)."""


class LogDamageWarning(UserWarning):
    """Durable bytes of the log are damaged (rot, a hostile edit): readers skipped them,
    named by segment and offset, and went on with the valid records."""


@dataclass
class IOStats:
    """What the readers read: tests assert on bytes, which unlike time is exact. The
    damage they met is listed too, one message per place, for status to report."""

    bytes_read: int = 0
    reads: int = 0
    segments_opened: int = 0
    damage: list[str] = field(default_factory=list)


@dataclass
class LogScan:
    """Where a segment's valid prefix ends and, when bytes follow it, why."""

    path: str
    seq: int
    first_step: int
    size: int
    valid_end: int = HEADER_SIZE
    torn_at: int | None = None
    reason: str | None = None
    damaged: list[int] = field(default_factory=list)  # offsets of damage before the tail


def rank_dir(run_dir: str | os.PathLike, rank: int) -> Path:
    return Path(run_dir) / "log" / f"rank-{rank:05d}"


def list_segments(run_dir: str | os.PathLike, rank: int) -> list[Path]:
    """Segments by sequence number; ``.tmp`` leftovers of a crashed rotation are not."""
    d = rank_dir(run_dir, rank)
    found = [(m.group(1), p) for p in d.iterdir() if (m := _SEGMENT_NAME.match(p.name))] \
        if d.is_dir() else []
    return [p for _, p in sorted(found)]


def list_ranks(run_dir: str | os.PathLike) -> list[int]:
    d = Path(run_dir) / "log"
    return sorted(int(m.group(1)) for p in d.iterdir()
                  if (m := _RANK_NAME.match(p.name))) if d.is_dir() else []


def segment_seed(rank: int, seq: int) -> int:
    return xxhash.xxh32_intdigest(_SEED.pack(rank, seq))


def encode_header(rank: int, seq: int, first_step: int) -> bytes:
    head = _HEADER.pack(MAGIC, VERSION, HEADER_SIZE, rank, seq, first_step, bytes(12), 0)[:44]
    return head + _U32.pack(xxhash.xxh32_intdigest(head))


def encode_frame(payload: bytes, seed: int) -> bytes:
    """Frame one msgpack payload; the checksum covers the footer, hence the length."""
    if len(payload) > MAX_RECORD:
        raise InvalidOption(f"state-log record of {len(payload)} bytes exceeds "
                            f"{MAX_RECORD}; log() fewer samples or scalars per step",
                            field="record")
    footer = _U32.pack(len(payload))
    checksum = xxhash.xxh32_intdigest(payload + footer, seed)
    return _FRAME_HEAD.pack(len(payload), checksum) + payload + footer


def encode_record(record: dict) -> tuple[bytes, int | None]:
    """Payload bytes, and the step of a "step" record (those order a segment)."""
    kind, step = record.get("kind"), record.get("step")
    if kind == "sync":
        raise ValueError('record kind "sync" is reserved for the log\'s own sync marks')
    if kind == "step" and (type(step) is not int or step < 0):
        raise InvalidOption(f'a "step" record needs an int step >= 0, got {step!r}: '
                            "log(step) counts completed updates", field="step")
    return msgpack.packb(record, use_bin_type=True), step if kind == "step" else None


def _decode_header(path: Path, raw: bytes, rank: int | None, seq: int) -> tuple[int, int]:
    """Check each field against the file's name and place; return (rank, first_step)."""
    magic, version, size, h_rank, h_seq, first, _, crc = \
        _HEADER.unpack(raw.ljust(HEADER_SIZE, b"\0"))
    for field, ok, detail in (
            ("header", len(raw) == HEADER_SIZE, f"{len(raw)} of {HEADER_SIZE} bytes"),
            ("magic", magic == MAGIC, f"{magic!r}, expected {MAGIC!r}"),
            ("version", version == VERSION, f"{version}; this snapd reads {VERSION}"),
            ("checksum", crc == xxhash.xxh32_intdigest(raw[:44]), "header bytes altered"),
            ("header_size", size == HEADER_SIZE, f"{size}, expected {HEADER_SIZE}"),
            ("rank", rank is None or h_rank == rank, f"{h_rank}, directory says {rank}"),
            ("seq", h_seq == seq, f"{h_seq}, file name says {seq}")):
        if not ok:
            raise CorruptLog(f"{path}: state-log segment header field '{field}' is bad "
                             f"({detail}); the segment cannot be read. Readers skip it; a "
                             "trainer opening the log moves it aside as "
                             "<name>.damaged-<n>, kept for inspection.",
                             path=str(path), field=field)
    return h_rank, first


def _unpack_map(payload: bytes) -> dict | None:
    try:
        record = msgpack.unpackb(payload, raw=False)
    except (ValueError, TypeError, msgpack.UnpackException):
        return None
    return record if isinstance(record, dict) else None


def _decode(seg: _Segment, off: int, payload: bytes) -> dict | None:
    """The record of a valid frame, or None (with a damage warning) when its payload is
    not a msgpack map: snapd never writes one, so the frame is skipped, not guessed at."""
    if (record := _unpack_map(payload)) is None:
        seg.note_damage(off, "valid checksum but no msgpack map; not written by snapd")
    return record


def _warn_damage(stats: IOStats, message: str) -> None:
    if message not in stats.damage:
        stats.damage.append(message)
    warnings.warn(LogDamageWarning(message), stacklevel=4)


class _Segment:
    """One segment open for reading: header checked, reads cached by page and counted."""

    def __init__(self, path: Path, stats: IOStats, rank: int | None = None):
        self.path, self.stats, self._pages = path, stats, {}
        self.damaged: dict[int, str] = {}  # offset -> why, damage met before the tail
        self._tail: tuple[int, Frames, LogScan] | None = None
        if rank is None and (m := _RANK_NAME.match(path.parent.name)):
            rank = int(m.group(1))
        self.seq = int(m.group(1)) if (m := _SEGMENT_NAME.match(path.name)) else 0
        self.fd = os.open(path, os.O_RDONLY)
        try:
            self.size = os.fstat(self.fd).st_size
            stats.segments_opened += 1
            raw = self.pread(0, HEADER_SIZE)
            self.rank, self.first_step = _decode_header(path, raw, rank, self.seq)
        except BaseException:
            os.close(self.fd)
            raise
        self.seed = segment_seed(self.rank, self.seq)

    def __enter__(self) -> _Segment:
        return self

    def __exit__(self, *exc) -> None:
        os.close(self.fd)

    def pread(self, off: int, n: int) -> bytes:
        data = os.pread(self.fd, n, off)
        self.stats.bytes_read += len(data)
        self.stats.reads += 1
        return data

    def get(self, off: int, n: int, far: bool = False) -> bytes:
        """Bytes [off, off+n) by page, so a walk never reads a page twice; ``far`` reads
        a candidate footer exactly, without pulling in a page that may not be needed."""
        first, last = off // _BLOCK, (off + n - 1) // _BLOCK
        if far and not (first in self._pages and last in self._pages):
            return self.pread(off, n)
        for b in range(first, last + 1):
            if b not in self._pages:
                self._pages[b] = self.pread(b * _BLOCK, _BLOCK)
        rel = off - first * _BLOCK
        if first == last:
            return self._pages[first][rel:rel + n]
        return b"".join(self._pages[b] for b in range(first, last + 1))[rel:rel + n]

    def note_damage(self, off: int, reason: str) -> None:
        if off not in self.damaged:
            self.damaged[off] = reason
            _warn_damage(self.stats, f"{self.path}: damaged state-log frame at offset {off} "
                         f"({reason}); skipped, the valid records around it are read")

    def forget_before(self, off: int) -> None:
        for b in [b for b in self._pages if b < off // _BLOCK]:
            del self._pages[b]

    def tail(self) -> tuple[int, Frames, LogScan]:
        """(anchor, frames after it, report): forward-verified from the newest durable
        point, hence the same answer as a full scan for any damage a crash can do."""
        if self._tail is None:
            report = LogScan(str(self.path), self.seq, self.first_step, self.size)
            anchor = _newest_mark(self)
            self._tail = anchor, list(_frames_from(self, anchor, report)), report
        return self._tail


def _frame_at(seg: _Segment, start: int, limit: int) -> tuple[bytes | None, str | None]:
    """(payload, None) if a valid frame starts at ``start`` and ends by ``limit``,
    else (None, why), why being None at a clean end."""
    if limit - start < 12:
        return None, "incomplete frame header" if limit > start else None
    n, checksum = _FRAME_HEAD.unpack(seg.get(start, 8))
    if n > MAX_RECORD:
        return None, f"length {n} exceeds the {MAX_RECORD}-byte bound"
    if start + 12 + n > limit:
        return None, "frame runs past the end of the file"
    if _U32.unpack(seg.get(start + 8 + n, 4, far=True))[0] != n:  # before reading n bytes
        return None, "footer length differs from header length"
    body = seg.get(start + 8, n + 4)
    if xxhash.xxh32_intdigest(body, seg.seed) != checksum:
        return None, "checksum mismatch"
    return body[:-4], None


def _frames_from(seg: _Segment, pos: int, report: LogScan, drop: bool = False
                 ) -> Iterator[tuple[int, bytes]]:
    """Valid frames from ``pos`` on; where and why the run stops goes into ``report``."""
    while (payload := (got := _frame_at(seg, pos, seg.size))[0]) is not None:
        yield pos, payload
        pos += len(payload) + 12
        if drop:  # a full scan keeps only the page it is on
            seg.forget_before(pos)
    report.valid_end, report.reason = pos, got[1]
    report.torn_at = pos if got[1] else None


def _next_frame(seg: _Segment, pos: int, limit: int, before: int | None = None
                ) -> int | None:
    """The first offset in [pos, before) where a valid frame starts and ends by ``limit``:
    the seeded checksum and the footer must both match (odds ~2**-64 for other bytes)."""
    stop = min(limit - 11, limit if before is None else before)
    while pos < stop:
        span = min(_BLOCK, stop - pos)
        chunk = seg.get(pos, span + 3)
        for i in range(min(span, len(chunk) - 3)):
            if _U32.unpack_from(chunk, i)[0] <= MAX_RECORD and \
                    _frame_at(seg, pos + i, limit)[0] is not None:
                return pos + i
        pos += span
    return None


def _frames_resync(seg: _Segment, pos: int, limit: int, drop: bool = False
                   ) -> Iterator[tuple[int, bytes]]:
    """Valid frames in [pos, limit), a region known durable: a damaged frame is noted
    and skipped, and reading resumes at the next valid frame."""
    while pos < limit:
        payload, why = _frame_at(seg, pos, limit)
        if payload is not None:
            yield pos, payload
            pos += len(payload) + 12
        else:
            seg.note_damage(pos, why or "frame runs past the last durable offset")
            if (nxt := _next_frame(seg, pos + 1, limit)) is None:
                return
            pos = nxt
        if drop:  # a full scan keeps only the page it is on
            seg.forget_before(pos)


def _segment_frames(seg: _Segment, drop: bool = False) -> Iterator[tuple[int, bytes]]:
    """Every valid frame of a segment: the durable part with resynchronisation past
    damage, then the verified tail, which ends at its first invalid byte."""
    anchor = seg.tail()[0]
    yield from _frames_resync(seg, HEADER_SIZE, anchor, drop)
    yield from seg.tail()[1]


def _newest_mark(seg: _Segment) -> int:
    """U of the newest genuine sync mark (bytes before U were fsynced), searched page by
    page from the end: one flush interval of records, else the whole segment."""
    hi = seg.size
    while hi > HEADER_SIZE:
        lo = max(HEADER_SIZE, hi - _BLOCK)
        chunk = seg.get(lo, min(seg.size, hi + len(_MARK) - 1) - lo)
        end = len(chunk)
        while (i := chunk.rfind(_MARK, 0, end)) >= 0:
            start, end = lo + i - 8, i + len(_MARK) - 1
            payload = _frame_at(seg, start, seg.size)[0] if start >= HEADER_SIZE else None
            upto = (_unpack_map(payload) or {}).get("upto") if payload else None
            if type(upto) is int and HEADER_SIZE <= upto <= start:
                return upto
        hi = lo
    return HEADER_SIZE


def _records(seg: _Segment, frames: Iterable[tuple[int, bytes]]
             ) -> Iterator[tuple[int, dict]]:
    """(offset, record) of the frames that hold records: not marks, not damage."""
    for off, payload in frames:
        if (record := _decode(seg, off, payload)) is not None and record.get("kind") != "sync":
            yield off, record


def _records_backward(seg: _Segment) -> Iterator[tuple[int, dict]]:
    """(offset, record) newest first: the verified tail, then footers walked backward.
    Damage stops the walk; the part before it is then scanned forward, resynchronising."""
    anchor, frames, _ = seg.tail()
    yield from _records(seg, reversed(frames))
    pos = anchor
    while pos > HEADER_SIZE:
        start = pos - 12 - _U32.unpack(seg.get(pos - 4, 4))[0]
        payload = _frame_at(seg, start, pos)[0] if start >= HEADER_SIZE else None
        if payload is None or len(payload) != pos - start - 12:  # rot in fsynced bytes
            yield from _records(seg, reversed(list(_frames_resync(seg, HEADER_SIZE, pos))))
            return
        yield from _records(seg, [(start, payload)])
        pos = start


def warn_torn(report: LogScan) -> None:
    if report.torn_at is not None:
        warnings.warn(TornTailWarning(
            f"{report.path}: ignoring {report.size - report.valid_end} bytes after offset "
            f"{report.valid_end} ({report.reason}); a LogWriter opening the log cuts them"),
            stacklevel=3)


def _readable(paths: Iterable[Path], stats: IOStats, rank: int) -> Iterator[_Segment]:
    """Each segment opened in turn; one with a bad header is skipped with a warning (its
    records are unknown, the others are not), one moved aside meanwhile silently."""
    for path in paths:
        try:
            seg = _Segment(path, stats, rank)
        except CorruptLog as e:
            _warn_damage(stats, str(e))
            continue
        except FileNotFoundError:  # a writer moved it aside after we listed it
            continue
        with seg:
            yield seg


def scan_segment(path: str | os.PathLike, *, stats: IOStats | None = None,
                 rank: int | None = None) -> tuple[list[dict], LogScan]:
    """Every valid record of one segment, applying the validity rule from the header;
    raises CorruptLog if the header itself is bad. ``rank``: the rank the header must
    name (default: the one its directory names)."""
    with _Segment(Path(path), stats or IOStats(), rank) as seg:
        records = [r for _, r in _records(seg, _segment_frames(seg, drop=True))]
        report = seg.tail()[2]
        report.damaged = sorted(seg.damaged)
    return records, report


def read_records(run_dir: str | os.PathLike, rank: int, start_step: int | None = None, *,
                 stats: IOStats | None = None) -> Iterator[dict]:
    """All valid records oldest first, reading every segment in full. ``start_step``
    skips records whose int "step" is smaller (replayed lineages are all kept)."""
    for seg in _readable(list_segments(run_dir, rank), stats or IOStats(), rank):
        for _, record in _records(seg, _segment_frames(seg, drop=True)):
            step = record.get("step")
            if start_step is None or type(step) is not int or step >= start_step:
                yield record
        warn_torn(seg.tail()[2])


def newest_first(run_dir, rank: int, stats: IOStats | None = None) -> Iterator[dict]:
    """Every valid record, newest first, read backward from the tail (lazily)."""
    for seg in _readable(reversed(list_segments(run_dir, rank)), stats or IOStats(), rank):
        warn_torn(seg.tail()[2])
        yield from (record for _, record in _records_backward(seg))


def last_record(run_dir: str | os.PathLike, rank: int,
                predicate: Callable[[dict], bool] | None = None, *,
                stats: IOStats | None = None) -> dict | None:
    """The newest valid record (matching ``predicate``), walking back from the tail: the
    cost is the unsynced tail plus the records skipped, not the size of the log."""
    with closing(newest_first(run_dir, rank, stats)) as records:
        return next((r for r in records if predicate is None or predicate(r)), None)


def find_last(run_dir: str | os.PathLike, rank: int, kind: str, *,
              stats: IOStats | None = None) -> dict | None:
    return last_record(run_dir, rank, lambda r: r.get("kind") == kind, stats=stats)


def read_tail(run_dir: str | os.PathLike, rank: int, max_records: int = 100, *,
              stats: IOStats | None = None) -> list[dict]:
    """The newest ``max_records`` valid records, oldest first, read backward."""
    with closing(newest_first(run_dir, rank, stats)) as records:
        newest = [r for _, r in zip(range(max_records), records)]
    return newest[::-1]


def tail_report(run_dir: str | os.PathLike, rank: int, *,
                stats: IOStats | None = None) -> LogScan | None:
    """Where the newest readable segment's valid prefix ends (a bounded read); None: no
    log."""
    segments = _readable(reversed(list_segments(run_dir, rank)), stats or IOStats(), rank)
    with closing(segments):
        return next((seg.tail()[2] for seg in segments), None)


@dataclass
class SegmentTail:
    """Where a writer resumes in a segment: what :func:`tail_state` reads."""

    seq: int
    seed: int
    first_step: int
    last_step: int          # of the newest "step" record, else the header's first_step
    report: LogScan         # where the valid prefix ends (torn_at: bytes to cut)
    damaged: list[int]      # offsets of damage before the tail (then: copy, not append)


def tail_state(path: str | os.PathLike, rank: int) -> SegmentTail:
    """The state a writer appends after, read as the readers read it (bounded: the tail
    and the footers back to the newest "step" record); raises CorruptLog on a bad
    header, whose frames cannot be trusted."""
    with _Segment(Path(path), IOStats(), rank) as seg:
        report = seg.tail()[2]
        with closing(_records_backward(seg)) as back:
            last = next((r["step"] for _, r in back if is_step(r)), seg.first_step)
        return SegmentTail(seg.seq, seg.seed, seg.first_step, last, report,
                           sorted(seg.damaged))


def is_step(record: dict) -> bool:
    """A "step" record whose step is an int: others (a hostile edit) are not used."""
    return record.get("kind") == "step" and type(record.get("step")) is int


def _step_after(seg: _Segment, pos: int, hi: int, limit: int) -> tuple[int, dict | None]:
    """The first "step" record starting in [pos, hi), found by resynchronising on the
    first valid frame (see _next_frame) and walking on past any damage."""
    while pos < hi and (p := _next_frame(seg, pos, limit, before=hi)) is not None:
        payload = _frame_at(seg, p, limit)[0]
        if is_step(record := _decode(seg, p, payload) or {}):
            return p, record
        pos = p + len(payload) + 12
    return hi, None


def _find_step_in(seg: _Segment, step: int) -> dict | None:
    """Bisect byte offsets: "step" records never decrease inside a segment (the writer
    starts a new one when they would), so ~log2(size / 4 KiB) page probes suffice."""
    limit = seg.tail()[2].valid_end
    with closing(_records_backward(seg)) as back:
        hi, newest = next(((o, r) for o, r in back if is_step(r)), (0, None))
    if newest is None or newest["step"] <= step:
        return newest if newest is not None and newest["step"] == step else None
    lo = HEADER_SIZE
    while hi - lo > _BLOCK:
        off, record = _step_after(seg, (lo + hi) // 2, hi, limit)
        lo, hi = (off, hi) if record and record["step"] <= step else (lo, (lo + hi) // 2)
    found = None
    for _, record in _records(seg, _frames_resync(seg, lo, limit)):
        if is_step(record):
            if record["step"] > step:
                break
            found = record if record["step"] == step else found
    return found


def find_step(run_dir: str | os.PathLike, rank: int, step: int, *,
              stats: IOStats | None = None) -> dict | None:
    """The newest "step" record for ``step``: headers rule out whole segments, then a
    bisection inside one. A replayed step exists twice; the newest lineage wins."""
    segments = _readable(reversed(list_segments(run_dir, rank)), stats or IOStats(), rank)
    with closing(segments):
        for seg in segments:
            if seg.first_step <= step and (record := _find_step_in(seg, step)) is not None:
                return record
    return None
