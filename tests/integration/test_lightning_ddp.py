"""The stock Lightning fit of lightning_job.py on two ranks (DDP, two CPU processes
over gloo), the whole job SIGKILLed mid-accumulation and started again with the same
command: both ranks end on the weights and optimizer state of the uninterrupted
stock fit on two ranks, bit for bit.

The job is forked by a warm parent with Lightning imported and forks its ranks
(``strategy="ddp_fork"``; ``"ddp"`` starts rank 1 as a cold interpreter, about 10 s
more a start here, and trains the same way: checked by hand, two whole-job kills,
both ranks exact). It runs in a process group of its own, which the kill takes
whole, as a lost node does.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile

import pytest

from helpers import stop_daemons_under
from lightning_fits import JOB, PRELOAD, job_env
from warm import Warm


def _run(parent, outputs, name, cfg):
    """One start of the job to its end; a job still running after 300 s is killed,
    every process of it."""
    out = os.path.join(outputs, f"{name}.out")
    proc = parent.start(JOB, [json.dumps(cfg)], job_env(), out, cwd=os.path.dirname(JOB))
    try:
        proc.wait(timeout=300)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)   # the ranks too, were they still there
        except (ProcessLookupError, PermissionError):
            pass
        proc.kill()
        proc.wait()
    with open(out) as f:
        return proc.returncode, f.read()


@pytest.fixture(scope="module")
def ddp_fits(tmp_path_factory, warm):
    """(the uninterrupted fit, [each start of the killed one]) as (returncode, output)."""
    outputs = str(tmp_path_factory.mktemp("lightning-ddp"))
    base = tempfile.mkdtemp(prefix="sdld-", dir="/tmp")   # daemon sockets: 107 bytes
    root, marks = os.path.join(base, "root"), os.path.join(base, "marks")
    os.makedirs(marks)
    resumed = Warm(PRELOAD)
    try:
        whole = _run(warm["first"], outputs, "whole",
                     {"root": root, "run": "whole", "workers": 0, "resume": "none",
                      "devices": 2})
        cut = {"root": root, "run": "cut", "workers": 0, "resume": "snapd", "devices": 2,
               "kills": [["end", 10]], "marks": marks}
        starts = [_run(resumed, outputs, "cut-0", cut), _run(resumed, outputs, "cut-1", cut)]
        yield whole, starts
    finally:
        resumed.close()
        stop_daemons_under(base)
        shutil.rmtree(base, ignore_errors=True)


def _final(output):
    """Each rank's two digest lines, sorted: the ranks print at once into one pipe, so
    their lines interleave in any order (under DDP the ranks' states are equal, so a
    rank that ended elsewhere still shows as a line of its own)."""
    return sorted(line for line in output.splitlines()
                  if line.startswith(("weights ", "optimizer ")))


def test_a_two_rank_fit_killed_whole_resumes_bit_for_bit_on_both_ranks(ddp_fits):
    (rc, whole), starts = ddp_fits
    assert rc == 0, whole[-3000:]
    assert len(_final(whole)) == 4, whole[-3000:]   # both ranks print both lines
    assert [rc for rc, _ in starts] == [-signal.SIGKILL, 0], starts[-1][1][-3000:]
    second = starts[1][1]
    # 8 batches a rank an epoch, 4 updates: batch 10 is epoch 1's third, mid-window,
    # after 5 updates; the snapshot of step 3 is the newest. Each rank says so.
    assert second.count("snapd: run cut: resuming from step 3 ") == 2, second[-3000:]
    assert _final(second) == _final(whole)
