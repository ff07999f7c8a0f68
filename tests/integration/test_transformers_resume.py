"""The Hugging Face Trainer with snapd (snapd_client/transformers.py), SIGKILLed and
started again with the same command: the stock script hf_job.py (a two-layer GPT-2
from its config on generated tokens, dropout, gradient accumulation 2, a cosine
schedule with warmup, an evaluation every 4 steps) ends on the uninterrupted run's weights and optimizer state,
bit for bit, and on its log history, in every trial: killed mid-epoch, in an
accumulation window, right after a snapshot was handed off, at an epoch's last step,
twice in one run (with 0 and 2 loader workers), and during a snapshot's write with
the daemon killed too. Beside them, the Trainer's own ``resume_from_checkpoint=True``:
exact after a kill mid-epoch, and broken by a kill during its save, at every start.

The runs go in three rounds, side by side: the uninterrupted runs and every first
attempt; every restart; the third attempts. Each is a child of a warm parent that
imported transformers once (warm.py; the session's ``hf_warm``), the restarts of
another parent than the runs they are compared with. The trials share one root (a
run each) and its daemon, except the one whose daemon is killed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest

from helpers import stop_daemons_under, wait_until
from hf_results import assert_same_bits, read_final

JOB = os.path.join(os.path.dirname(__file__), "hf_job.py")
GATED = os.path.join(os.path.dirname(__file__), "gated_daemon.py")
EVERY = 3   # SNAPD_EVERY: 24 steps, 12 per epoch

# trial: (kill points, loader workers, the step each restart resumes from)
TRIALS = {
    "mid_epoch": ([["step_end", 5]], 0, [3]),
    "mid_accumulation": ([["substep", 7]], 0, [6]),
    "accumulating_after_an_epoch_end": ([["substep", 12]], 0, [12]),
    "snapshot_being_written": ([["step_begin", 9]], 0, [9]),
    "epoch_last_step": ([["step_end", 12]], 0, [9]),
    "twice": ([["substep", 4], ["step_end", 20]], 0, [3, 18]),
    "twice_2_workers": ([["step_end", 13], ["substep", 22]], 2, [12, 21]),
}
HELD = "write_held_daemon_killed"   # killed at step 8; restarted; killed with 9 held


def job_config(base, name, mode="snapd", kills=(), workers=0, own_root=False):
    out = os.path.join(base, name)
    os.makedirs(out, exist_ok=True)
    cfg = {"out": out, "mode": mode, "kills": list(kills), "workers": workers}
    if mode == "snapd":   # one root, one daemon, a run each (unless own_root)
        cfg["run_name"] = name
        if not own_root:
            cfg["output_dir"] = os.path.join(base, "shared")
    return cfg


class Runs:
    """Starts hf_job.py children and keeps what they left."""

    def __init__(self, base, parents):
        self.base, self.parents = base, parents
        self.env = {k: v for k, v in os.environ.items() if k != "SNAPD_DAEMON"}
        self.env.update(SNAPD_EVERY=str(EVERY), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.codes, self.errs = {}, {}

    def start(self, parent, cfg, attempt):
        err = os.path.join(cfg["out"], f"err-{attempt}")
        proc = self.parents[parent].start(JOB, [json.dumps(cfg)], self.env, err + ".out", err)
        return proc, err

    def finish(self, started):
        """name -> (returncode, stderr) of ``started`` (name -> (proc, err file))."""
        try:
            for name, (proc, err) in started.items():
                proc.wait(timeout=300)
                with open(err, errors="replace") as f:
                    self.codes.setdefault(name, []).append(proc.returncode)
                    self.errs.setdefault(name, []).append(f.read())
        finally:
            for proc, _ in started.values():
                proc.kill()
                proc.wait()


def held_write_attempt(runs, cfg, root):
    """The restart of HELD against a daemon whose writes wait at a gate: once a
    snapshot's write is in flight, the trainer and the daemon are SIGKILLed."""
    stop_daemons_under(root)   # the first attempt's daemon drains and goes
    gate = os.path.join(cfg["out"], "gate")
    with open(os.path.join(cfg["out"], "gated.log"), "ab") as log:
        daemon = subprocess.Popen([sys.executable, GATED, root, gate], stdout=log,
                                  stderr=log, env=runs.env, start_new_session=True)
    try:
        wait_until(lambda: os.path.exists(os.path.join(root, ".snapd.sock")), 60,
                   "the gated daemon's socket")
        proc, err = runs.start("resumed", cfg, 2)
        wait_until(lambda: os.path.exists(gate + ".waiting") or proc.poll() is not None,
                   120, "a snapshot's write to start")
        proc.kill()
        daemon.kill()
        daemon.wait(10)
    finally:
        daemon.kill()
        daemon.wait(10)
    runs.finish({HELD: (proc, err)})


