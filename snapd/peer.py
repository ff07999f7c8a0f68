"""The client end of the daemon's socket: connect to ``<root>/.snapd.sock``, say hello,
send a request, read the frame that answers it.

One home for it, because three parts of snapd talk to a daemon: the trainer's
connection (``snapd_client.connection``, which adds spawning, a reader thread,
pings and bounded waits on top of :func:`connect` and :func:`hello`), the live view's
status probe (``snapd.liveview.DaemonProbe``, a :class:`Peer`) and the tests. The
frames and messages themselves are :mod:`snapd.protocol`.
"""

from __future__ import annotations

import errno
import os
import socket
from typing import Any, Dict, List, Optional

from snapd import protocol as proto
from snapd.errors import DaemonUnavailable
from snapd.names import SOCKET_NAME

__all__ = ["Peer", "connect", "hello"]


def connect(root: str, timeout: Optional[float] = None) -> Optional[socket.socket]:
    """A socket connected to the root's daemon, or None when none listens (no socket
    file, or one a dead daemon left behind); any other failure is raised (OSError).
    ``timeout`` bounds every later send and receive on the socket (None: blocking)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        with proto.socket_address(root) as address:
            sock.connect(address)
        return sock
    except OSError as e:
        sock.close()
        if e.errno in (errno.ENOENT, errno.ECONNREFUSED):
            return None
        raise


def hello(run: str = "", rank: int = 0) -> proto.Hello:
    """The first message on every connection; ``run`` "" for one that only asks."""
    return proto.Hello(proto.PROTOCOL_VERSION, os.getpid(), run, rank)


class Peer:
    """A synchronous request/reply client on one connection. A request waits for the
    frame whose ``re`` is its id; frames that answer nothing (events) met meanwhile are
    kept in order for :meth:`event`, or dropped with ``keep_events=False``."""

    def __init__(self, sock: socket.socket, *, keep_events: bool = True) -> None:
        self.sock, self.keep_events = sock, keep_events
        self.events: List[Dict[str, Any]] = []
        self.welcome: Optional[Dict[str, Any]] = None   # the reply to open()'s hello
        self._id = 0

    @classmethod
    def open(cls, root: str, *, timeout: Optional[float] = None, run: str = "",
             rank: int = 0, keep_events: bool = True) -> "Peer":
        """Connect and say hello; the hello's reply is in ``self.welcome`` (an
        ``error`` frame when the daemon refused). DaemonUnavailable if none listens."""
        sock = connect(root, timeout)
        if sock is None:
            raise DaemonUnavailable(f"no daemon is serving {root} (no one listens on "
                                    f"{os.path.join(root, SOCKET_NAME)})",
                                    path=os.path.join(root, SOCKET_NAME))
        peer = cls(sock, keep_events=keep_events)
        try:
            peer.welcome = peer.request(hello(run, rank))
        except BaseException:
            peer.close()
            raise
        return peer

    def request(self, message: Any) -> Dict[str, Any]:
        """Send ``message`` and return the raw frame (a map) that answers it."""
        self._id += 1
        proto.send(self.sock, message, id=self._id)
        while True:
            frame = proto.recv(self.sock)
            if frame.get("re") == self._id:
                return frame
            if self.keep_events:
                self.events.append(frame)

    def event(self) -> Dict[str, Any]:
        """The oldest frame that answered no request, waiting for one if none is kept."""
        return self.events.pop(0) if self.events else proto.recv(self.sock)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> "Peer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
