"""A file's SHA-256, taken on a thread of its own while the writer writes the file.

Why a thread: SHA-256 runs at 1-2 GB/s on one core here, about the speed of the disk,
so hashing each chunk before writing it would nearly double a snapshot's time to
durable. ``hashlib`` releases the GIL on buffers over 2 KiB, so a second thread hashes
chunk N while the writer's thread writes chunk N + 1: the time to durable becomes the
longer of the two instead of their sum. The bytes are the writer's own buffers (a
staging arena slot, or compressed bytes), which stay unchanged until the snapshot is
committed, and the digest is taken before the manifest is written.

The order of :meth:`update` calls is the order hashed: file order, as ``sha256sum``
reads the file. Each piece is hashed holding one of the process's CPU lanes
(snapd/cpulanes.py): on a machine of few cores, the hashing of every file written at
once takes one core, not one each.
"""

from __future__ import annotations

import hashlib
import queue
import threading
from typing import Any, Optional

from snapd.cpulanes import Lanes

_END = object()


class Sha256Pipe:
    """``update`` hands bytes to the hashing thread and returns at once; ``digest``
    waits for every byte handed over and returns the SHA-256. ``close`` ends the
    thread without a digest (the write failed). ``lanes``: held while a piece is
    hashed."""

    def __init__(self, lanes: Lanes) -> None:
        self._lanes = lanes
        self._sha = hashlib.sha256()
        self._queue: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="snapd-sha256", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            data = self._queue.get()
            if data is _END:
                return
            if self._error is None:
                try:
                    with self._lanes:
                        self._sha.update(data)
                except BaseException as e:   # re-raised by digest(), on the writer's thread
                    self._error = e

    def update(self, data: Any) -> None:
        self._queue.put(data)

    def digest(self) -> bytes:
        self.close()
        if self._error is not None:
            raise self._error
        return self._sha.digest()

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(_END)
            self._thread.join()
