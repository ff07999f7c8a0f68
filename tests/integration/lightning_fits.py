"""What the Lightning tests share: the job they run (lightning_job.py), what their
warm parents import beside torch, and the environment each run gets."""

from __future__ import annotations

import os

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lightning_job.py")
PRELOAD = ("lightning.pytorch", "snapd_client.lightning")


def job_env() -> dict:
    """This process's environment, with the real daemon whichever lane set
    SNAPD_DAEMON (tests/conftest.py), and torch on one thread: a dozen runs go
    side by side."""
    return {**{k: v for k, v in os.environ.items() if k != "SNAPD_DAEMON"},
            "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
