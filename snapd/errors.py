"""The errors snapd raises, one small tree.

::

    SnapdError
    ├── CorruptSnapshot      (ValueError)    a snapshot's files fail verification
    │   └── UntrustedSnapshot                 unsigned, or not signed with a key accepted
    ├── IncompatibleState    (ValueError)    a snapshot does not fit the tracked objects
    │   └── MissingRngStream                 it lacks an RNG stream this host has
    ├── UnsupportedState     (TypeError)     a state leaf cannot be stored without pickle
    ├── CorruptLog           (ValueError)    a state-log segment header is unreadable
    ├── ReplayDivergence     (RuntimeError)  a recomputed step differs from the old log
    ├── SnapshotFailed       (RuntimeError)  a background snapshot did not commit
    │   └── IncompleteSnapshot               its part is durable, other ranks' are not
    ├── SnapshotExists       (FileExistsError) another history holds the snapshot's name
    ├── InsufficientSpace    (OSError)       the root's disk cannot hold the snapshot
    ├── DanglingReference                    ranks' parts disagree on what is replicated
    ├── DaemonUnavailable    (ConnectionError) no daemon answers for the root
    │   ├── DaemonStartFailed                  the daemon started for the root exited
    │   └── ProtocolMismatch                   it answers, but speaks another protocol
    ├── RemoteUnavailable    (ConnectionError) the remote tier cannot be reached or used
    ├── AlreadyServing       (RuntimeError)  another daemon holds the root's lock
    ├── ProtocolError        (ValueError)    a peer sent a frame or message that is invalid
    ├── RunInUse             (RuntimeError)  another process writes this run and rank
    ├── DistributedNotReady  (RuntimeError)  many ranks, but no process group yet
    ├── UnknownOption        (TypeError)     an option name snapd does not have
    └── InvalidOption        (ValueError)    an option or argument value snapd cannot use
        └── OptionMismatch                   a client's daemon-wide option differs

Every message names the file (or object) and the field at fault and says what to do
next; the file and the field are also attributes (``path``, ``field``, None where
they do not apply), and they cross the daemon's socket with the error
(``to_wire``/``from_wire``), so a trainer catches the same class with the same fields
the daemon raised. That is why every snapd error is defined here: the wire looks
classes up in this module only, and one defined elsewhere would arrive as a plain
SnapdError (tests/test_errors.py walks both packages for such a class). Each error
also subclasses the built-in it most resembles, so callers that already catch
``ValueError`` or ``OSError`` keep working.
"""

from __future__ import annotations

import builtins
import os
from typing import Any, Dict, Optional

__all__ = [
    "AlreadyServing", "CorruptLog", "CorruptSnapshot", "DaemonStartFailed",
    "DaemonUnavailable", "DanglingReference", "DistributedNotReady", "IncompatibleState",
    "IncompleteSnapshot", "InsufficientSpace", "InvalidOption", "MissingRngStream",
    "OptionMismatch", "ProtocolError", "ProtocolMismatch", "RemoteUnavailable",
    "ReplayDivergence", "RunInUse", "SnapdError", "SnapshotExists", "SnapshotFailed",
    "UnknownOption", "UnsupportedState", "UntrustedSnapshot",
]


class SnapdError(Exception):
    """Base of every error snapd raises on purpose.

    ``path``: the file or directory at fault; ``field``: the field in it (a manifest
    key, a state-dict path, an option name); either may be None.
    """

    def __init__(self, message: str = "", *, path: Optional[str] = None,
                 field: Optional[str] = None):
        super().__init__(message)
        self.path = None if path is None else str(path)
        self.field = field

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""

    def wire_fields(self) -> Dict[str, Any]:
        """The extra fields this error carries across the socket (plain values)."""
        return {}


class CorruptSnapshot(SnapdError, ValueError):
    """A snapshot (or a file in it) fails verification: size, checksum, structure."""


class UntrustedSnapshot(CorruptSnapshot):
    """A client with a signing key met a manifest or record that is unsigned, signed
    with a key it does not accept, or whose signature does not match its bytes
    (snapd/signing.py). Refused like damage: restore falls back to the newest
    correctly signed snapshot."""


class IncompatibleState(SnapdError, ValueError):
    """A verified snapshot does not fit what the program tracks now."""


class MissingRngStream(IncompatibleState):
    """The snapshot lacks an RNG stream this process has (a CPU snapshot resumed on a
    GPU host, say). Every snapshot of the run lacks it too, so restore does not fall
    back through them: it stops and says how to resume anyway."""


class UnsupportedState(SnapdError, TypeError):
    """A state-dict leaf of a type that cannot be stored without pickle."""


class CorruptLog(SnapdError, ValueError):
    """A state-log segment cannot be read at all (bad header). Raised by
    ``scan_segment`` of that one file; the log's readers warn and skip it instead."""


class ReplayDivergence(SnapdError, RuntimeError):
    """A recomputed step does not match the record the interrupted run logged."""

    def __init__(self, message: str = "", *, step: int = -1, cause: str = "",
                 path: Optional[str] = None, field: Optional[str] = None):
        super().__init__(message, path=path, field=field)
        self.step = step
        self.cause = cause

    def wire_fields(self) -> Dict[str, Any]:
        return {"step": self.step, "cause": self.cause}


class SnapshotFailed(SnapdError, RuntimeError):
    """A snapshot handed to the writer did not commit."""


class IncompleteSnapshot(SnapshotFailed):
    """A multi-rank snapshot whose part from this rank is durable but which was not
    committed globally in time: other ranks' parts are missing (``path``: the
    ``.parts-<name>`` directory; ``field``: "parts"). It is never restored."""


