"""The public surface is pinned: what snapd_client exports is exactly __all__."""

import snapd
import snapd_client


def public_names(module):
    return sorted(n for n in vars(module) if not n.startswith("_")
                  and not isinstance(vars(module)[n], type(snapd)))


def test_client_exports_exactly_all():
    assert public_names(snapd_client) == sorted(snapd_client.__all__)


def test_snapd_exports_exactly_all():
    assert public_names(snapd) == sorted(n for n in snapd.__all__ if not n.startswith("_"))


def test_every_error_is_a_snapd_error_and_a_builtin():
    for name in ("CorruptSnapshot", "IncompatibleState", "SnapshotFailed",
                 "DaemonUnavailable", "UnsupportedState", "ReplayDivergence",
                 "RunInUse"):
        cls = getattr(snapd_client, name)
        assert issubclass(cls, snapd_client.SnapdError)
        assert len(cls.__mro__) > 3  # also a built-in (ValueError, OSError, ...)
