"""``snapd stop [ROOT]``: ask the daemon serving a root to drain and exit, and wait.

Through the protocol's ``stop`` request (docs/protocol.md), not a signal to the pid in
``.snapd.lock``: the socket already checks that the asker is the daemon's own user, and
the pid in the file could be stale or reused. Stopping a root nobody serves is no
error: the state asked for (no daemon) already holds, so cleanup scripts may run it
unconditionally.
"""

from __future__ import annotations

import fcntl
import os
import time
from typing import Any, Dict, Optional

import click
import psutil

from snapd import protocol as proto
from snapd.commands.common import fail, resolve_root
from snapd.errors import DaemonUnavailable
from snapd.names import ROOT_LOCK_NAME
from snapd.peer import Peer

HELLO_TIMEOUT = 10.0   # a daemon that does not answer this soon is hung, not busy


@click.command()
@click.argument("root", required=False)
@click.option("--timeout", type=click.FloatRange(min=0), default=120.0, show_default=True,
              metavar="SECONDS",
              help="Wait at most this long for the daemon to finish and exit.")
def stop(root: Optional[str], timeout: float) -> None:
    """Stop the daemon serving ROOT: it stops accepting, finishes every snapshot it
    accepted (their trainers still hear that they committed), releases the root and
    exits. Waits until it has exited (also for one already stopping, after SIGTERM
    or idle). A trainer still running starts a new daemon at its next snapshot. ROOT: the checkpoint root (default: $SNAPD_ROOT, else the
    current directory).

    Exit code 0 once the daemon has exited, or when no daemon serves ROOT; 1 when it
    does not answer, or has not exited within --timeout.

    Example: snapd stop /data/ckpt
    """
    root = resolve_root(root)
    try:
        peer = Peer.open(root, timeout=HELLO_TIMEOUT, keep_events=False)
    except DaemonUnavailable:
        pid = _stopping_holder(root)
        if pid is None:
            click.echo(f"no daemon is serving {root}; nothing to stop")
            return
        click.echo(f"the daemon (pid {pid}) serving {root} is already stopping")
    except (OSError, EOFError, proto.ProtocolError) as e:
        _hung(root, e)
    else:
        with peer:
            pid, pending = _ask_to_stop(root, peer)
        click.echo(f"stopping the daemon (pid {pid}) serving {root}: finishing "
                   f"{pending} accepted snapshot(s)")
    if not _wait_exited(pid, timeout):
        fail(f"the daemon (pid {pid}) serving {root} has not exited after {timeout:g} s; "
             f"it is still finishing its snapshots (`snapd watch {root}` shows their "
             "progress): run snapd stop again to wait longer", 1)
    click.echo(f"stopped (pid {pid})")


def _ask_to_stop(root: str, peer: Peer) -> tuple:
    """(daemon pid, snapshots in flight) once the daemon has said ok to ``stop``."""
    try:
        welcome = _answer(peer.welcome, "welcome", "hello")
        status = _answer(peer.request(proto.Status()), "status_reply", "status")
        _answer(peer.request(proto.Stop()), "ok", "stop")
    except (OSError, EOFError, proto.ProtocolError) as e:
        _hung(root, e)
    return welcome["daemon_pid"], len(status["status"].get("in_flight") or [])


def _answer(frame: Optional[Dict[str, Any]], want: str, what: str) -> Dict[str, Any]:
    if frame is None or frame.get("op") != want:
        message = (frame or {}).get("message", frame)
        fail(f"the daemon refused {what}: {message} (an older snapd? run the same "
             "version on both sides)", 1)
    return frame


def _hung(root: str, error: BaseException) -> None:
    fail(f"the daemon serving {root} does not answer ({error!r}); it may be hung: its "
         f"pid is in {root}/.snapd.lock (kill PID stops it, draining accepted "
         "snapshots)", 1)


def _stopping_holder(root: str) -> Optional[int]:
    """The pid in ``.snapd.lock`` while a daemon still holds that lock but no longer
    accepts (it stops, draining): None when no daemon holds the root. The lock, not
    the pid, is the proof: a pid left in the file by a dead daemon may be reused."""
    path = os.path.join(root, ROOT_LOCK_NAME)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:   # held: a daemon is still there
            text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            return int(text) if text.isdigit() and int(text) > 0 else None
        return None   # free: nobody serves the root
    finally:
        os.close(fd)   # also drops the shared lock we may have taken


def _wait_exited(pid: int, timeout: float) -> bool:
    """Whether process ``pid`` exits (or is a zombie) within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
