"""snapd_client: what a training process imports to snapshot and resume exactly.

    from snapd_client import Client

See docs/ for the design, the on-disk format and the operations guide.
"""

from snapd.errors import (
    CorruptSnapshot,
    DaemonStartFailed,
    DaemonUnavailable,
    IncompatibleState,
    ReplayDivergence,
    RunInUse,
    SnapdError,
    SnapshotFailed,
    UnsupportedState,
)
from snapd.options import Options
from snapd_client.client import Client
from snapd_client.cursor import BatchStream
from snapd_client.handle import SnapshotHandle
from snapd_client.restore import FallbackWarning

__all__ = [
    "BatchStream",
    "Client",
    "CorruptSnapshot",
    "DaemonStartFailed",
    "DaemonUnavailable",
    "FallbackWarning",
    "IncompatibleState",
    "Options",
    "ReplayDivergence",
    "RunInUse",
    "SnapdError",
    "SnapshotFailed",
    "SnapshotHandle",
    "UnsupportedState",
]
