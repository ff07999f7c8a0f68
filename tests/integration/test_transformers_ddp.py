"""The stock Hugging Face Trainer script hf_job.py (snapd_client.transformers.Trainer)
on two ranks under torchrun (DDP over gloo, two CPU processes), the whole job
SIGKILLed in an accumulation window once a snapshot is committed globally, and
started again with the same command: each rank ends on the weights, optimizer state
and log history of the uninterrupted two-rank run, bit for bit.

On two ranks the script seeds each rank's streams apart (its dropout masks differ),
and accelerate shards the training data: each rank iterates its own batches of one
seeded shuffle (``BatchSamplerShard`` over a ``SeedableRandomSampler``). 96 samples,
batch 4 a rank, accumulation 2: 12 batches and 6 steps a rank an epoch, 12 steps in
two epochs; a snapshot every 3 steps. Both ranks stop in step 11's window (after its
first batch), where the test SIGKILLs the job once snapshot 9 is committed: the
restart resumes epoch 1 after its 6 consumed batches.

torchrun runs with ``--run-path --start-method fork`` from a warm parent with
transformers imported (jobs.WarmJob), so its workers are forked instead of started
as new interpreters (about 10 s of imports each, three jobs); the training path is
the same. Plain ``torchrun --nproc-per-node 2 hf_job.py`` was checked by hand the
same way (docs/frameworks.md). The uninterrupted job and the first attempt run side
by side; the restart is forked by another parent than the runs it is compared with.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile

import pytest

from helpers import stop_daemons_under
from jobs import WarmJob, files_exist, job_env, snapshot_dir
from hf_results import assert_same_bits, read_final

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_job.py")
RANKS = 2
PAUSE_AT = 10     # both ranks stop in step 11's window: after its first batch
RESUMED_AT = 9    # the newest snapshot then (SNAPD_EVERY=3)


def job_config(base: str, name: str, **extra) -> dict:
    out = os.path.join(base, name)
    os.makedirs(out)
    return {"out": out, "mode": "snapd", "run_name": name,
            "output_dir": os.path.join(base, "shared"), **extra}   # one root, a run each


@pytest.fixture(scope="module")
def ddp_runs(hf_warm):
    """{"whole": the uninterrupted job, "killed": its first attempt, "resumed": the
    restart}, each a WarmJob that has ended."""
    base = tempfile.mkdtemp(prefix="sdhd-", dir="/tmp")   # daemon sockets: 107 bytes
    env = job_env(SNAPD_EVERY="3")
    whole_cfg = job_config(base, "whole")
    cut_cfg = job_config(base, "cut", kills=[["pause", PAUSE_AT]])
    jobs = {"whole": WarmJob(hf_warm["first"], JOB, RANKS, whole_cfg,
                             os.path.join(base, "whole.log"), env)}
    try:
        killed = jobs["killed"] = WarmJob(hf_warm["first"], JOB, RANKS, cut_cfg,
                                          os.path.join(base, "killed.log"), env)
        root = os.path.join(base, "shared", "snapd")
        committed = os.path.join(snapshot_dir(root, "cut", RESUMED_AT), "commit.snapd")
        paused = [os.path.join(cut_cfg["out"], f"paused-{r}") for r in range(RANKS)]
        killed.wait_until(files_exist(committed, *paused), 120,
                          f"snapshot {RESUMED_AT}'s global commit and every rank in "
                          f"step {PAUSE_AT + 1}'s window")
        killed.kill()
        jobs["resumed"] = WarmJob(hf_warm["resumed"], JOB, RANKS, cut_cfg,
                                  os.path.join(base, "resumed.log"), env)
        jobs["resumed"].expect_ok(120)
        jobs["whole"].expect_ok(120)
        yield {**jobs, "whole_out": whole_cfg["out"], "cut_out": cut_cfg["out"]}
    finally:
        for job in jobs.values():
            if job.proc.poll() is None:
                job.kill()
        stop_daemons_under(base)
        shutil.rmtree(base, ignore_errors=True)


def fetched(out: str, rank: int) -> int:
    with open(os.path.join(out, f"fetched-rank{rank}.json")) as f:
        return json.load(f)


def test_the_job_is_killed_whole_and_resumed_on_every_rank(ddp_runs):
    assert ddp_runs["killed"].proc.returncode == -signal.SIGKILL
    resumed = ddp_runs["resumed"].output(200_000)
    assert resumed.count(f"snapd: run cut: resuming from step {RESUMED_AT} ") == RANKS, \
        resumed[-3000:]


@pytest.mark.parametrize("rank", range(RANKS))
def test_every_rank_ends_bit_for_bit(ddp_runs, rank):
    weights, logged = read_final(ddp_runs["cut_out"], rank)
    want_weights, want_logged = read_final(ddp_runs["whole_out"], rank)
    assert_same_bits(weights, want_weights)
    assert logged == want_logged   # the losses logged, those across the kill too
    assert logged["global_step"] == 12


@pytest.mark.parametrize("rank", range(RANKS))
def test_the_resumed_epoch_fetches_only_the_ranks_unconsumed_batches(ddp_runs, rank):
    """Each rank fetches its own 12 batches of 4 an epoch: 96 samples in the whole
    run. The restart skips the 6 batches epoch 1 had consumed by sampler index and
    fetches the other 6: 24 samples."""
    assert fetched(ddp_runs["whole_out"], rank) == 96
    assert fetched(ddp_runs["cut_out"], rank) == 24
