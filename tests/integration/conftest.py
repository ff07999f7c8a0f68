"""Fixtures of the integration tests; what they hand out is in harness.py.

``env``: a root and run for a real Client, which starts its own daemon there.
``daemon_env``: the environment a daemon the test starts itself runs with.
``harness``: starts such daemons and makes arenas; all of it cleaned up.
Everything under this folder is marked ``integration`` (tests/conftest.py).
"""

from __future__ import annotations

import os

import pytest

from harness import Env, Harness


@pytest.fixture
def env():
    e = Env()
    yield e
    e.cleanup()


@pytest.fixture
def daemon_env():
    return {**os.environ, "SNAPD_MIN_FREE_BYTES": "0", "PYTHONUNBUFFERED": "1"}


@pytest.fixture
def harness(daemon_env, tmp_path):
    """start(root) -> a ready daemon; arena(size) -> a segment; all cleaned up."""
    h = Harness(daemon_env, str(tmp_path))
    yield h
    h.cleanup()
