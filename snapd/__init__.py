"""snapd: the daemon side of snapd and everything it keeps on disk.

The training process imports :mod:`snapd_client`; this package holds the on-disk
format, the state log, the store and the writer, which both sides share. Every
error of :mod:`snapd.errors` is exported here.
"""

from snapd import logs as _logs  # noqa: F401  (the stderr handler of snapd's loggers)
from snapd.errors import (
    AlreadyServing,
    CorruptLog,
    CorruptSnapshot,
    DaemonStartFailed,
    DaemonUnavailable,
    IncompatibleState,
    InsufficientSpace,
    InvalidOption,
    MissingRngStream,
    ProtocolError,
    ReplayDivergence,
    RunInUse,
    SnapdError,
    SnapshotExists,
    SnapshotFailed,
    UnknownOption,
    UnsupportedState,
)

__version__ = "0.1.0"

__all__ = [
    "AlreadyServing",
    "CorruptLog",
    "CorruptSnapshot",
    "DaemonStartFailed",
    "DaemonUnavailable",
    "IncompatibleState",
    "InsufficientSpace",
    "InvalidOption",
    "MissingRngStream",
    "ProtocolError",
    "ReplayDivergence",
    "RunInUse",
    "SnapdError",
    "SnapshotExists",
    "SnapshotFailed",
    "UnknownOption",
    "UnsupportedState",
    "__version__",
]