@pytest.fixture(scope="module")
def hf_runs(hf_warm):
    base = tempfile.mkdtemp(prefix="sdhf-", dir="/tmp")   # daemon sockets: 107 bytes
    runs = Runs(base, hf_warm)
    configs = {name: job_config(base, name, kills=kills, workers=workers)
               for name, (kills, workers, _) in TRIALS.items()}
    configs[HELD] = job_config(base, HELD, kills=[["step_end", 8]], own_root=True)
    configs["own_mid_epoch"] = job_config(base, "own_mid_epoch", "own", [["substep", 7]])
    configs["own_killed_saving"] = job_config(base, "own_killed_saving", "own",
                                              [["save", 9]])
    configs["unseeded_sampler"] = dict(job_config(base, "unseeded_sampler"), args={
        "accelerator_config": {"use_seedable_sampler": False}})
    wholes = {"stock": job_config(base, "stock", "none"),
              "whole": job_config(base, "whole"),
              "whole_2_workers": job_config(base, "whole_2_workers", workers=2)}
    try:
        runs.finish({name: runs.start("first", cfg, 1)
                     for name, cfg in {**wholes, **configs}.items()})
        runs.saving_left = sorted(os.listdir(os.path.join(configs["own_killed_saving"]["out"],
                                                          "checkpoint-9")))
        again = {n: runs.start("resumed", configs[n], 2) for n in configs
                 if n not in (HELD, "unseeded_sampler")}
        held_root = os.path.join(configs[HELD]["out"], "snapd")
        held_write_attempt(runs, configs[HELD], held_root)
        runs.held_pointer = _read(os.path.join(held_root, HELD, "LATEST"))
        runs.held_snapshots = sorted(os.listdir(os.path.join(held_root, HELD, "snapshots")))
        runs.finish(again)
        third = [n for n in configs if len(runs.codes[n]) == 2 and runs.codes[n][-1] < 0]
        third.append("own_killed_saving")   # does a second start fail again?
        runs.finish({n: runs.start("resumed", configs[n], 3) for n in third})
        runs.configs = {**wholes, **configs}
        yield runs
    finally:
        for parent in hf_warm.values():   # the session's: only this module's children
            for child in parent.children.values():
                child.kill()
        stop_daemons_under(base)
        shutil.rmtree(base, ignore_errors=True)


def _read(path):
    with open(path) as f:
        return f.read().strip()


def final(runs, name):
    """The run's final weights and optimizer state, and its log history without the
    wall-clock figures (an evaluation's runtime and throughput)."""
    return read_final(runs.configs[name]["out"])


def max_weight_difference(got, want):
    return max((got[k].double() - want[k].double()).abs().max().item()
               for k in want if k.startswith("model."))


def test_the_stock_script_changes_one_line():
    with open(JOB) as f:
        marked = [line for line in f if line.rstrip().endswith("# snapd")]
    assert marked == ["    from snapd_client.transformers import Trainer  # snapd\n"]


