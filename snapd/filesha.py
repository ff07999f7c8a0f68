"""A tensor file's SHA-256, checked while snapd/fastread.py reads it.

The reader reads a file's chunks in parallel, in any order; a SHA-256 must be fed in
file order. So each file with a SHA-256 in its manifest entry (format v5) gets a
thread of its own that hashes the file's bytes in order as its units land: the header
and the zeros after it, each unit's bytes once the unit has verified them against
their xxh3 (a raw chunk from the memory it was read into; a compressed tensor's chunks
read again, from the page cache, which holds them: they were read buffered), the zeros
between chunks and at the end. No second read of the device; the hashing of one file
goes on beside the reads of the others and of its own later chunks. A unit that fails
ends its file's hashing without a verdict: its own error (xxh3, the cheaper check)
stands.
"""

from __future__ import annotations

import hashlib
import os
import threading
from typing import Any, Callable, List, Optional

from snapd import format as fmt
from snapd.errors import CorruptSnapshot


def end_hashers(hashers: List["FileHasher"]) -> Optional[BaseException]:
    """Let every hasher finish (a unit cancelled never signals: released here), and
    the first SHA-256 mismatch in file order, or None."""
    for h in hashers:
        h.release()
    first: Optional[BaseException] = None
    for h in hashers:
        h.thread.join()
        first = first or h.error
    return first


_ZEROS = bytes(fmt.CHUNK_ALIGN)


class FileHasher:
    """A file's SHA-256, taken in file order on a thread of its own as its units land.

    Each unit of the file is wrapped to signal its end and whether it verified; the
    thread hashes the header and zeros, then each unit's bytes as soon as it has
    verified them (a raw chunk from its destination; a compressed tensor's chunks read
    again, from the page cache), and the zeros between and after. A unit that failed
    (or was cancelled) ends the hashing without a verdict: its own error stands."""

    def __init__(self, f: Any) -> None:
        """``f``: a snapd.fastread.FileRead, its units and spans planned."""
        self.f = f
        self.error: Optional[BaseException] = None
        self.landed = [threading.Event() for _ in f.units]
        self.verified = [False] * len(f.units)
        f.units = [self._signalling(k, u) for k, u in enumerate(f.units)]
        self.thread = threading.Thread(target=self._run, name="snapd-read-sha256",
                                       daemon=True)
        self.thread.start()

    def _signalling(self, k: int, unit: Callable[[], int]) -> Callable[[], int]:
        def run() -> int:
            try:
                done = unit()
                self.verified[k] = True
                return done
            finally:
                self.landed[k].set()
        return run

    def release(self) -> None:
        for event in self.landed:
            event.set()

    def _run(self) -> None:
        try:
            self._hash()
        except BaseException as e:   # a failed re-read: raised by read_files, not lost
            self.error = e

    def _hash(self) -> None:
        f = self.f
        sha = hashlib.sha256(f.header)
        pos = len(f.header)
        for k, spans in enumerate(f.spans):
            self.landed[k].wait()
            if not self.verified[k]:
                return   # damaged or cancelled: the unit's error is the verdict
            for offset, stored_len, view in spans:
                sha.update(memoryview(_ZEROS)[:offset - pos])   # < 4096 by the tiling
                sha.update(view if view is not None else
                           os.pread(f.fd, stored_len, offset))
                pos = offset + stored_len
        sha.update(memoryview(_ZEROS)[:f.size - pos])
        if sha.digest() != f.sha256:
            name = os.path.basename(f.path)
            self.error = CorruptSnapshot(
                f"{f.path}: SHA-256 {sha.hexdigest()} differs from the manifest's "
                f"files[{name!r}].sha256 {f.sha256.hex()}, though every xxh3 digest "
                "matched: the file was replaced and its digests rewritten. Do not use "
                "this snapshot; restore falls back to an older one", path=f.path,
                field=f"files[{name!r}].sha256")
