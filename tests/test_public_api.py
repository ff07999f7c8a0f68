"""The public surface is pinned: what each package exports is exactly its __all__,
and the error tree is the one snapd/errors.py documents."""

import builtins
import inspect
import re

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


# The tree drawn in snapd/errors.py's docstring is the specification: each line
# names an error, its depth gives its parent, and the built-in in parentheses (so
# that callers catching ValueError or OSError keep working) is its other base.
_DRAWN = re.compile(r"^ {4}(?P<indent>(?:[│ ] {3})*)(?:[├└]── )?(?P<name>[A-Z]\w+)"
                    r"(?:\s+\((?P<builtin>\w+)\))?")


def drawn_bases() -> dict:
    """{error name: its direct bases} as the docstring draws them."""
    bases, parents = {}, []
    for line in errors.__doc__.split("::", 1)[1].split("\n\n")[1].splitlines():
        m = _DRAWN.match(line)
        assert m, f"not a line of the tree: {line!r}"
        depth = len(m["indent"]) // 4 + (0 if line.strip().startswith("SnapdError") else 1)
        parents[depth:] = [m["name"]]
        parent = (parents[depth - 1],) if depth else (Exception,)
        builtin = (getattr(builtins, m["builtin"]),) if m["builtin"] else ()
        bases[m["name"]] = parent + builtin
    return bases


BASES = drawn_bases()


def test_the_error_tree_is_the_documented_one():
    tree = {name: cls for name, cls in inspect.getmembers(errors, inspect.isclass)
            if issubclass(cls, errors.SnapdError)}
    assert sorted(tree) == sorted(BASES) == sorted(errors.__all__)
    for name, cls in tree.items():
        want = tuple(getattr(errors, b) if isinstance(b, str) else b for b in BASES[name])
        assert cls.__bases__ == want, name


def test_the_tree_reader_reads_what_is_drawn():
    assert BASES["SnapdError"] == (Exception,)
    assert BASES["MissingRngStream"] == ("IncompatibleState",)
    assert BASES["SnapshotExists"] == ("SnapdError", FileExistsError)
    assert len(BASES) >= 17


def test_every_error_is_exported_from_snapd():
    assert set(BASES) <= set(snapd.__all__)
    for name in BASES:
        assert getattr(snapd, name) is getattr(errors, name)


def test_the_client_exports_the_errors_and_warnings_a_trainer_meets():
    for name in ("SnapdError", "CorruptSnapshot", "IncompatibleState", "MissingRngStream",
                 "SnapshotFailed", "SnapshotExists", "InsufficientSpace", "RunInUse",
                 "DaemonUnavailable", "ReplayDivergence", "UnknownOption", "InvalidOption"):
        assert getattr(snapd_client, name) is getattr(errors, name), name
    for name in ("ReplayWarning", "FallbackWarning", "AnomalyWarning"):
        assert issubclass(getattr(snapd_client, name), UserWarning)
        assert name in snapd_client.__all__
    # The very classes restore and the replay check warn with.
    from snapd_client import handle, journal, restore
    assert snapd_client.ReplayWarning is journal.ReplayWarning
    assert snapd_client.FallbackWarning is restore.FallbackWarning
    from snapd_client import anomaly
    assert snapd_client.AnomalyWarning is anomaly.AnomalyWarning   # log() warns with it
    # A snapshot failed in the background; what close() returns.
    assert snapd_client.SnapshotWarning is handle.SnapshotWarning
    assert issubclass(snapd_client.SnapshotWarning, RuntimeWarning)
    assert snapd_client.CloseSummary is handle.CloseSummary
    assert {"SnapshotWarning", "CloseSummary"} <= set(snapd_client.__all__)
