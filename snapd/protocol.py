"""The messages between client and daemon, and their framing on the Unix socket.

Frame: a u32 little-endian length L, then L bytes of msgpack: one map. Every map has
``"op"``. A request also has ``"id"`` (a client-chosen int); its reply has ``"re"``
equal to that id. Messages the daemon sends on its own (``committed``, ``failed``)
have neither. docs/protocol.md is the table of operations; one dataclass per
message here is its code form. No pickle: a frame that is not a msgpack map of known
fields is a protocol error and the connection is closed.
"""

from __future__ import annotations

import os
import socket
import struct
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Any, Dict, Iterator, Optional, Type

import msgpack

from snapd import errors
# Its home is the error tree; imported here too, so ``protocol.ProtocolError`` works.
from snapd.errors import ProtocolError  # noqa: F401

PROTOCOL_VERSION = 1
# The largest frame either side accepts, refused at its length prefix. The biggest
# frames are a submit's plan descriptor and a hot_reply's copy of it: about 96 bytes
# per tensor (measured: 40,000 tensors, a model of 10,000 parameters with AdamW,
# 3.8 MB), so 64 MiB holds some 700,000 tensors. docs/protocol.md, "Framing".
MAX_FRAME = 64 << 20
RECV_PIECE = 1 << 20   # a frame's buffer grows with the bytes that really arrive
_LEN = struct.Struct("<I")
from snapd.names import SOCKET_NAME  # noqa: F401  (re-exported: protocol.SOCKET_NAME)
MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes with the terminating NUL


@contextmanager
def socket_address(root: str) -> Iterator[str]:
    """An AF_UNIX address for ``<root>/.snapd.sock``, whatever the root's length.

    A path too long for ``sun_path`` is reached through ``/proc/self/fd/<dirfd>/``
    (Linux resolves it at bind/connect time), so deep roots work without a symlink.
    """
    path = os.path.join(root, SOCKET_NAME)
    if len(os.fsencode(path)) <= MAX_SOCKET_PATH:
        yield path
        return
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{fd}/{SOCKET_NAME}"
    finally:
        os.close(fd)


# --- requests (client -> daemon) --------------------------------------------------

@dataclass
class Hello:
    """First message on a connection: versions must match, and who is talking.
    ``options``: the daemon-wide options the client was given (snapd.options
    DAEMON_OPTIONS), which the daemon must share or refuse it; None (absent, an older
    client, a tool): nothing to check. ``signing_key_id``: the id of the key the
    client signs with (snapd/signing.py; "" for none, never the key), which must be
    the daemon's; None: nothing to check."""
    op = "hello"
    protocol: int
    pid: int
    run: str = ""
    rank: int = 0
    options: Optional[Dict[str, Any]] = None
    signing_key_id: Optional[str] = None


@dataclass
class Attach:
    """Map the client's staging arena: a shared-memory segment of ``slots`` slots.
    ``hot``: one slot is to spare, and the daemon holds the slot of the latest
    commit as the run's hot copy (it renames the file instead of unlinking it)."""
    op = "attach"
    run: str
    rank: int
    shm: str
    size: int
    slots: int
    hot: bool = False


@dataclass
class Submit:
    """Hand off one staged snapshot; the plan's tensors point into ``slot``.
    ``cpu``: the CPU the training thread called ``snapshot()`` on, which the daemon's
    hashing keeps free (snapd/cpulanes.py); None (absent, an older client): none."""
    op = "submit"
    run: str
    rank: int
    step: int
    slot: int
    plan: Dict[str, Any]
    options: Dict[str, Any] = field(default_factory=dict)
    cpu: Optional[int] = None


@dataclass
class Status:
    """Ask for the daemon's status (runs, in-flight writes, resources)."""
    op = "status"


@dataclass
class HotGet:
    """Ask for the latest committed snapshot of a run still held in memory."""
    op = "hot"
    run: str
    rank: int = 0


@dataclass
class HotRelease:
    """A restarted client has restored (from the held copy or the files): the
    snapshot held for an earlier client of (run, rank) may go now. Without it the dead
    client's arena stays in /dev/shm beside the new client's until the new one's
    first commit takes over the hold: the state four times over instead of twice."""
    op = "hot_release"
    run: str
    rank: int = 0


@dataclass
class Ping:
    """Liveness check; the reply is ``Pong``."""
    op = "ping"


@dataclass
class Stop:
    """Ask the daemon to stop: it replies ``ok``, stops accepting, finishes every
    accepted snapshot (their events still go out), then exits (``snapd stop``)."""
    op = "stop"


@dataclass
class Bye:
    """The client is done (every snapshot resolved): its hot copy may be released."""
    op = "bye"


# --- replies and events (daemon -> client) ----------------------------------------

@dataclass
class Welcome:
    op = "welcome"
    protocol: int
    daemon_pid: int
    root: str
    remote: str = ""   # the remote tier it replicates to (redacted URL), "" for none


@dataclass
class Ok:
    op = "ok"


