"""Talk to the daemon serving a root, starting one when none answers.

Every wait in the training process is bounded twice: by ``Options.timeout`` without
any sign of life (a frame from the daemon; a ``ping`` is sent when it has been quiet),
and by a liveness check of the daemon's pid every 0.2 s. A dead or hung daemon thus
becomes :class:`DaemonUnavailable` in the trainer, never a hang. One background
thread reads the socket: replies go to the request waiting on their id, events
(``committed``, ``failed``) to the client's callback, and a lost connection fails
every pending request and is reported to the client once.
"""

from __future__ import annotations

import itertools
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional

import psutil

from snapd import peer
from snapd import protocol as proto
from snapd.errors import DaemonStartFailed, DaemonUnavailable, SnapdError
from snapd.options import Options, daemon_environment

SOCKET_NAME = proto.SOCKET_NAME
LOG_NAME = ".snapd.log"
SPAWN_TIMEOUT = 30.0
POLL = 0.2
EXIT_ALREADY_RUNNING = 2  # `snapd serve` exit code when another daemon holds the root


def try_connect(root: str) -> Optional[socket.socket]:
    """A socket connected to the root's daemon, or None when none listens (no daemon,
    or a socket a dead one left behind): snapd.peer.connect, its errors as snapd's."""
    try:
        return peer.connect(root)
    except OSError as e:
        raise DaemonUnavailable(f"{root}/{SOCKET_NAME}: cannot connect ({e})",
                                path=f"{root}/{SOCKET_NAME}") from e


def daemon_command(root: str) -> List[str]:
    """``snapd serve --detach`` for ``root``, immune to the trainer's directory. The
    client's daemon-wide options go in its environment (spawn_daemon), so that
    serve's resolution of them stays the one place.

    ``python -m`` puts the working directory first on sys.path, where a folder named
    ``snapd`` (a checkpoint root, a source tree) would shadow the installed package:
    ``-P`` (3.11+) leaves it out, and the daemon runs in ``/`` on older Pythons.
    """
    safe_path = ["-P"] if sys.version_info >= (3, 11) else []
    return [sys.executable, *safe_path, "-m", "snapd", "serve", "--root", root, "--detach"]


def connect_or_spawn(root: str, timeout: float = SPAWN_TIMEOUT,
                     options: Optional[Options] = None) -> socket.socket:
    """A socket connected to the root's daemon, starting one when none answers.

    A daemon that is stopping (idle, ``snapd stop``, SIGTERM) still holds the root's
    lock while it finishes, with nobody answering: the one we start exits 2, and we
    try again until the old one is gone, for ``timeout`` seconds at most.
    """
    deadline = time.monotonic() + timeout
    while True:
        sock = try_connect(root)
        if sock is None:
            sock = spawn_daemon(root, max(1.0, deadline - time.monotonic()), options)
        if sock is not None:
            return sock
        if time.monotonic() >= deadline:
            raise DaemonStartFailed(
                f"the daemon holding {root}/.snapd.lock has not answered on "
                f"{root}/{SOCKET_NAME} for {timeout:.0f} s (still stopping, or hung); "
                f"see {os.path.join(root, LOG_NAME)}, or stop it: kill the pid in "
                f"{root}/.snapd.lock")
        time.sleep(POLL)


def spawn_daemon(root: str, timeout: float = SPAWN_TIMEOUT,
                 options: Optional[Options] = None) -> Optional[socket.socket]:
    """Start the root's daemon detached (it outlives us) and connect to it; None when
    another daemon holds the root but nobody answers (it is stopping). It runs with
    ``options``' daemon-wide values (``SNAPD_*`` in its environment; None: ours).

    ``serve --detach`` forks the daemon and exits once it serves, so there is no
    child of ours left running, and a daemon that cannot start is known at once.
    """
    log_path = os.path.join(root, LOG_NAME)
    env = daemon_environment(options) if options is not None else None
    try:
        with open(log_path, "ab") as log:
            code = subprocess.run(daemon_command(root), cwd="/", stdin=subprocess.DEVNULL,
                                  stdout=log, stderr=log, close_fds=True, env=env,
                                  start_new_session=True, timeout=timeout).returncode
    except subprocess.TimeoutExpired as e:
        raise DaemonStartFailed(f"the daemon for {root} did not start serving within "
                                f"{timeout:.0f} s; see {log_path}") from e
    except OSError as e:
        raise DaemonStartFailed(f"cannot start a daemon for {root} ({e}); check that "
                                f"{log_path} is writable and {sys.executable} runs") from e
    # Exit code 2: another daemon won the race for the root; connect to that one.
    if code not in (0, EXIT_ALREADY_RUNNING):
        raise DaemonStartFailed(f"the daemon for {root} exited with code {code} while "
                                f"starting; see {log_path}:\n{log_tail(log_path)}")
    sock = try_connect(root)
    if sock is None and code == EXIT_ALREADY_RUNNING:
        return None   # the holder is stopping (or just died): the caller tries again
    if sock is None:
        raise DaemonStartFailed(f"a daemon started for {root} but nothing answers on "
                                f"{root}/{SOCKET_NAME}; see {log_path}")
    return sock


