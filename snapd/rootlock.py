"""``<root>/.snapd.lock``: who serves a root, and who may clean it.

The serving daemon holds an exclusive ``flock`` on this file for its whole life, with
its pid written inside for the message a second daemon gets. ``snapd gc
--collect-tmp`` takes the same lock for as long as it removes tmp dirs, so that it
never runs beside a daemon whose tmp dirs are snapshots being written. The kernel
drops the lock when the holder dies (SIGKILL included), so a stale file never blocks
a restart; ``O_CLOEXEC`` keeps it from leaking into processes the holder execs.
"""

from __future__ import annotations

import fcntl
import os
from typing import Optional

from snapd.errors import AlreadyServing
from snapd.names import ROOT_LOCK_NAME


class RootLock:
    """The root's lock; :meth:`acquire` raises AlreadyServing when it is held."""

    def __init__(self, root: str) -> None:
        self.path = os.path.join(root, ROOT_LOCK_NAME)
        self._fd: Optional[int] = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
            os.close(fd)
            raise AlreadyServing(
                f"another snapd daemon (pid {holder}) already serves root "
                f"{os.path.dirname(self.path)}; stop it first (kill {holder}) or serve "
                "another root", path=self.path) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            os.close(self._fd)   # closing the fd releases the flock
            self._fd = None

    def __enter__(self) -> "RootLock":
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
