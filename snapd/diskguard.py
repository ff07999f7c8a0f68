"""Disk guard: refuse a snapshot the root's disk cannot hold, before writing a byte.

A snapshot that runs out of space half way costs the time of writing it and leaves a
tmp directory to collect; checking first (psutil) is cheap. The check keeps
``min_free_bytes`` free for everything else on the disk (the state log, the OS).
When space is short the caller's ``reclaim`` (retention) runs once before giving up.
ENOSPC that still happens during a write (another process filled the disk) is turned
into the same error, with the same advice.

The writes a run makes as it starts (``Client()``: its directories and writer lock;
``restore()``: the state log's segment and resume record, a pulled snapshot and its
pointer) go through :func:`space_for`, so that a full disk there is the same
InsufficientSpace, naming the file, the mount and the way out, never a bare
``OSError: [Errno 28]``.
"""

from __future__ import annotations

import errno
import os
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

import psutil

from snapd.errors import InsufficientSpace


def free_bytes(root: str) -> int:
    return psutil.disk_usage(root).free


def _advice(root: str) -> str:
    return (f"free space on the disk that holds {root}, lower keep_last/keep_every/"
            "keep_best so that retention deletes older snapshots, or use a root on a "
            "larger disk")


def insufficient(root: str, needed: int, free: int, min_free: int) -> InsufficientSpace:
    return InsufficientSpace(
        f"not enough free space under {root}: the snapshot needs {needed} bytes and "
        f"{min_free} more are kept free (min_free_bytes), but {free} bytes are free; "
        + _advice(root), path=root, field="min_free_bytes")


def ensure_space(root: str, needed: int, min_free: int,
                 reclaim: Optional[Callable[[], object]] = None) -> int:
    """Return the free bytes, or raise InsufficientSpace after one ``reclaim``."""
    free = free_bytes(root)
    if free > needed + min_free:
        return free
    if reclaim is not None:
        reclaim()
        free = free_bytes(root)
        if free > needed + min_free:
            return free
    raise insufficient(root, needed, free, min_free)


def is_enospc(error: BaseException) -> bool:
    return isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)


def from_enospc(error: OSError, root: str, needed: int) -> InsufficientSpace:
    """The error for a write that ran out of space part way (ENOSPC or quota)."""
    where = f" at {error.filename}" if error.filename else ""
    return InsufficientSpace(
        f"the disk under {root} filled up while writing a {needed}-byte snapshot "
        f"({error.strerror}{where}); nothing was committed and the previous snapshot "
        "is intact; " + _advice(root), path=error.filename or root)


# --- a full disk at the start of a run (Client(), restore()) ------------------------

def mount_point(path: str) -> str:
    """The mount point of the filesystem that holds ``path`` (or would hold it: the
    nearest existing parent is asked)."""
    here = os.path.abspath(path)
    while not os.path.ismount(here):
        here = os.path.dirname(here)
    return here


def out_of_space(error: OSError, root: str, path: str, doing: str) -> InsufficientSpace:
    """The error for a write the disk refused (ENOSPC or a quota) at ``path`` while
    ``doing``; ``field`` is "root", the argument that moves the run elsewhere."""
    mount = mount_point(root)
    path = os.fsdecode(error.filename) if error.filename else path  # the exact file
    full = InsufficientSpace(
        f"{path}: {error.strerror or 'no space left'} while {doing}; the filesystem "
        f"mounted at {mount} (which holds the root {root}) is full. Free space on "
        f"{mount}, or point the Client at a root on another disk "
        "(Client(root=...))", path=path, field="root")
    full.errno = error.errno   # callers that test errno == ENOSPC still see it
    return full


@contextmanager
def space_for(root: str, path: str, doing: str) -> Iterator[None]:
    """Inside, a write refused for space (ENOSPC, EDQUOT) raises InsufficientSpace
    naming ``path``, the mount and the way out; any other error passes unchanged.
    The one mapping of those errnos for the writes a run's start makes."""
    try:
        yield
    except OSError as e:
        if isinstance(e, InsufficientSpace) or not is_enospc(e):
            raise
        raise out_of_space(e, root, path, doing) from e
