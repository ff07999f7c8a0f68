"""``RUN@STEP`` and ``RUN@anomaly``: how ``snapd repro`` and ``snapd unpin`` name a
step of a run."""

from __future__ import annotations

import os
from typing import Any, Dict, Optional, Tuple

from snapd import statelog
from snapd.commands.common import fail

ANOMALY = "anomaly"


def split_target(text: str) -> Tuple[str, str]:
    """(run, what) of ``RUN@WHAT``; exits 2 naming the form when it is not one."""
    run, at, what = text.rpartition("@")
    if not at or not run or not what:
        fail(f"{text!r}: name a step as RUN@STEP (r@37) or RUN@anomaly (the newest "
             "anomaly the run logged)", 2)
    return run, what


def parse_step(text: str, what: str) -> int:
    try:
        step = int(what)
    except ValueError:
        step = -1
    if step < 0:
        fail(f"{text!r}: {what!r} is not a step; name one as RUN@STEP with STEP a "
             "non-negative int, or RUN@anomaly", 2)
    return step


def newest_anomaly(run_path: str, rank: int = 0) -> Optional[Dict[str, Any]]:
    """The newest "anomaly" record of a rank's log (the whole log is read, newest
    first, until one is found)."""
    for record in statelog.newest_first(run_path, rank):
        if record.get("kind") == "anomaly" and type(record.get("step")) is int:
            return record
    return None


def resolve_step(root: str, text: str) -> Tuple[str, int, Optional[Dict[str, Any]]]:
    """(run, step, anomaly record or None) that ``RUN@STEP`` or ``RUN@anomaly`` names
    under ``root``; exits naming what is missing."""
    run, what = split_target(text)
    path = os.path.join(root, run)
    if not os.path.isdir(path):
        fail(f"{path}: no run {run!r} under {root}", 2)
    if what != ANOMALY:
        return run, parse_step(text, what), None
    found = newest_anomaly(path)
    if found is None:
        fail(f"{path}/log: run {run!r} logged no anomaly (a non-finite loss or grad "
             "norm, or a loss spike; docs/operations.md, 'Anomalies and pins'); name a "
             "step as RUN@STEP", 1)
    return run, found["step"], found
