"""``snapd stop [ROOT]``: ask the daemon serving a root to drain and exit, and wait.
``snapd stop --all``: the same for every daemon of this user (snapd/daemons.py finds
them), all asked at once, one line each.

Through the protocol's ``stop`` request (docs/protocol.md), not a signal to the pid in
``.snapd.lock``: the socket already checks that the asker is the daemon's own user, and
the pid in the file could be stale or reused. Stopping a root nobody serves is no
error: the state asked for (no daemon) already holds, so cleanup scripts may run it
unconditionally.
"""

from __future__ import annotations

import fcntl
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import click
import psutil

from snapd import protocol as proto
from snapd.commands.common import fail, resolve_root
from snapd.daemons import LiveDaemon, find_daemons
from snapd.errors import DaemonUnavailable
from snapd.names import ROOT_LOCK_NAME
from snapd.peer import Peer

HELLO_TIMEOUT = 10.0   # a daemon that does not answer this soon is hung, not busy


@dataclass(frozen=True)
class Asked:
    """What asking a root's daemon to stop found: ``pid`` None when no daemon holds
    the root; ``pending`` the accepted snapshots it drains (None: it was already
    stopping); ``error`` why it could not be asked."""

    root: str
    pid: Optional[int]
    pending: Optional[int] = None
    error: Optional[str] = None


class _Refused(Exception):
    """The daemon answered a request with something else than its reply."""


@click.command()
@click.argument("root", required=False)
@click.option("--all", "every", is_flag=True,
              help="Stop every daemon of this user, whatever its root: all are asked "
                   "at once, then one line each (root, pid, snapshots drained).")
@click.option("--under", metavar="DIR", type=click.Path(file_okay=False), default=None,
              help="With --all: only the daemons whose root is DIR or lies under it.")
@click.option("--timeout", type=click.FloatRange(min=0), default=120.0, show_default=True,
              metavar="SECONDS",
              help="Wait at most this long for the daemon (with --all: all of them) to "
                   "finish and exit.")
def stop(root: Optional[str], every: bool, under: Optional[str], timeout: float) -> None:
    """Stop the daemon serving ROOT: it stops accepting, finishes every snapshot it
    accepted (their trainers still hear that they committed), releases the root and
    exits. Waits until it has exited (also for one already stopping, after SIGTERM
    or idle). A trainer still running starts a new daemon at its next snapshot.
    ROOT: the checkpoint root (default: $SNAPD_ROOT, else the current directory).
    With --all: every daemon of this user (never another user's), found by process
    and confirmed by the lock each holds on its root.

    Exit code 0 once the daemon has exited (with --all: every one), or when no daemon
    serves ROOT (none runs); 1 when one does not answer, or has not exited within
    --timeout.

    Example: snapd stop /data/ckpt; snapd stop --all
    """
    if every:
        if root is not None:
            raise click.UsageError("--all stops the daemon of every root: leave out "
                                   f"ROOT ({root}), or keep to the roots under a "
                                   "directory with --under DIR")
        sys.exit(_stop_all(under, timeout))
    if under is not None:
        raise click.UsageError("--under DIR goes with --all (snapd stop --all --under "
                               f"{under})")
    _stop_one(resolve_root(root), timeout)


def _stop_one(root: str, timeout: float) -> None:
    asked = request_stop(root)
    if asked.error is not None:
        fail(asked.error, 1)
    pid = asked.pid
    if pid is None:
        click.echo(f"no daemon is serving {root}; nothing to stop")
        return
    if asked.pending is None:
        click.echo(f"the daemon (pid {pid}) serving {root} is already stopping")
    else:
        click.echo(f"stopping the daemon (pid {pid}) serving {root}: finishing "
                   f"{asked.pending} accepted snapshot(s)")
    if not _wait_exited(pid, timeout):
        fail(f"the daemon (pid {pid}) serving {root} has not exited after {timeout:g} s; "
             f"it is still finishing its snapshots (`snapd watch {root}` shows their "
             "progress): run snapd stop again to wait longer", 1)
    click.echo(f"stopped (pid {pid})")


def _stop_all(under: Optional[str], timeout: float) -> int:
    """Ask every daemon (under ``under``) to stop, then wait for all: the exit code."""
    daemons = _daemons_under(under)
    where = f" under {os.path.abspath(under)}" if under else ""
    if not daemons:
        click.echo(f"no snapd daemon of this user is running{where}; nothing to stop")
        return 0
    asked = [request_stop(d.root) for d in daemons]   # they all drain at once
    deadline = time.monotonic() + timeout
    failed = 0
    for daemon, answer in zip(daemons, asked):
        line, stopped = _settle(daemon, answer, deadline, timeout)
        click.echo(line)
        failed += not stopped
    if failed:
        click.echo(f"snapd: error: {failed} of {len(daemons)} daemon(s){where} did not "
                   "stop (see their lines above)", err=True)
    return 1 if failed else 0


def _daemons_under(under: Optional[str]) -> List[LiveDaemon]:
    daemons = find_daemons()
    if under is None:
        return daemons
    base = os.path.abspath(under)
    return [d for d in daemons if os.path.commonpath([base, d.root]) == base]


def _settle(daemon: LiveDaemon, asked: Asked, deadline: float,
            timeout: float) -> tuple:
    """(the daemon's one line, whether it stopped), once it exited or the deadline
    passed."""
    root = daemon.root
    if asked.error is not None:
        return f"not stopped {root} (pid {daemon.pid}): {asked.error}", False
    if asked.pid is None:   # exited between finding and asking it
        return f"stopped {root} (pid {daemon.pid}): it had exited already", True
    drained = "it was already stopping" if asked.pending is None else \
        f"drained {asked.pending} accepted snapshot(s)"
    if not _wait_exited(asked.pid, max(0.0, deadline - time.monotonic())):
        return (f"not stopped {root} (pid {asked.pid}): still finishing its snapshots "
                f"after {timeout:g} s (`snapd watch {root}` shows their progress); run "
                "snapd stop --all again to wait longer"), False
    return f"stopped {root} (pid {asked.pid}): {drained}", True


def request_stop(root: str) -> Asked:
    """Ask the daemon serving ``root`` to stop (without waiting for its exit)."""
    try:
        peer = Peer.open(root, timeout=HELLO_TIMEOUT, keep_events=False)
    except DaemonUnavailable:   # nobody answers: none serves, or it is stopping
        return Asked(root, _stopping_holder(root))
    except (OSError, EOFError, proto.ProtocolError) as e:
        return Asked(root, None, error=_hung(root, e))
    with peer:
        try:
            welcome = _answer(peer.welcome, "welcome", "hello")
            status = _answer(peer.request(proto.Status()), "status_reply", "status")
            _answer(peer.request(proto.Stop()), "ok", "stop")
        except _Refused as e:
            return Asked(root, None, error=str(e))
        except (OSError, EOFError, proto.ProtocolError) as e:
            return Asked(root, None, error=_hung(root, e))
    return Asked(root, welcome["daemon_pid"],
                 len(status["status"].get("in_flight") or []))


def _answer(frame: Optional[Dict[str, Any]], want: str, what: str) -> Dict[str, Any]:
    if frame is None or frame.get("op") != want:
        message = (frame or {}).get("message", frame)
        raise _Refused(f"the daemon refused {what}: {message} (an older snapd? run the "
                       "same version on both sides)")
    return frame


def _hung(root: str, error: BaseException) -> str:
    return (f"the daemon serving {root} does not answer ({error!r}); it may be hung: "
            f"its pid is in {root}/.snapd.lock (kill PID stops it, draining accepted "
            "snapshots)")


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
