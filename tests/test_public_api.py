"""The public surface is pinned: what each package exports is exactly its __all__,
and the error tree is the one snapd/errors.py documents."""

import inspect

import snapd
import snapd_client
from snapd import errors


def public_names(module):
    return sorted(n for n in vars(module) if not n.startswith("_")
                  and not isinstance(vars(module)[n], type(snapd)))


def test_client_exports_exactly_all():
    assert public_names(snapd_client) == sorted(snapd_client.__all__)


def test_snapd_exports_exactly_all():
    assert public_names(snapd) == sorted(n for n in snapd.__all__ if not n.startswith("_"))


# Each error's direct bases: its parent in the tree, and the built-in it resembles
# (so that callers catching ValueError or OSError keep working).
BASES = {
    "SnapdError": (Exception,),
    "CorruptSnapshot": ("SnapdError", ValueError),
    "IncompatibleState": ("SnapdError", ValueError),
    "MissingRngStream": ("IncompatibleState",),
    "UnsupportedState": ("SnapdError", TypeError),
    "CorruptLog": ("SnapdError", ValueError),
    "ReplayDivergence": ("SnapdError", RuntimeError),
    "SnapshotFailed": ("SnapdError", RuntimeError),
    "SnapshotExists": ("SnapdError", FileExistsError),
    "InsufficientSpace": ("SnapdError", OSError),
    "DaemonUnavailable": ("SnapdError", ConnectionError),
    "DaemonStartFailed": ("DaemonUnavailable",),
    "AlreadyServing": ("SnapdError", RuntimeError),
    "ProtocolError": ("SnapdError", ValueError),
    "RunInUse": ("SnapdError", RuntimeError),
    "UnknownOption": ("SnapdError", TypeError),
    "InvalidOption": ("SnapdError", ValueError),
}


def test_the_error_tree_is_the_documented_one():
    tree = {name: cls for name, cls in inspect.getmembers(errors, inspect.isclass)
            if issubclass(cls, errors.SnapdError)}
    assert sorted(tree) == sorted(BASES)
    for name, cls in tree.items():
        want = tuple(getattr(errors, b) if isinstance(b, str) else b for b in BASES[name])
        assert cls.__bases__ == want, name
        assert name in errors.__doc__, f"{name} is missing from the tree drawn in errors.py"


def test_every_error_is_exported_from_snapd():
    assert set(BASES) <= set(snapd.__all__)
    for name in BASES:
        assert getattr(snapd, name) is getattr(errors, name)


def test_the_client_exports_the_errors_and_warnings_a_trainer_meets():
    for name in ("SnapdError", "CorruptSnapshot", "IncompatibleState", "MissingRngStream",
                 "SnapshotFailed", "SnapshotExists", "InsufficientSpace", "RunInUse",
                 "DaemonUnavailable", "ReplayDivergence", "UnknownOption", "InvalidOption"):
        assert getattr(snapd_client, name) is getattr(errors, name), name
    for name in ("ReplayWarning", "FallbackWarning"):
        assert issubclass(getattr(snapd_client, name), UserWarning)
        assert name in snapd_client.__all__
    # The very classes restore and the replay check warn with.
    from snapd_client import journal, restore
    assert snapd_client.ReplayWarning is journal.ReplayWarning
    assert snapd_client.FallbackWarning is restore.FallbackWarning
