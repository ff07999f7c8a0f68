"""Faulting an arena's pages in, off the training thread, and never across a fork.

A shared-memory page costs a process a page fault the first time it touches it, even
when the file already has the page (``posix_fallocate`` allocated it): the process's
own page table has no entry yet. Measured on this project's machine, a copy into
1 GiB of fresh mapping takes about 1 s, against 0.09 s into warm pages; so the pages
are faulted in before the first snapshot, by ``madvise(MADV_POPULATE_WRITE)``
(Linux 5.14; from 0.2 to 0.9 s per GiB on that machine, whose
speed varies by the hour), or, on an older kernel, by writing zeros to them
(``memset``: the arena is not in use yet).

:class:`Prefault` does it on a short-lived thread, in pieces of ``PIECE`` bytes,
through ctypes (which releases the GIL for the call; Python's ``mmap.madvise`` holds
it). The thread runs off the CPU of the thread that started it, the trainer's, where
the process may use another (snapd/cpulanes.py, "The trainer's CPU kept free"): on
two CPUs it would otherwise take half of the trainer's core for as long as it runs
(about 3 s a GiB, measured on a VM that faults memory in from its host).

Each piece is first written with zeros through the arena's file (``pwrite``), then
mapped by ``madvise``. Why: ``madvise`` holds the process's memory map for reading
while it runs, and the trainer's ``brk``, ``mmap`` and ``munmap`` (its heap grown
or trimmed, a large tensor allocated or freed) wait for it. Measured on that VM, a
Lightning step beside a fault-in that allocated the pages itself spent 0.3-0.6 s
blocked in ``brk`` (``perf``: 2,563 switches out in ``rwsem_down_write_slowpath``
in one step). Written through the file, the pages are allocated and first touched
without that lock, and ``madvise`` only maps pages that exist. The pieces are small
(``PIECE``) for the same reason.

The thread touches nothing of Python's or torch's but its calls (the CPUs it may
run on, ``pwrite``, ``madvise``), and no thread of it is alive while the process
forks: ``os.register_at_fork`` stops every running one before a fork (a DataLoader
starting its workers) and starts it again, where it stopped, in the parent after.
The owner stops it for good (:meth:`stop`) before it unmaps the memory, and waits
for it (:meth:`wait`) before the first copy.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import threading
import weakref
from typing import List, Optional

from snapd.cpulanes import current_cpu, keep_off

logger = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23   # linux/mman.h; Python 3.11's mmap module lacks the name
PIECE = 4 << 20            # how often the thread looks at its stop flag; one madvise
                           # (the memory map's lock held) maps one piece
_ZEROS = bytes(1 << 20)    # what fill_file writes, a MiB at a time

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_running: "weakref.WeakSet[Prefault]" = weakref.WeakSet()
_running_lock = threading.Lock()


def fill_file(fd: int, offset: int, nbytes: int) -> None:
    """Write zeros to ``[offset, offset + nbytes)`` of the arena's file: its pages are
    allocated and first touched through the file, which takes no lock of this
    process's memory map, so the ``madvise`` after it only maps pages that exist."""
    zeros = memoryview(_ZEROS)
    end = offset + nbytes
    while offset < end:
        offset += os.pwrite(fd, zeros[:min(len(zeros), end - offset)], offset)


def populate(address: int, nbytes: int) -> None:
    """Fault in ``[address, address + nbytes)`` for writing, on the calling thread.
    The memory must not be in use: on an old kernel it is zeroed."""
    if _libc.madvise(address, nbytes, MADV_POPULATE_WRITE) == 0:
        return
    err = ctypes.get_errno()
    if err != errno.EINVAL:   # EINVAL: a kernel before 5.14; anything else is real
        raise OSError(err, f"madvise(MADV_POPULATE_WRITE): {os.strerror(err)}")
    ctypes.memset(address, 0, nbytes)


class Prefault:
    """Faults in ``nbytes`` at ``address`` in the background (see the module).
    ``fd``: the file mapped there, from its start, whose pages are then written
    through the file first (:func:`fill_file`); this object closes it once every
    page is in, or when stopped."""

    def __init__(self, address: int, nbytes: int, fd: Optional[int] = None) -> None:
        self.address, self.nbytes, self._fd = address, nbytes, fd
        self.done = 0                       # bytes faulted in so far
        self.error: Optional[BaseException] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._trainer_cpu: Optional[int] = None   # where start() was called: kept free
        self._finished = False              # stopped for good (the memory may go)

    def start(self) -> None:
        """Go on from where it stopped (no-op when done, running or finished)."""
        if self._finished or self._thread is not None or self.done >= self.nbytes \
                or self.error is not None:
            return
        self._stop.clear()
        self._trainer_cpu = current_cpu()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="snapd-prefault")
        with _running_lock:
            _running.add(self)
        self._thread.start()

    def pause(self) -> None:
        """Stop the thread after its current piece and wait for it; start() resumes."""
        thread = self._thread
        if thread is None:
            return
        self._stop.set()
        thread.join()
        self._thread = None
        with _running_lock:
            _running.discard(self)

    def stop(self) -> None:
        """Stop for good: the memory is about to be unmapped."""
        self._finished = True
        self.pause()
        self._close_fd()

    def _piece(self, nbytes: int) -> None:
        """Fault in the next ``nbytes``: through the file first, then mapped."""
        if self._fd is not None:
            fill_file(self._fd, self.done, nbytes)
        populate(self.address + self.done, nbytes)
        self.done += nbytes
        if self.done >= self.nbytes:
            self._close_fd()

    def _close_fd(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def wait(self, upto: Optional[int] = None) -> Optional[BaseException]:
        """Finish on this thread what is left of the first ``upto`` bytes (default:
        all; that part is needed now), and let the thread go on with the rest; the
        error that stopped it, if any (the copy then faults the rest in itself)."""
        upto = self.nbytes if upto is None else min(upto, self.nbytes)
        self.pause()
        if self.error is None and not self._finished and self.done < upto:
            try:
                self._piece(upto - self.done)
            except OSError as e:
                self.error = e
        self.start()   # the rest, if any, in the background
        return self.error

    def _run(self) -> None:
        keep_off(self._trainer_cpu)
        try:
            while self.done < self.nbytes and not self._stop.is_set():
                self._piece(min(PIECE, self.nbytes - self.done))
        except BaseException as e:   # wait() reports it; the copy faults pages itself
            self.error = e


def _before_fork() -> None:
    """No prefault thread is alive while the process forks: pause the running ones."""
    with _running_lock:
        running = list(_running)
    for job in running:
        job.pause()
    _paused_for_fork[:] = running


def _after_fork_in_parent() -> None:
    running, _paused_for_fork[:] = list(_paused_for_fork), []
    for job in running:
        job.start()


def _after_fork_in_child() -> None:
    _paused_for_fork.clear()   # the child never touches the parent's arenas


_paused_for_fork: List[Prefault] = []
os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                    after_in_child=_after_fork_in_child)
