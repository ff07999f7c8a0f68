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


BUILTIN_OF = {
    "CorruptSnapshot": ValueError, "IncompatibleState": ValueError,
    "UnsupportedState": TypeError, "ReplayDivergence": RuntimeError,
    "SnapshotFailed": RuntimeError, "DaemonUnavailable": ConnectionError,
    "DaemonStartFailed": ConnectionError, "RunInUse": RuntimeError,
}


def test_every_error_is_a_snapd_error_and_the_builtin_it_resembles():
    for name, builtin in BUILTIN_OF.items():
        cls = getattr(snapd_client, name)
        assert issubclass(cls, snapd_client.SnapdError)
        assert issubclass(cls, builtin), (name, builtin)
