"""snapd_client: what a training process imports to snapshot and resume exactly.

    from snapd_client import Client

See docs/ for the design, the on-disk format and the operations guide.
"""

from snapd.errors import (
    CorruptSnapshot,
    DaemonStartFailed,
    DaemonUnavailable,
    DistributedNotReady,
    IncompatibleState,
    IncompleteSnapshot,
    InsufficientSpace,
    InvalidOption,
    MissingRngStream,
    ReplayDivergence,
    RunInUse,
    SnapdError,
    SnapshotExists,
    SnapshotFailed,
    UnknownOption,
    UnsupportedState,
)
from snapd.options import Options
from snapd.outputcheck import compare_outputs
from snapd_client.anomaly import AnomalyWarning
from snapd_client.basemodel import Base
from snapd_client.client import Client
from snapd_client.cursor import BatchStream
from snapd_client.handle import CloseSummary, SnapshotHandle, SnapshotWarning
from snapd_client.journal import ReplayWarning
from snapd_client.restore import FallbackWarning
from snapd_client.schedule import CadenceWarning

__all__ = [
    "AnomalyWarning",
    "Base",
    "BatchStream",
    "CadenceWarning",
    "Client",
    "CloseSummary",
    "CorruptSnapshot",
    "DaemonStartFailed",
    "DaemonUnavailable",
    "DistributedNotReady",
    "FallbackWarning",
    "IncompatibleState",
    "IncompleteSnapshot",
    "InsufficientSpace",
    "InvalidOption",
    "MissingRngStream",
    "Options",
    "ReplayDivergence",
    "ReplayWarning",
    "RunInUse",
    "SnapdError",
    "SnapshotExists",
    "SnapshotFailed",
    "SnapshotHandle",
    "SnapshotWarning",
    "UnknownOption",
    "UnsupportedState",
    "compare_outputs",
]
