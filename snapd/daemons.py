"""The live daemons of this user, whatever their roots (``snapd stop --all``,
``snapd status --daemons``).

No registry is kept: a daemon killed with SIGKILL could not take itself out of one.
The processes are the registry. A daemon is a process that

1. belongs to this user (real uid): another user's daemons are never listed, so never
   touched;
2. runs ``snapd serve --root R`` (``python -m snapd serve ...``, the ``snapd``
   console script, or ``--root=R``), R taken relative to the process's working
   directory;
3. holds ``R/.snapd.lock``: the file names its pid (snapd/rootlock.py writes it once
   the flock is taken, and empties it on release) and the process has the file
   open. A process whose command line only looks like a daemon's (a ``serve --detach``
   parent before it exits, a script named alike, a daemon that lost the race for its
   root) holds no lock and is left out.

Reading the lock this way never takes it: a daemon starting at that moment is not
refused its root.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List, Optional, Sequence

import psutil

from snapd.names import ROOT_LOCK_NAME

__all__ = ["LiveDaemon", "find_daemons", "lock_pid", "served_root"]


@dataclass(frozen=True)
class LiveDaemon:
    """One daemon found: its pid, the root it serves, its resident memory (bytes) and
    when it started (seconds since the epoch)."""

    pid: int
    root: str
    rss: int
    started: float


def find_daemons(uid: Optional[int] = None) -> List[LiveDaemon]:
    """Every live daemon of ``uid`` (default: this process's user), by root."""
    uid = os.getuid() if uid is None else uid
    found = []
    for proc in psutil.process_iter(["pid", "uids", "cmdline", "status"]):
        daemon = _as_daemon(proc, uid)
        if daemon is not None:
            found.append(daemon)
    return sorted(found, key=lambda d: d.root)


def _as_daemon(proc: psutil.Process, uid: int) -> Optional[LiveDaemon]:
    """``proc`` as a daemon of ``uid``, or None when it is not one (see above)."""
    info = proc.info
    uids = info.get("uids")
    if uids is None or uids.real != uid or info.get("status") == psutil.STATUS_ZOMBIE:
        return None
    root = served_root(info.get("cmdline") or [])
    if root is None:
        return None
    try:
        root = os.path.normpath(os.path.join(proc.cwd(), root))
        if lock_pid(root) != proc.pid or not _has_open(proc, _lock_path(root)):
            return None
        with proc.oneshot():
            return LiveDaemon(proc.pid, root, proc.memory_info().rss, proc.create_time())
    except psutil.Error:   # gone meanwhile, or not ours to look at
        return None


def served_root(cmdline: Sequence[str]) -> Optional[str]:
    """R of a ``snapd serve --root R`` command line, or None for any other command.

    ``snapd`` must be the program (``-m snapd``, or a file named ``snapd``) and
    ``serve`` the argument right after it: ``python train.py serve --root R`` or
    ``python -m other snapd serve --root R`` are not daemons.
    """
    args = list(cmdline)
    for i, arg in enumerate(args):
        as_module = arg == "snapd" and i > 0 and args[i - 1] == "-m"
        as_script = i <= 1 and os.path.basename(arg) == "snapd"   # [python] .../snapd
        if as_module or as_script:
            return _root_option(args[i + 1:]) if args[i + 1:i + 2] == ["serve"] else None
    return None


def _root_option(args: Sequence[str]) -> Optional[str]:
    for i, arg in enumerate(args):
        if arg == "--root" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--root="):
            return arg[len("--root="):]
    return None


def lock_pid(root: str) -> Optional[int]:
    """The pid ``root/.snapd.lock`` names, or None (no file, empty, unreadable)."""
    try:
        with open(_lock_path(root), "rb") as f:
            text = f.read(32).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() and int(text) > 0 else None


def _lock_path(root: str) -> str:
    return os.path.join(root, ROOT_LOCK_NAME)


def _has_open(proc: psutil.Process, path: str) -> bool:
    """Whether ``proc`` has ``path`` open (the daemon keeps its lock's fd all its life).
    A stale pid in a dead daemon's file, reused by another process, fails this."""
    try:
        target = os.stat(path)
    except OSError:
        return False
    for opened in proc.open_files():
        try:
            st = os.stat(opened.path)
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == (target.st_dev, target.st_ino):
            return True
    return False
