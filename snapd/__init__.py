"""snapd: the daemon side of snapd and everything it keeps on disk.

The training process imports :mod:`snapd_client`; this package holds the on-disk
format, the state log, the store and the writer, which both sides share. Every
error of :mod:`snapd.errors` is exported here.
"""

from snapd import stderrlog as _stderrlog  # noqa: F401  (the stderr handler of snapd's loggers)
from snapd import errors as _errors
from snapd.errors import *  # noqa: F401,F403  (the whole tree: snapd.errors.__all__)

__version__ = "0.1.0"

__all__ = sorted([*_errors.__all__, "__version__"])
