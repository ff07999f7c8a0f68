"""Shared fixtures, and the rule that keeps the unit lane honest.

Plain helpers live in tests/helpers.py; the daemon-process harness of the
integration tests and its fixtures in tests/integration/ (harness.py, conftest.py).
No test module imports another (tests/test_layering.py checks). Tests that start a
process (daemon, trainer, CLI in a subprocess, pty, fork) are marked ``integration``
(everything under tests/integration/ is); ``pytest -m "not integration"`` is the
unit lane, and an unmarked test that starts a process fails, naming the command.
"""

from __future__ import annotations

import contextlib
import gc
import os
import pty
import shutil
import subprocess
import sys
import tempfile

import pytest

# Imports and collection (torch, Lightning, transformers: over a million objects) run
# without the cyclic collector, and what they built is then frozen, out of its sight:
# each collection during the tests, a library's own gc.collect() among them (the
# Trainer calls one at the end of every train()), walks only what the tests made.
# Seconds of the unit lane's CPU; nothing a test asserts depends on it.
gc.disable()

from helpers import long_record_log, stop_daemons_under  # noqa: E402

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)
INTEGRATION_DIR = os.path.join(TESTS, "integration")


def pytest_collection_modifyitems(items):
    for item in items:
        if str(item.path).startswith(INTEGRATION_DIR + os.sep):
            item.add_marker(pytest.mark.integration)


def pytest_collection_finish(session):
    gc.enable()
    gc.freeze()


def pytest_ignore_collect(collection_path, config):
    """The unit lane (exactly ``-m "not integration"``) would deselect every test under
    tests/integration/ (all marked, above): it does not import them either, which was
    a second or more of its start. Any other selection collects them as before."""
    if " ".join(config.getoption("markexpr", "").split()) != "not integration":
        return None
    path = str(collection_path)
    return True if path == INTEGRATION_DIR or path.startswith(INTEGRATION_DIR + os.sep) \
        else None


def _started_by_project(frame) -> bool:
    """Whether the code that called into ``subprocess`` (or ``os.fork``) is this
    project's (tests, snapd, snapd_client) rather than a library's own helper:
    matplotlib asks fc-list for fonts the first time it runs, a DataLoader forks its
    workers through multiprocessing; neither is a process the test starts."""
    while frame is not None and frame.f_code.co_filename == subprocess.__file__:
        frame = frame.f_back
    name = os.path.abspath(frame.f_code.co_filename) if frame is not None else ""
    return name.startswith(REPO + os.sep) and os.sep + "site-packages" + os.sep not in name


@contextlib.contextmanager
def _no_processes(item):
    """Inside an unmarked test (its setup, call and teardown), starting a process
    fails the test. ``pytest.fail`` raises a BaseException: an ``except Exception``
    in the code under test cannot swallow it."""
    if item.get_closest_marker("integration") is not None:
        yield
        return

    def refuse(what):
        pytest.fail(f"{item.nodeid} starts a process ({what}) but is not marked "
                    "integration: mark it, or keep the unit lane free of processes",
                    pytrace=False)

    real_init = subprocess.Popen.__init__

    def guarded_init(self, args, *rest, **kwargs):
        if _started_by_project(sys._getframe(1)):
            refuse(f"subprocess {args!r}")
        real_init(self, args, *rest, **kwargs)

    real_fork = os.fork

    def guarded_fork():
        if _started_by_project(sys._getframe(1)):
            refuse("os.fork")
        return real_fork()

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(subprocess.Popen, "__init__", guarded_init)
        mp.setattr(os, "fork", guarded_fork)
        mp.setattr(pty, "fork", lambda: refuse("pty.fork"))
        yield


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    with _no_processes(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    with _no_processes(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item):
    with _no_processes(item):
        return (yield)


@pytest.fixture(autouse=True, scope="session")
def _snapshots_in_process():
    """Unit tests write snapshots in-process (Options.daemon=False, inherited by the
    trainer subprocesses they start): a daemon started for each tmp root would outlive
    the test. Set for the session so that module-scoped fixtures see it too."""
    before = os.environ.get("SNAPD_DAEMON")
    os.environ["SNAPD_DAEMON"] = "0"
    yield
    if before is None:
        os.environ.pop("SNAPD_DAEMON", None)
    else:
        os.environ["SNAPD_DAEMON"] = before


@pytest.fixture(scope="session", autouse=True)
def _no_daemon_left(tmp_path_factory):
    """Whatever a test forgot, no daemon started under the session's tmp dirs outlives it."""
    yield
    stop_daemons_under(str(tmp_path_factory.getbasetemp()))


@pytest.fixture(autouse=True)
def _daemon_for_integration(request, monkeypatch):
    """Tests marked ``integration`` use the real daemon (and stop it themselves)."""
    if request.node.get_closest_marker("integration") is not None:
        monkeypatch.delenv("SNAPD_DAEMON", raising=False)


@pytest.fixture
def short_root():
    """A root with a short path: the daemon's socket path must fit in 107 bytes."""
    path = tempfile.mkdtemp(prefix="sd-", dir="/tmp")
    yield path
    stop_daemons_under(path)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def root(tmp_path):
    """A checkpoint root inside tmp_path, with a sibling folder to catch escapes."""
    (tmp_path / "outside").mkdir()
    path = tmp_path / "root"
    path.mkdir()
    return str(path)


@pytest.fixture(scope="session")
def long_log(tmp_path_factory):
    """A RunStore whose log holds 120,000 step records over three 5 MiB segments
    (helpers.long_record_log, which says why that size proves a read bounded): built
    once, for the tests of bounded reads in test_statelog and test_recovery.
    Read only: a test that damages it works on a copy."""
    return long_record_log(str(tmp_path_factory.mktemp("long-log")))
