"""The stock Hugging Face Trainer script hf_job.py (snapd_client.transformers.Trainer)
on two ranks under torchrun (DDP over gloo, two CPU processes), the whole job
SIGKILLed in an accumulation window and started again with the same command: each
rank ends on the weights, optimizer state and log history of the uninterrupted
two-rank run, bit for bit.

On two ranks the script seeds each rank's streams apart (its dropout masks differ),
and accelerate shards the training data: each rank iterates its own batches of one
seeded shuffle (``BatchSamplerShard`` over a ``SeedableRandomSampler``). 96 samples,
batch 4 a rank, accumulation 2: 12 batches and 6 steps a rank an epoch, 12 steps in
two epochs; a snapshot every 3 steps. In both trials both ranks stop in step 11's
window (after its first batch), where the test SIGKILLs the job:

- "cut": once snapshot 9 is committed globally. The restart resumes epoch 1 after
  its 6 consumed batches.
- "held": while snapshot 9 is written: its root's daemon (gated_daemon.py) holds
  rank 1's part of it, rank 0's is durable; the daemon is SIGKILLed with the job.
  9 is never committed, and the restart resumes from 6, at epoch 1's start.

torchrun runs with ``--run-path --start-method fork`` from a warm parent with
transformers imported (jobs.WarmJob), so its workers are forked instead of started
as new interpreters (about 10 s of imports each); the training path is the same.
Plain ``torchrun --nproc-per-node 2 hf_job.py`` was checked by hand the same way
(docs/frameworks.md). The uninterrupted job and the first attempts run side by side,
then the restarts, forked by another parent than the runs they are compared with.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile

import pytest

from helpers import stop_daemons_under, wait_until
from hf_results import assert_same_bits, read_final
from jobs import WarmJob, files_exist, job_env, parts_dir, snapshot_dir

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "hf_job.py")
GATED = os.path.join(HERE, "gated_daemon.py")
RANKS = 2
PAUSE_AT = 10     # both ranks stop in step 11's window: after its first batch
HELD = 9          # the snapshot committed ("cut"), or held in its write ("held")
RESUMED_AT = {"cut": 9, "held": 6}
FETCHED = {"cut": 24, "held": 48}   # a rank's samples after the restart: 6 or 12 batches


def job_config(base: str, name: str, **extra) -> dict:
    out = os.path.join(base, name)
    os.makedirs(out)
    return {"out": out, "mode": "snapd", "run_name": name, **extra}


def gated_daemon(parent, root: str, gate: str, env: dict):
    """A daemon serving ``root`` whose write of rank 1's part of snapshot HELD waits
    for ``gate`` (never made); ready once its socket is there."""
    os.makedirs(root)
    log = os.path.join(os.path.dirname(root), "daemon.log")
    daemon = parent.start(GATED, [root, gate, "0", "1", str(HELD)], env, log)
    sock = os.path.join(root, ".snapd.sock")
    wait_until(lambda: os.path.exists(sock) or daemon.poll() is not None, 60,
               "the gated daemon's socket")
    with open(log) as f:
        assert daemon.poll() is None, f.read()[-3000:]
    return daemon


@pytest.fixture(scope="module")
def ddp_runs(hf_warm):
    """name -> what the trials left: the jobs, the run's folder and root, and what
    the held trial's root held at the kill."""
    base = tempfile.mkdtemp(prefix="sdhd-", dir="/tmp")   # daemon sockets: 107 bytes
    env = job_env(SNAPD_EVERY="3")
    shared = os.path.join(base, "shared")   # one root for "whole" and "cut"
    pause = [["pause", PAUSE_AT]]
    cfgs = {"whole": job_config(base, "whole", output_dir=shared),
            "cut": job_config(base, "cut", output_dir=shared, kills=pause),
            "held": job_config(base, "held", kills=pause)}
    roots = {"whole": os.path.join(shared, "snapd"), "cut": os.path.join(shared, "snapd"),
             "held": os.path.join(cfgs["held"]["out"], "snapd")}
    first, resumed = hf_warm["first"], hf_warm["resumed"]
    jobs, runs = {}, {name: {"out": cfg["out"], "root": roots[name]}
                      for name, cfg in cfgs.items()}

    def start(parent, name, attempt):
        log = os.path.join(base, f"{name}-{attempt}.log")
        jobs[f"{name}-{attempt}"] = WarmJob(parent, JOB, RANKS, cfgs[name], log, env)
        return jobs[f"{name}-{attempt}"]

    gate = os.path.join(base, "gate")
    daemon = gated_daemon(first, roots["held"], gate, env)
    try:
        start(first, "whole", 1)
        cut, held = start(first, "cut", 1), start(first, "held", 1)
        paused = [f"paused-{r}" for r in range(RANKS)]
        committed = os.path.join(snapshot_dir(roots["cut"], "cut", HELD), "commit.snapd")
        cut.wait_until(files_exist(committed, *(os.path.join(cfgs["cut"]["out"], p)
                                                for p in paused)), 120,
                       f"snapshot {HELD}'s global commit and every rank paused")
        cut.kill()
        rank0_part = os.path.join(parts_dir(roots["held"], "held", HELD), "rank-00000")
        held.wait_until(files_exist(gate + ".waiting", rank0_part,
                                    *(os.path.join(cfgs["held"]["out"], p) for p in paused)),
                        120, f"rank 1's part of snapshot {HELD} held, rank 0's durable")
        held.kill()
        daemon.kill()
        daemon.wait(30)
        with open(os.path.join(roots["held"], "held", "LATEST")) as f:
            runs["held"]["latest"] = f.read().strip()
        runs["held"]["snapshots"] = sorted(os.listdir(os.path.join(roots["held"], "held",
                                                                   "snapshots")))
        runs["held"]["parts"] = sorted(os.listdir(parts_dir(roots["held"], "held", HELD)))
        for name in ("cut", "held"):
            start(resumed, name, 2)
        for job in jobs.values():
            if job.proc.poll() is None:
                job.expect_ok(120)
        for name, run in runs.items():
            run["jobs"] = [jobs[k] for k in sorted(jobs) if k.startswith(name + "-")]
        yield runs
    finally:
        daemon.kill()
        for job in jobs.values():
            if job.proc.poll() is None:
                job.kill()
        stop_daemons_under(base)
        shutil.rmtree(base, ignore_errors=True)