def test_snapshots_leave_the_run_as_it_was(hf_runs):
    assert hf_runs.codes["stock"] == [0] and hf_runs.codes["whole"] == [0], \
        hf_runs.errs["whole"][-1][-3000:]
    stock, with_snapd = final(hf_runs, "stock"), final(hf_runs, "whole")
    assert_same_bits(with_snapd[0], stock[0])
    assert with_snapd[1] == stock[1]
    assert with_snapd[1]["global_step"] == 24


@pytest.mark.parametrize("trial", sorted(TRIALS))
def test_killed_and_restarted_ends_bit_for_bit(hf_runs, trial):
    kills, workers, resumed_at = TRIALS[trial]
    codes, errs = hf_runs.codes[trial], hf_runs.errs[trial]
    assert codes == [-signal.SIGKILL] * len(kills) + [0], errs[-1][-3000:]
    for err, step in zip(errs[1:], resumed_at):
        assert f"snapd: run {trial}: resuming from step {step} " in err, err[-3000:]
    whole = final(hf_runs, "whole_2_workers" if workers else "whole")
    got = final(hf_runs, trial)
    assert_same_bits(got[0], whole[0])
    assert got[1] == whole[1]   # the losses logged, including those across the kill


def test_a_kill_during_a_write_leaves_the_previous_snapshot_resumed_exactly(hf_runs):
    """The daemon and the trainer SIGKILLed while snapshot 9 is written: LATEST still
    names 6, 9 is not committed, and the next start resumes from 6 exactly."""
    codes, errs = hf_runs.codes[HELD], hf_runs.errs[HELD]
    assert codes == [-signal.SIGKILL, -signal.SIGKILL, 0], errs[-1][-3000:]
    assert hf_runs.held_pointer == "00000006"
    assert "00000009" not in hf_runs.held_snapshots
    assert "snapd: run write_held_daemon_killed: resuming from step 6 " in errs[1]
    assert "snapd: run write_held_daemon_killed: resuming from step 6 " in errs[2]
    assert_same_bits(final(hf_runs, HELD)[0], final(hf_runs, "whole")[0])
    assert final(hf_runs, HELD)[1] == final(hf_runs, "whole")[1]


def test_the_trainers_own_resume(hf_runs):
    """resume_from_checkpoint=True: exact after a kill mid-epoch; after a kill during
    its save, every later start fails on the checkpoint folder it left half written."""
    assert hf_runs.codes["own_mid_epoch"] == [-signal.SIGKILL, 0], \
        hf_runs.errs["own_mid_epoch"][-1][-3000:]
    stock = final(hf_runs, "stock")
    own = final(hf_runs, "own_mid_epoch")
    assert max_weight_difference(own[0], stock[0]) == 0.0
    assert_same_bits(own[0], stock[0])
    assert hf_runs.saving_left == ["config.json", "generation_config.json",
                                   "model.safetensors", "training_args.bin"]
    assert hf_runs.codes["own_killed_saving"] == [-signal.SIGKILL, 1, 1]
    for err in hf_runs.errs["own_killed_saving"][1:]:
        assert "FileNotFoundError" in err and "checkpoint-9/trainer_state.json" in err, \
            err[-3000:]


def test_a_sampler_shuffling_from_the_global_rng_is_refused(hf_runs):
    """Its shuffle is drawn at the epoch's start: a resume mid-epoch could not redraw
    it, so the run is refused before the first step, naming the setting."""
    assert hf_runs.codes["unseeded_sampler"] == [1]
    err = hf_runs.errs["unseeded_sampler"][0]
    assert "UnsupportedState" in err and "use_seedable_sampler" in err, err[-3000:]


def test_the_resumed_epoch_fetches_no_consumed_sample(hf_runs):
    """Resumed at step 6 (12 of the epoch's 24 batches of 4 consumed), the restart
    fetches the other 12 batches of that epoch and the 24 of the next: 144 samples,
    against 192 for the whole run. The skip goes by sampler index."""
    def fetched(name):
        with open(os.path.join(hf_runs.configs[name]["out"], "fetched.json")) as f:
            return json.load(f)
    assert fetched("whole") == 192
    assert fetched("mid_accumulation") == 144
