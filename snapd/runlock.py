"""One writer per run and rank: ``<root>/<run>/.writer-<rank:05d>.lock``.

Two processes writing the same run and rank interleave records in one state log and
snapshots in one directory; neither run can then be resumed. A client that writes
(logs, snapshots, resume records) therefore holds an exclusive ``flock`` on this
file for its whole life, with its pid written inside for the message the second
writer gets.

Why flock, and why these flags:

- The kernel drops the lock when the holder dies, SIGKILL included, so a restart
  after a crash is never refused by a stale lock file (the file itself stays; only
  the lock matters, and the pid inside is a hint for the message).
- ``O_CLOEXEC``: the daemon a client starts (exec) never inherits the descriptor.
- Forked children (DataLoader workers) would share the lock and keep it after the
  trainer died; the child closes its copy right after ``fork`` (its closing drops
  only the child's reference, the parent keeps the lock). Should some child still
  hold it (a fork outside Python), the holder written inside is dead, and the next
  writer waits a short while for the orphan to exit before refusing.
- Two clients in one process conflict too: each opens its own file description.

A reader (``Client(..., read_only=True)``, ``snapd`` commands) takes no lock.

The lock file is the first thing ``Client()`` writes: on a full disk (or quota) its
creation or the pid raises InsufficientSpace naming the file, the mount and the way
out (snapd/diskguard.py), and the descriptor is closed, so nothing is held.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from typing import Dict, Optional

import psutil

from snapd.diskguard import space_for
from snapd.errors import RunInUse
from snapd.names import writer_lock_name

ORPHAN_WAIT = 10.0   # seconds to wait for the children of a dead holder to exit
_POLL = 0.05

_held: Dict[int, str] = {}   # fd -> lock path, in this process
_held_lock = threading.Lock()


def lock_path(run_path: str, rank: int) -> str:
    return os.path.join(run_path, writer_lock_name(rank))


def _close_in_child() -> None:
    """After fork: the child must not keep the parent's writer locks alive."""
    for fd in list(_held):
        try:
            os.close(fd)
        except OSError:
            pass
    _held.clear()


os.register_at_fork(after_in_child=_close_in_child)


def _holder(fd: int) -> Optional[int]:
    text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    return int(text) if text.isdigit() else None


def _alive(pid: Optional[int]) -> bool:
    if pid is None:
        return True   # unknown: treat as a live holder, never steal on a guess
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


class RunLock:
    """The writer lock of one run and rank; :meth:`acquire` raises RunInUse."""

    def __init__(self, run_path: str, run: str, rank: int) -> None:
        self.path = lock_path(run_path, rank)
        self.run, self.rank = run, rank
        self._fd: Optional[int] = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        with self._space("creating"):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            self._wait_or_refuse(fd)
            with self._space("writing this process's pid into"):
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except BaseException:
            os.close(fd)   # drops the flock too: a failed acquire holds nothing
            raise
        with _held_lock:
            _held[fd] = self.path
        self._fd = fd

    def _space(self, doing: str):
        """A full disk (or quota) here is InsufficientSpace naming the lock file."""
        root = os.path.dirname(os.path.dirname(self.path))
        return space_for(root, self.path, f"{doing} the writer lock of run {self.run!r}")

    def _wait_or_refuse(self, fd: int) -> None:
        """Take the lock; a dead holder's orphaned children get ORPHAN_WAIT to exit."""
        deadline = time.monotonic() + ORPHAN_WAIT
        while not _try_flock(fd):
            holder = _holder(fd)
            if _alive(holder) or time.monotonic() > deadline:
                raise self._refusal(holder)
            time.sleep(_POLL)

    def _refusal(self, holder: Optional[int]) -> RunInUse:
        who = f"process {holder}" if holder is not None else "another process"
        if holder == os.getpid():
            who = f"another Client in this process ({holder})"
        return RunInUse(
            f"{self.path}: run {self.run!r} rank {self.rank} is already being written by "
            f"{who}; a second writer would interleave its log and snapshots. Stop the "
            f"other process (or close() the other Client) first, or open this one with "
            f"Client(..., read_only=True) to restore without writing",
            path=self.path, holder=holder)

    def release(self) -> None:
        """Drop the lock (the file stays: removing it would race the next writer)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        with _held_lock:
            _held.pop(fd, None)
        try:
            os.ftruncate(fd, 0)
        finally:
            os.close(fd)   # closing the last descriptor releases the flock
