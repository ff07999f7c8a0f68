"""The errors snapd raises, one small tree.

::

    SnapdError
    ├── CorruptSnapshot      (ValueError)    a snapshot's files fail verification
    ├── IncompatibleState    (ValueError)    a snapshot does not fit the tracked objects
    ├── UnsupportedState     (TypeError)     a state leaf cannot be stored without pickle
    ├── CorruptLog           (ValueError)    a state-log segment header is unreadable
    ├── ReplayDivergence     (RuntimeError)  a recomputed step differs from the old log
    ├── SnapshotFailed       (RuntimeError)  a background snapshot did not commit
    ├── InsufficientSpace    (OSError)       the root's disk cannot hold the snapshot
    ├── DaemonUnavailable    (ConnectionError) no daemon answers for the root
    │   └── DaemonStartFailed                  the daemon started for the root exited
    └── RunInUse             (RuntimeError)  another process writes this run and rank

Every message names the file (or object) and the field at fault and says what to do
next. Each error also subclasses the built-in it most resembles, so callers that
already catch ``ValueError`` or ``OSError`` keep working.
"""

from __future__ import annotations


class SnapdError(Exception):
    """Base of every error snapd raises on purpose."""


class CorruptSnapshot(SnapdError, ValueError):
    """A snapshot (or a file in it) fails verification: size, checksum, structure."""

    def __init__(self, message: str, *, path: str | None = None, field: str | None = None):
        super().__init__(message)
        self.path = path
        self.field = field


class IncompatibleState(SnapdError, ValueError):
    """A verified snapshot does not fit what the program tracks now."""

    def __init__(self, message: str, *, field: str | None = None):
        super().__init__(message)
        self.field = field


class UnsupportedState(SnapdError, TypeError):
    """A state-dict leaf of a type that cannot be stored without pickle."""


class CorruptLog(SnapdError, ValueError):
    """A state-log segment cannot be read at all (bad header). Raised by
    ``scan_segment`` of that one file; the log's readers warn and skip it instead."""


class ReplayDivergence(SnapdError, RuntimeError):
    """A recomputed step does not match the record the interrupted run logged."""

    def __init__(self, message: str, *, step: int, cause: str):
        super().__init__(message)
        self.step = step
        self.cause = cause


class SnapshotFailed(SnapdError, RuntimeError):
    """A snapshot handed to the writer did not commit."""


class InsufficientSpace(SnapdError, OSError):
    """Not enough free space under the root to write a snapshot."""


class DaemonUnavailable(SnapdError, ConnectionError):
    """No daemon answers for this root, or it stopped answering."""


class RunInUse(SnapdError, RuntimeError):
    """Another live client holds the writer lock of this run and rank."""

    def __init__(self, message: str, *, path: str | None = None,
                 holder: int | None = None):
        super().__init__(message)
        self.path = path
        self.holder = holder


class DaemonStartFailed(DaemonUnavailable):
    """The daemon a client started could not serve the root (its log says why)."""