@dataclass
class Error:
    """A request failed: the error as :func:`snapd.errors.to_wire` gives it. ``kind``
    names the class to raise; ``path``, ``field`` and ``extra`` (the class's own
    fields) are absent from an older peer's reply, and then None."""
    op = "error"
    kind: str
    message: str
    path: Optional[str] = None
    field: Optional[str] = None
    extra: Optional[Dict[str, Any]] = None

    @classmethod
    def of(cls, error: BaseException) -> "Error":
        return cls(**errors.to_wire(error))

    def exception(self) -> BaseException:
        """The exception to raise on this side: the same class, with its fields."""
        return errors.from_wire(_error_fields(self))


@dataclass
class Accepted:
    op = "accepted"
    step: int


@dataclass
class Committed:
    """Event: a submitted snapshot is durable and its slot is free again."""
    op = "committed"
    run: str
    rank: int
    step: int
    slot: int
    name: str
    bytes: int
    seconds: float
    # False: a part of a multi-rank snapshot, durable; the snapshot is committed once
    # every rank's part is (snapd/globalcommit.py), which the client checks on disk.
    complete: bool = True
    # The committed manifest's SHA-256 (hex), for the client's log; None: not taken.
    manifest_sha256: Optional[str] = None


@dataclass
class Failed:
    """Event: a submitted snapshot did not commit; its slot is free again. ``path``
    and ``field``: the error's (snapd.errors.to_wire), when it has them."""
    op = "failed"
    run: str
    rank: int
    step: int
    slot: int
    kind: str
    message: str
    path: Optional[str] = None      # the error's fields, as in Error
    field: Optional[str] = None
    extra: Optional[Dict[str, Any]] = None

    @classmethod
    def of(cls, run: str, rank: int, step: int, slot: int,
           error: BaseException) -> "Failed":
        return cls(run, rank, step, slot, **errors.to_wire(error))

    def exception(self) -> BaseException:
        """The error that failed the write, as the daemon raised it."""
        return errors.from_wire(_error_fields(self))


def _error_fields(message: Any) -> Dict[str, Any]:
    return {"kind": message.kind, "message": message.message, "path": message.path,
            "field": message.field, "extra": message.extra or {}}


@dataclass
class StatusReply:
    op = "status_reply"
    status: Dict[str, Any]


@dataclass
class HotReply:
    """Where the held snapshot lies: a segment, and the manifest name it matches; or,
    with no segment, ``reason``: why none is held (absent from older daemons)."""
    op = "hot_reply"
    shm: Optional[str] = None
    snapshot: Optional[str] = None
    plan: Optional[Dict[str, Any]] = None
    reason: Optional[str] = None


@dataclass
class Pong:
    op = "pong"
    pid: int


MESSAGES: Dict[str, Type] = {cls.op: cls for cls in (
    Hello, Attach, Submit, Status, HotGet, HotRelease, Ping, Stop, Bye, Welcome, Ok, Error, Accepted,
    Committed, Failed, StatusReply, HotReply, Pong)}


def to_wire(message: Any, **envelope: int) -> Dict[str, Any]:
    # Fields one level deep: messages hold plain values, and asdict() would deep-copy
    # a submit's whole descriptor (~2 ms on every snapshot()).
    return {"op": message.op, **envelope,
            **{f.name: getattr(message, f.name) for f in fields(message)}}


def from_wire(data: Dict[str, Any]) -> Any:
    """A decoded map to its message dataclass; ProtocolError on anything unknown."""
    if not isinstance(data, dict) or not isinstance(data.get("op"), str) \
            or data["op"] not in MESSAGES:
        raise ProtocolError(f"unknown message {str(data)[:80]!r}")
    cls = MESSAGES[data["op"]]
    names = {f.name for f in fields(cls)}
    try:
        return cls(**{k: v for k, v in data.items() if k in names})
    except TypeError as e:
        raise ProtocolError(f"malformed {data['op']} message: {e}") from e


def encode(message: Any, **envelope: int) -> bytes:
    payload = msgpack.packb(to_wire(message, **envelope), use_bin_type=True)
    return _LEN.pack(len(payload)) + payload


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes. The buffer grows piece by piece, so a peer that announces
    a large frame and sends little of it costs what it sent, not what it announced."""
    buf = bytearray()
    while len(buf) < n:
        piece = sock.recv(min(n - len(buf), RECV_PIECE))
        if not piece:
            raise EOFError("peer closed the connection")
        buf += piece
    return bytes(buf)


def recv(sock: socket.socket) -> Dict[str, Any]:
    """One frame as a map (with its envelope). EOFError when the peer is gone."""
    (length,) = _LEN.unpack(_recv_exact(sock, 4))
    if length > MAX_FRAME:   # refused before a byte of it is read or buffered
        raise ProtocolError(f"frame of {length} bytes exceeds {MAX_FRAME}")
    try:
        data = msgpack.unpackb(_recv_exact(sock, length), raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError,
            msgpack.StackError) as e:   # TypeError: a map key that cannot be hashed
        raise ProtocolError(f"frame is not msgpack: {e}") from e
    if not isinstance(data, dict):
        raise ProtocolError("frame is not a map")
    return data


def send(sock: socket.socket, message: Any, **envelope: int) -> None:
    sock.sendall(encode(message, **envelope))