def fetched(out: str, rank: int) -> int:
    with open(os.path.join(out, f"fetched-rank{rank}.json")) as f:
        return json.load(f)


@pytest.mark.parametrize("trial", ["cut", "held"])
def test_the_job_is_killed_whole_and_every_rank_resumes(ddp_runs, trial):
    killed, again = ddp_runs[trial]["jobs"]
    assert killed.proc.returncode == -signal.SIGKILL
    assert again.proc.returncode == 0
    said = again.output(200_000)
    resumed = f"snapd: run {trial}: resuming from step {RESUMED_AT[trial]} "
    assert said.count(resumed) == RANKS, said[-3000:]


def test_a_kill_during_a_write_leaves_the_previous_snapshot(ddp_runs):
    """Killed with rank 1's part of snapshot 9 in flight: rank 0's part is durable,
    9 is not committed, LATEST still names 6 (and the restart resumes from it)."""
    held = ddp_runs["held"]
    assert held["latest"] == f"{RESUMED_AT['held']:08d}"
    assert f"{HELD:08d}" not in held["snapshots"]
    assert "rank-00000" in held["parts"] and "rank-00001" not in held["parts"]


@pytest.mark.parametrize("trial", ["cut", "held"])
@pytest.mark.parametrize("rank", range(RANKS))
def test_every_rank_ends_bit_for_bit(ddp_runs, trial, rank):
    weights, logged = read_final(ddp_runs[trial]["out"], rank)
    want_weights, want_logged = read_final(ddp_runs["whole"]["out"], rank)
    assert_same_bits(weights, want_weights)
    assert logged == want_logged   # the losses logged, those across the kill too
    assert logged["global_step"] == 12


@pytest.mark.parametrize("trial", ["cut", "held"])
@pytest.mark.parametrize("rank", range(RANKS))
def test_the_restart_fetches_only_the_ranks_unconsumed_batches(ddp_runs, trial, rank):
    """Each rank fetches its own 12 batches of 4 an epoch: 96 samples in the whole
    run. Resumed at 9 it skips the 6 batches epoch 1 had consumed, by sampler index,
    and fetches the other 6 (24 samples); resumed at 6, all 12 of epoch 1."""
    assert fetched(ddp_runs["whole"]["out"], rank) == 96
    assert fetched(ddp_runs[trial]["out"], rank) == FETCHED[trial]
