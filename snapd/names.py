"""The names that two processes, or two modules, must agree on: one home for each.

A daemon and its clients find each other by these names, and `gc`, `watch` and the
daemon find the root's lock by them; defining one twice is how two sides drift.
"""

from __future__ import annotations

import os

# --- inside a root -----------------------------------------------------------------
SOCKET_NAME = ".snapd.sock"       # <root>/.snapd.sock: the daemon's Unix socket
ROOT_LOCK_NAME = ".snapd.lock"    # <root>/.snapd.lock: held by the serving daemon, and by gc


def writer_lock_name(rank: int) -> str:
    """<root>/<run>/.writer-<rank:05d>.lock: one writing Client per run and rank."""
    return f".writer-{rank:05d}.lock"


WRITER_LOCK_GLOB = ".writer-*.lock"   # every rank's writer lock of a run


# --- shared memory -----------------------------------------------------------------
SHM_DIR = "/dev/shm"
SHM_PREFIX = "snapd-"             # every segment snapd makes starts with this


def arena_prefix(pid: int, uid: int | None = None) -> str:
    """A client's staging arenas: snapd-<uid>-<pid>-<nonce>; the daemon checks that
    the pid in the name is the peer's own before mapping it."""
    return f"{SHM_PREFIX}{os.getuid() if uid is None else uid}-{pid}-"


def hot_prefix(uid: int | None = None) -> str:
    """The daemon's hot copies: snapd-hot-<uid>-<run>-<rank>-..."""
    return f"{SHM_PREFIX}hot-{os.getuid() if uid is None else uid}-"
