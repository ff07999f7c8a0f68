"""The unit lane (``pytest -m "not integration"``) starts no process: a test that does
must carry the ``integration`` marker, or it fails (tests/conftest.py)."""

from __future__ import annotations

import os
import pty
import subprocess
import sys

import pytest

INTEGRATION_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "integration")


def test_an_unmarked_test_cannot_start_a_subprocess():
    with pytest.raises(pytest.fail.Exception, match="not marked integration"):
        subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_an_unmarked_test_cannot_fork_a_pty():
    with pytest.raises(pytest.fail.Exception, match="not marked integration"):
        pid, _fd = pty.fork()
        if pid == 0:   # unguarded, in the child: leave at once, run no test twice
            os._exit(0)


def test_an_unmarked_test_cannot_fork():
    with pytest.raises(pytest.fail.Exception, match="not marked integration"):
        if os.fork() == 0:   # unguarded, in the child: leave at once, run no test twice
            os._exit(0)


@pytest.mark.integration
def test_a_marked_test_can():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_everything_under_tests_integration_is_marked(request):
    unmarked = [item.nodeid for item in request.session.items
                if str(item.path).startswith(INTEGRATION_DIR + os.sep)
                and item.get_closest_marker("integration") is None]
    assert unmarked == []