def log_tail(path: str, nbytes: int = 2000) -> str:
    """The end of the daemon's log, which says why it could not start."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - nbytes))
            return f.read().decode("utf-8", "replace").strip()
    except OSError as e:
        return f"({path} unreadable: {e})"


class _HungUp(Exception):
    """The daemon closed the connection before answering hello (it was stopping)."""


class _Pending:
    def __init__(self, on_reply: Optional[Callable[[Any], None]] = None) -> None:
        self.event = threading.Event()
        self.reply: Any = None
        self.on_reply = on_reply  # for requests nobody waits on (see send_request)


class DaemonConnection:
    """One client's connection: hello, requests with bounded waits, events."""

    def __init__(self, root: str, run: str, rank: int, timeout: float, *,
                 on_event: Callable[[Any], None] = lambda m: None,
                 on_lost: Callable[[BaseException], None] = lambda e: None,
                 spawn: bool = True, options: Optional[Options] = None,
                 given: Optional[Dict[str, Any]] = None,
                 signing_key_id: Optional[str] = None) -> None:
        self.root = os.path.abspath(root)
        # A daemon this connection starts runs with ``options``' daemon-wide values; one
        # already running must share ``given`` (the ones the client was given: hello),
        # and sign with the key of id ``signing_key_id`` ("" none; None: not compared).
        self.options, self.given = options, given
        self.signing_key_id = signing_key_id
        self.run, self.rank, self.timeout = run, rank, timeout
        self.on_event, self.on_lost = on_event, on_lost
        self._ids = itertools.count(1)
        self._pending: Dict[int, _Pending] = {}
        self._lock = threading.Lock()       # pending table and lost state
        self._send_lock = threading.Lock()  # frames from several threads never interleave
        self.lost: Optional[DaemonUnavailable] = None
        self.last_heard = time.monotonic()
        self._last_ping = 0.0
        self.daemon_pid = self._connect(spawn)
        self._reader = threading.Thread(target=self._read_loop, daemon=True,
                                        name=f"snapd-conn-{self.daemon_pid}")
        self._reader.start()

    def _connect(self, spawn: bool, attempts: int = 3) -> int:
        """Connect (or start a daemon) and say hello; the daemon's pid. A daemon that
        hangs up at hello was stopping as we connected: the next one is asked."""
        for attempt in itertools.count(1):
            sock = try_connect(self.root)
            if sock is None:
                if not spawn:
                    raise DaemonUnavailable(f"no daemon is serving {self.root}")
                sock = connect_or_spawn(self.root, max(SPAWN_TIMEOUT, self.timeout),
                                        self.options)
            self._sock = sock
            try:
                return self._hello()
            except _HungUp:
                if attempt == attempts:
                    raise DaemonUnavailable(f"the daemon for {self.root} hung up at "
                                            f"hello {attempts} times; see "
                                            f"{os.path.join(self.root, LOG_NAME)}")

    def _hello(self) -> int:
        self._sock.settimeout(self.timeout)
        try:
            proto.send(self._sock, self._hello_message(), id=0)
            reply = proto.from_wire(proto.recv(self._sock))
        except (EOFError, ConnectionResetError, BrokenPipeError) as e:
            self._sock.close()
            raise _HungUp() from e
        except (OSError, proto.ProtocolError) as e:
            self._sock.close()
            raise DaemonUnavailable(f"the daemon for {self.root} did not answer hello "
                                    f"within {self.timeout} s ({e})") from e
        if isinstance(reply, proto.Error):
            self._sock.close()
            raise reply.exception()   # the daemon's error, with its fields
        if not isinstance(reply, proto.Welcome):
            self._sock.close()
            raise DaemonUnavailable(f"the daemon for {self.root} answered hello with "
                                    f"{reply.op!r}")
        self._sock.settimeout(None)
        return reply.daemon_pid

    def _hello_message(self) -> proto.Hello:
        """Hello, with the daemon-wide options this client was given and the id of its
        signing key: a daemon that runs with other values (a remote tier, its
        retention, another key or none) refuses it with OptionMismatch, rather than
        serve it with values it did not ask for."""
        message = peer.hello(self.run, self.rank)
        if self.run and self.given:
            message.options = dict(self.given)
        if self.run:
            message.signing_key_id = self.signing_key_id
        return message

    # --- the reader thread ---------------------------------------------------------

    def _read_loop(self) -> None:
        try:
            while True:
                data = proto.recv(self._sock)
                self.last_heard = time.monotonic()
                message = proto.from_wire(data)
                if "re" in data:
                    with self._lock:
                        pending = self._pending.pop(data["re"], None)
                    if pending is not None:
                        pending.reply = message
                        pending.event.set()
                        if pending.on_reply is not None:
                            pending.on_reply(message)
                elif isinstance(message, (proto.Committed, proto.Failed)):
                    self.on_event(message)
        except (OSError, EOFError, proto.ProtocolError) as e:
            self._lose(DaemonUnavailable(f"lost the daemon (pid {self.daemon_pid}) "
                                         f"serving {self.root}: {e}"))
        except Exception as e:  # a bug here must fail the waiters, not strand them
            self._lose(DaemonUnavailable(f"the connection to the daemon serving "
                                         f"{self.root} failed: {e!r}"))

    def _lose(self, error: DaemonUnavailable) -> None:
        """Fail every waiter and tell the client, once."""
        with self._lock:
            if self.lost is not None:
                return
            self.lost = error
            pending, self._pending = list(self._pending.values()), {}
        for p in pending:
            p.event.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.on_lost(error)

    # --- liveness and bounded waits ------------------------------------------------

    def daemon_alive(self) -> bool:
        try:
            return psutil.Process(self.daemon_pid).status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def check(self, what: str, since: float = 0.0) -> None:
        """Raise DaemonUnavailable if the daemon is gone, or silent past the timeout
        (counted from ``since`` at the earliest: quiet before a wait is no symptom)."""
        if self.lost is not None:
            raise self.lost
        if not self.daemon_alive():
            self._lose(DaemonUnavailable(f"the daemon (pid {self.daemon_pid}) serving "
                                         f"{self.root} is gone while waiting for {what}"))
            raise self.lost
        quiet = time.monotonic() - max(self.last_heard, since)
        if quiet > self.timeout:
            self._lose(DaemonUnavailable(
                f"the daemon (pid {self.daemon_pid}) serving {self.root} has not "
                f"answered for {quiet:.1f} s (timeout {self.timeout} s) while waiting "
                f"for {what}; it may be hung: `snapd status --root {self.root}`"))
            raise self.lost
        if quiet > min(self.timeout / 4, 5.0) and \
                time.monotonic() - self._last_ping > min(self.timeout / 4, 5.0):
            self._last_ping = time.monotonic()
            self._send(proto.Ping(), next(self._ids))  # its pong refreshes last_heard

    def wait_for(self, event: threading.Event, what: str) -> None:
        """Wait for ``event`` while the daemon lives and answers."""
        since = time.monotonic()
        while not event.wait(POLL):
            self.check(what, since)

    def _send(self, message: Any, req_id: int) -> None:
        try:
            with self._send_lock:
                proto.send(self._sock, message, id=req_id)
        except OSError as e:
            self._lose(DaemonUnavailable(f"cannot send {message.op} to the daemon "
                                         f"serving {self.root}: {e}"))
            raise self.lost from e

    def _post(self, message: Any, pending: _Pending) -> None:
        req_id = next(self._ids)
        with self._lock:
            if self.lost is not None:
                raise self.lost
            self._pending[req_id] = pending
        self._send(message, req_id)

    def send_request(self, message: Any, on_reply: Callable[[Any], None]) -> None:
        """Send a request without waiting: ``on_reply(reply)`` runs on the reader
        thread when it comes. If the daemon is lost first it never runs; the loss is
        reported through ``on_lost`` instead."""
        self._post(message, _Pending(on_reply))

    def request(self, message: Any) -> Any:
        """Send a request and return its reply; an ``error`` reply is raised."""
        pending = _Pending()
        self._post(message, pending)
        self.wait_for(pending.event, f"the reply to {message.op}")
        if pending.reply is None:
            raise self.lost or DaemonUnavailable(f"no reply to {message.op}")
        if isinstance(pending.reply, proto.Error):
            raise pending.reply.exception()
        return pending.reply

    def close(self) -> None:
        """Say ``bye`` (the daemon may release this run's hot copy: the client is done,
        nobody will restart from it), then hang up. A trainer that dies says nothing:
        the daemon keeps the copy for ``hot_linger_seconds``."""
        if self.lost is None and self.run:
            try:
                self.request(proto.Bye())
            except SnapdError:
                pass   # lost meanwhile: the daemon keeps the copy for a while, harmless
        with self._lock:
            if self.lost is None:
                self.lost = DaemonUnavailable(f"connection to {self.root} closed")
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
