"""The writing side of the state log: append, grouped fsync, torn-tail repair, rotation.

The format and the readers are in :mod:`snapd.statelog` (docs/format.md, "The state log"); this
module only appends. One writer per (run, rank) at a time; readers may read any time.

Why a failed write is cut back: a write that fails half way (a full disk) leaves part
of a frame in the file. Appending after it would put a torn frame *inside* the log,
where every reader stops, so the writer truncates to the last whole frame first, or
leaves that segment for a new one when even that fails.
"""

from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path
from typing import Callable, Iterable

import msgpack

from snapd.diskguard import space_for
from snapd.errors import CorruptLog
from snapd.fsio import fsync_dir, write_all
from snapd.statelog import (
    HEADER_SIZE,
    LogDamageWarning,
    encode_frame,
    encode_header,
    encode_record,
    list_segments,
    rank_dir,
    scan_segment,
    segment_seed,
    tail_state,
    warn_torn,
)


class LogWriter:
    """Appends records for one (run, rank): one ``os.write`` per record and no fsync on
    the hot path; a daemon thread fsyncs at most every ``flush_interval`` seconds if
    anything was written (None or 0: only ``sync``, ``close`` and rotation fsync).
    ``fsync`` (of segment files) is injectable: tests count calls, simulate a bad disk.
    Appends are thread-safe; one writer per (run, rank) at a time, readers any time."""

    def __init__(self, run_dir: str | os.PathLike, rank: int, *, segment_bytes: int = 64 << 20,
                 flush_interval: float | None = 1.0, fsync: Callable[[int], None] = os.fsync):
        self.run_dir, self.rank, self.segment_bytes = Path(run_dir), rank, segment_bytes
        self.dir, self._fsync, self._lock = rank_dir(run_dir, rank), fsync, threading.Lock()
        self._fd: int | None = None
        self._seq = self._offset = self._seed = self._marked = 0
        self._last_step: int | None = None
        self._dirty = self._closed = False
        self._error: OSError | None = None
        with self._space(self.dir, "opening the state log"):
            for d in (self.run_dir, self.dir.parent, self.dir):
                if not d.is_dir():
                    d.mkdir(parents=True, exist_ok=True)
                    fsync_dir(str(d.parent))  # the new directory entry survives a crash
            self._open_last()
        self._stop, self._thread = threading.Event(), None
        self._wake = threading.Event()  # sync_soon(): flush now, not at the next tick
        if flush_interval:
            self._thread = threading.Thread(target=self._flush_loop, args=(flush_interval,),
                                            name=f"snapd-log-flush-{rank}", daemon=True)
            self._thread.start()

    def _space(self, path: Path, doing: str):
        """A write refused for space is InsufficientSpace naming ``path`` and the way
        out (snapd/diskguard.py); the journal decides whether that stops the run."""
        return space_for(str(self.run_dir.parent), str(path), doing)

    def _open_last(self) -> None:
        """Cut a torn tail and resume after the valid prefix; a newest segment found
        damaged is moved aside instead (see _replace_damaged). With no segment yet the
        first append (or ready()) creates one, so that its header can name the first step."""
        if not (paths := list_segments(self.run_dir, self.rank)):
            return
        try:
            tail = tail_state(paths[-1], self.rank)
        except CorruptLog as e:  # bad header: its frames cannot be trusted, none copied
            self._seq = int(paths[-1].name.split(".")[0])
            self._move_aside(paths[-1], f"header field '{e.field}' is bad")
            return
        self._last_step, self._seq, self._seed = tail.last_step, tail.seq, tail.seed
        if tail.damaged:
            self._replace_damaged(paths[-1], tail.damaged)
            return
        report = tail.report
        warn_torn(report)
        self._fd = os.open(paths[-1], os.O_WRONLY | os.O_APPEND)
        try:
            if report.torn_at is not None:
                os.ftruncate(self._fd, report.valid_end)  # 1. drop the torn tail, unparsed
            self._fsync(self._fd)  # 2. the prefix we append after is durable
            self._offset = report.valid_end
            self._write_mark(self._offset)  # 3. say so, for bounded readers
        except BaseException:
            os.close(self._fd)
            self._fd = None
            raise

    def _replace_damaged(self, path: Path, damaged: list[int]) -> None:
        """Damage before the tail of the segment we would append to: move it aside and
        copy its valid records into a new segment, so that the live segment is clean
        and no valid record (the replay check needs the old steps) is lost."""
        with warnings.catch_warnings():  # the damage was reported once already
            warnings.simplefilter("ignore", LogDamageWarning)
            valid, _ = scan_segment(path, rank=self.rank)
        self._move_aside(path, f"damaged at offset {damaged[0]}")
        self._last_step = None
        if valid:
            self.append_many(valid)

    def _move_aside(self, path: Path, why: str) -> None:
        """Rename a damaged segment out of the segment name pattern (readers skip it, it
        is kept for inspection); the next append starts segment seq + 1."""
        n = 1
        while (aside := path.with_name(f"{path.name}.damaged-{n}")).exists():
            n += 1
        os.rename(path, aside)  # 1. out of the readers' way, not deleted
        fsync_dir(str(self.dir))  # 2. the rename survives a crash
        warnings.warn(LogDamageWarning(
            f"{path}: state-log segment {why}; moved aside to {aside.name} and kept; "
            "its valid records continue in a new segment"), stacklevel=4)

    def ready(self) -> None:
        """Create the segment the next append goes to, if none is open: its fsyncs
        then happen here (a trainer's setup) rather than at the first record (the
        training loop's first step or snapshot). The header's first step is a lower
        bound of the steps the segment will hold: the last step known, else 0."""
        with self._lock:
            self._check_open()
            if self._fd is None:
                self._create(self._seq + 1, self._last_step or 0)

    def append(self, record: dict) -> None:
        """Frame ``record`` and hand it to the kernel in one write; it is durable after
        the next flush, ``sync()`` or ``close()``."""
        payload, step = encode_record(record)
        with self._lock:
            self._check_open()
            self._admit(len(payload) + 12, step)
            self._write(encode_frame(payload, self._seed))
            self._dirty = True

    def append_many(self, records: Iterable[dict]) -> int:
        """Bulk import (and large test logs): one write per segment filled."""
        count, pending = 0, bytearray()
        with self._lock:
            self._check_open()
            try:
                for record in records:
                    payload, step = encode_record(record)
                    if pending and self._must_rotate(len(payload) + 12, step, len(pending)):
                        self._write(pending)  # the rest of the old segment
                        pending.clear()
                    self._admit(len(payload) + 12, step, len(pending))
                    pending += encode_frame(payload, self._seed)
                    count += 1
            finally:  # a bad record stops the import; what was framed before it stays
                if pending:
                    self._write(pending)
                self._dirty = self._dirty or count > 0
        return count

    def _write(self, frames: bytes | bytearray) -> None:
        """Append whole frames; if the write fails part way, cut back to the last whole
        frame so that no torn frame is ever followed by another one."""
        try:
            segment = self.dir / f"{self._seq:012d}.log"
            with self._space(segment, "appending to the state log"):
                write_all(self._fd, frames)
        except OSError:
            self._cut_back()
            raise
        self._offset += len(frames)

    def _cut_back(self) -> None:
        try:
            os.ftruncate(self._fd, self._offset)
        except OSError:  # cannot even cut: the torn bytes stay this segment's tail
            os.close(self._fd)
            self._fd = None  # the next append starts a new segment

    def _check_open(self) -> None:
        if self._error is not None:  # a background fsync failed: report it once
            err, self._error = self._error, None
            raise err
        if self._closed:
            raise ValueError(f"LogWriter for {self.dir} is closed")

    def _must_rotate(self, size: int, step: int | None, pending: int = 0) -> bool:
        end = self._offset + pending  # ``pending``: framed bytes not yet written
        full = end + size > self.segment_bytes and end > HEADER_SIZE
        return full or None not in (step, self._last_step) and step < self._last_step

    def _admit(self, size: int, step: int | None, pending: int = 0) -> None:
        """Rotate when full, or when a step goes backward (a replay after a resume), so
        that steps never decrease inside a segment and ``find_step`` can bisect."""
        if self._fd is None or self._must_rotate(size, step, pending):
            first = step if step is not None else (self._last_step or 0)
            if self._fd is not None:
                self._seal()
            self._create(self._seq + 1, first)
        if step is not None:
            self._last_step = step

    def _create(self, seq: int, first_step: int) -> None:
        path = self.dir / f"{seq:012d}.log"
        tmp = path.with_name(path.name + ".tmp")
        # Owner-only, like the socket (the umask can only narrow it): the log holds
        # the run's scalars and full RNG states.
        with self._space(path, "creating a state-log segment"):
            fd = os.open(tmp, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                write_all(fd, encode_header(self.rank, seq, first_step))  # 1. header, tmp
                self._fsync(fd)  # 2. durable: a segment never exists without its header
                os.rename(tmp, path)  # 3. publish
            except BaseException:  # a full disk: no segment, the next append tries again
                os.close(fd)
                tmp.unlink(missing_ok=True)
                raise
            fsync_dir(str(self.dir))  # 4. the name survives a crash
        self._fd, self._seq, self._seed = fd, seq, segment_seed(self.rank, seq)
        self._offset = self._marked = HEADER_SIZE

    def _seal(self) -> None:
        """Leave the segment durable and ending in a mark: fsync, mark, fsync, close."""
        self._fsync(self._fd)
        self._write_mark(self._offset)
        self._fsync(self._fd)
        os.close(self._fd)
        self._fd, self._dirty = None, False

    def _write_mark(self, upto: int) -> None:
        self._write(encode_frame(msgpack.packb({"kind": "sync", "upto": upto}), self._seed))
        self._marked = upto

    def sync(self) -> None:
        """fsync now (at a snapshot, at close); raises a failed background fsync."""
        with self._lock:
            self._check_open()
        self._sync(only_if_dirty=False)

    def _sync(self, only_if_dirty: bool) -> None:
        """The fsync runs outside the lock, so appends never wait for the disk; a mark
        then records the offset it covered."""
        with self._lock:
            if self._fd is None or self._closed or (only_if_dirty and not self._dirty):
                return
            fd, seq, upto, self._dirty = os.dup(self._fd), self._seq, self._offset, False
        try:
            self._fsync(fd)
        except BaseException:
            self._dirty = True  # the next flush tries again
            raise
        finally:
            os.close(fd)
        with self._lock:
            if self._fd is not None and self._seq == seq and upto > self._marked:
                self._write_mark(upto)

    def sync_soon(self) -> None:
        """Ask the flush thread to fsync now, without waiting for it: what a training
        loop calls, since it must never wait for the disk. Without a flush thread,
        this is ``sync()``."""
        if self._thread is None:
            self.sync()
        else:
            self._wake.set()

    def _flush_loop(self, interval: float) -> None:
        while not self._stop.is_set():
            self._wake.wait(interval)
            self._wake.clear()
            if self._stop.is_set():
                return  # close() seals the segment itself
            try:
                self._sync(only_if_dirty=True)
            except OSError as e:  # kept for the next append, sync or close to raise
                with self._lock:
                    self._error = e

    def close(self) -> None:
        """Stop the flush thread and seal the segment; raise a background failure once."""
        if self._thread is not None:
            self._stop.set()
            self._wake.set()
            self._thread.join()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            err, self._error = self._error, None
            if self._fd is not None:
                try:
                    self._seal()
                except OSError as e:  # a full disk: what was written stays valid
                    if self._fd is not None:
                        os.close(self._fd)
                    self._fd, err = None, err or e
        if err is not None:
            raise err

    def __enter__(self) -> LogWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
