"""The daemon's lobby: connections that have not said hello yet.

A connection waits here, inside the accept loop's selector, until its first frame
(hello) has arrived whole: no thread of its own, at most ``LOBBY_SIZE`` of them (a new
one that finds the lobby full closes the oldest), each closed ``hello_timeout``
seconds after it connected however slowly its bytes come (docs/protocol.md,
"Limits"). Only then does snapd/server.py give it a thread and count it against
``max_connections``, so sockets that never speak cannot lock a trainer out.
"""

from __future__ import annotations

import selectors
import socket
import struct
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Optional

from snapd.errors import ProtocolError

LOBBY_SIZE = 128         # connections waiting for their hello; a new one closes the oldest
HELLO_MAX_BYTES = 64 << 10   # a first frame longer than this is no hello: closed


class Replay:
    """A first frame the lobby has read, read again by ``protocol.recv`` as if it came
    from the socket: one decoder, one set of protocol errors for every frame."""

    def __init__(self, data: bytes) -> None:
        self._data, self._at = data, 0

    def recv(self, n: int) -> bytes:
        piece = self._data[self._at:self._at + n]
        self._at += len(piece)
        return piece


@dataclass
class Waiting:
    """A connection in the lobby: what has arrived of its first frame, and until when
    the rest may come."""

    sock: socket.socket
    pid: int
    deadline: float   # time.monotonic() at which it is closed, hello or not
    received: bytearray = field(default_factory=bytearray)

    def _missing(self) -> int:
        """Bytes of the first frame still to come: its length prefix, then its body."""
        if len(self.received) < 4:
            return 4 - len(self.received)
        (length,) = struct.unpack_from("<I", self.received)
        if length > HELLO_MAX_BYTES:   # refused before a byte of it is buffered
            raise ProtocolError(f"first frame of {length} bytes; a hello is at most "
                                f"{HELLO_MAX_BYTES}", field="hello")
        return 4 + length - len(self.received)

    def read(self) -> bool:
        """Read what has arrived, never past the first frame: whether it is whole.
        EOFError when the peer left, ProtocolError for a frame too long for a hello."""
        while self._missing():
            try:
                piece = self.sock.recv(self._missing())
            except BlockingIOError:   # non-blocking: the rest has not come yet
                return False
            if not piece:
                raise EOFError("peer closed the connection")
            self.received += piece
        return True


class Lobby:
    """Connections that have not said hello: registered in the accept loop's selector,
    no thread each, at most ``size`` of them, each closed at its deadline.

    A new connection that finds the lobby full closes the oldest waiting one: memory,
    descriptors and threads stay bounded whatever peers do, and the newest connection,
    which is where a trainer's hello is, always gets in. The deadlines are taken in
    arrival order with one timeout, so the oldest entry is always the next to expire.
    """

    def __init__(self, selector: selectors.BaseSelector, size: int, timeout: float,
                 log: Callable[[str], None]) -> None:
        self._selector, self._size, self._timeout, self._log = selector, size, timeout, log
        self._waiting: "OrderedDict[int, Waiting]" = OrderedDict()   # by fd, oldest first

    def admit(self, sock: socket.socket, pid: int) -> Waiting:
        while len(self._waiting) >= self._size:
            self.close(self._oldest(), f"closed before its hello: {self._size} "
                       "connections were waiting for theirs, and the oldest makes room")
        sock.setblocking(False)
        waiting = Waiting(sock, pid, time.monotonic() + self._timeout)
        self._waiting[sock.fileno()] = waiting
        self._selector.register(sock, selectors.EVENT_READ, waiting)
        return waiting

    def leave(self, waiting: Waiting) -> socket.socket:
        """Take a connection whose hello has arrived out of the lobby, blocking again."""
        self._forget(waiting)
        waiting.sock.setblocking(True)
        return waiting.sock

    def close(self, waiting: Waiting, why: Optional[str]) -> None:
        self._forget(waiting)
        waiting.sock.close()
        if why:
            self._log(f"client pid {waiting.pid} {why}")

    def expire(self, now: float) -> None:
        while self._waiting and self._oldest().deadline <= now:
            self.close(self._oldest(), f"closed: no hello within {self._timeout} s of "
                       "connecting (hello_timeout, SNAPD_HELLO_TIMEOUT)")

    def next_deadline(self) -> Optional[float]:
        return self._oldest().deadline if self._waiting else None

    def close_all(self) -> None:
        while self._waiting:
            self.close(self._oldest(), None)

    def _oldest(self) -> Waiting:
        return next(iter(self._waiting.values()))

    def _forget(self, waiting: Waiting) -> None:
        self._selector.unregister(waiting.sock)
        del self._waiting[waiting.sock.fileno()]
