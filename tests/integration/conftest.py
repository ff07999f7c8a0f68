"""Fixtures of the integration tests; what they hand out is in harness.py.

``env``: a root and run for a real Client, which starts its own daemon there.
``daemon_env``: the environment a daemon the test starts itself runs with.
``harness``: starts such daemons and makes arenas; all of it cleaned up.
``warm``: two warm parents (warm.py) that fork trainers without an import of torch
each, "first" for the runs a resume is compared with, "resumed" for the resumes.
``hf_warm``: the same with the Hugging Face Trainer imported too.
Everything under this folder is marked ``integration`` (tests/conftest.py).
"""

from __future__ import annotations

import os

import pytest

from harness import Env, Harness
from warm import Warm


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


@pytest.fixture(scope="module")
def s3_server():
    """One moto S3 server per test module (tests/integration/s3server.py); each test
    takes its own prefix with ``s3_server.url()``. A test that kills the server uses
    ``own_s3_server`` instead."""
    from s3server import S3Server
    server = S3Server().start()
    yield server
    server.stop()


@pytest.fixture
def own_s3_server():
    """A moto S3 server of this test alone, to kill and restart."""
    from s3server import S3Server
    server = S3Server().start()
    yield server
    server.stop()


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    """This process reaches the module's S3 server through the AWS variables."""
    for key, value in s3_server.env.items():
        monkeypatch.setenv(key, value)
    return s3_server


@pytest.fixture(scope="session")
def warm():
    """round -> a warm parent for the session: "first" forks the runs a resume is
    compared with, "resumed" the resumes (a hash seed of their own). Both import torch
    once, side by side, from the first test that asks."""
    parents = {"first": Warm(), "resumed": Warm()}
    yield parents
    for parent in parents.values():
        parent.close()


# What the Hugging Face Trainer's jobs import (hf_job.py), and torchrun's launcher
HF_PRELOAD = ("transformers", "transformers.trainer", "accelerate", "safetensors.torch",
              "torch.distributed.run")


@pytest.fixture(scope="session")
def hf_warm():
    """As ``warm``, the parents importing transformers too (about 10 s each here):
    shared by the Trainer's tests on one rank and on two."""
    parents = {"first": Warm(HF_PRELOAD), "resumed": Warm(HF_PRELOAD)}
    yield parents
    for parent in parents.values():
        parent.close()