class SnapshotExists(SnapdError, FileExistsError):
    """The snapshot's directory name is held by a committed snapshot of another
    history (lineage or rank); it is never overwritten."""


class InsufficientSpace(SnapdError, OSError):
    """Not enough free space under the root to write a snapshot, or to start a run
    (``Client()``, ``restore()``: snapd/diskguard.py ``space_for``); ``errno`` is the
    refused write's (ENOSPC, EDQUOT) where there was one."""


class DanglingReference(SnapdError):
    """A multi-rank snapshot's part leaves a replicated tensor to another rank whose
    part does not hold it (``field``: the ``ref`` entry): the ranks disagree on what is
    replicated, and the snapshot is not committed (snapd/globalcommit.py)."""


class DaemonUnavailable(SnapdError, ConnectionError):
    """No daemon answers for this root, or it stopped answering."""


class RemoteUnavailable(SnapdError, ConnectionError):
    """The remote tier (an fsspec URL) cannot be reached, is not installed, or refused
    a request; ``path`` is the URL without credentials."""


class DaemonStartFailed(DaemonUnavailable):
    """The daemon a client started could not serve the root (its log says why)."""


class ProtocolMismatch(DaemonUnavailable):
    """The daemon serving the root speaks another protocol version than this client
    (``field``: "protocol"; ``path``: the root) and closed the connection. For the
    client it is as good as no daemon: hence a DaemonUnavailable, which a trainer that
    falls back without the daemon already catches."""


class AlreadyServing(SnapdError, RuntimeError):
    """Another daemon holds the root's lock (``path``: the lock file)."""


class ProtocolError(SnapdError, ValueError):
    """A peer sent something that is not a valid frame or message."""


class RunInUse(SnapdError, RuntimeError):
    """Another live client holds the writer lock of this run and rank."""

    def __init__(self, message: str = "", *, path: Optional[str] = None,
                 holder: Optional[int] = None, field: Optional[str] = None):
        super().__init__(message, path=path, field=field)
        self.holder = holder

    def wire_fields(self) -> Dict[str, Any]:
        return {"holder": self.holder}


class DistributedNotReady(SnapdError, RuntimeError):
    """A job of several ranks (``WORLD_SIZE`` > 1) asked for something that needs
    ``torch.distributed`` before ``dist.init_process_group`` was called, or waited in
    vain for what another rank should have put there (rank 0's interval under
    ``every="auto"``)."""


class UnknownOption(SnapdError, TypeError):
    """An option name that snapd does not have (a typo); the message lists the known
    ones and the nearest match; ``field`` is the name given."""


class InvalidOption(SnapdError, ValueError):
    """A value snapd cannot use for an option or argument (``field`` names it); the
    message says which values it takes."""


class OptionMismatch(InvalidOption):
    """A client joining a running daemon was given a daemon-wide option (``field``)
    with another value than the daemon runs with (``path``: the root). The message
    names both values and says what to do: the same value, or stop the daemon."""


# --- across the socket ------------------------------------------------------------

def to_wire(error: BaseException) -> Dict[str, Any]:
    """An error as the plain fields a reply carries: ``kind`` (the class name),
    ``message``, ``path``, ``field``, and ``extra`` (the class's own fields; errno
    and strerror for an OSError)."""
    wire: Dict[str, Any] = {"kind": type(error).__name__, "message": str(error),
                            "path": None, "field": None, "extra": {}}
    if isinstance(error, SnapdError):
        wire.update(path=error.path, field=error.field, extra=error.wire_fields())
    elif isinstance(error, OSError):
        path = error.filename
        wire.update(path=None if path is None else os.fsdecode(path),
                    extra={"errno": error.errno, "strerror": error.strerror})
    return wire


# The extra fields a snapd error's constructor takes back (its wire_fields()).
_EXTRA_KEYS = {"step", "cause", "holder"}


def _text(value: Any) -> Optional[str]:
    return value if isinstance(value, str) else None


def from_wire(wire: Dict[str, Any]) -> BaseException:
    """The exception a reply's error fields name, with its fields back.

    Only classes are looked up by name, in two fixed places (this module's snapd
    errors, then Python's built-in exceptions); nothing is executed. An unknown kind
    becomes a plain ``SnapdError`` whose message names it. A peer that sends only
    ``kind`` and ``message`` gets the class with ``path``/``field`` None.
    """
    kind = str(wire.get("kind", "SnapdError"))
    message = str(wire.get("message", ""))
    path, field = _text(wire.get("path")), _text(wire.get("field"))
    extra = wire.get("extra") if isinstance(wire.get("extra"), dict) else {}
    cls = globals().get(kind)
    if isinstance(cls, type) and issubclass(cls, SnapdError):
        kwargs = {k: v for k, v in extra.items() if k in _EXTRA_KEYS}
        try:
            return cls(message, path=path, field=field, **kwargs)
        except TypeError:  # extra fields of another version: keep class and fields
            return cls(message, path=path, field=field)
    builtin = getattr(builtins, kind, None)
    if isinstance(builtin, type) and issubclass(builtin, Exception) \
            and not issubclass(builtin, SnapdError):
        return _builtin_from_wire(builtin, message, path, extra)
    return SnapdError(f"{kind}: {message}", path=path, field=field)


def _builtin_from_wire(cls: type, message: str, path: Optional[str],
                       extra: Dict[str, Any]) -> BaseException:
    errno = extra.get("errno")
    if issubclass(cls, OSError) and isinstance(errno, int):
        strerror = str(extra.get("strerror") or message)
        return cls(errno, strerror, path) if path is not None else cls(errno, strerror)
    try:
        return cls(message)
    except TypeError:  # a builtin that needs more than a message (UnicodeError's kin)
        return SnapdError(f"{cls.__name__}: {message}", path=path)
