"""A hand-written Accelerate loop with the plain client (accelerate_job.py: prepared
model, optimizer, shuffled loader and scheduler, dropout, gradient accumulation 2
through ``accelerator.accumulate``), SIGKILLed and started again with the same
command, ends on the uninterrupted run's weights, optimizer state and scheduler
position, bit for bit, and logs its losses, in every trial: killed mid-epoch, in an
accumulation window (after a snapshot taken at an epoch's last batch, too), right
after a snapshot was handed off, twice in one run, with 0 and 2 loader workers.

The runs go in rounds, side by side: the uninterrupted runs and every first attempt;
every restart; the third attempts. Each is a child of the session's warm parents
(warm.py; accelerate, 0.3 s, is imported by each child), the restarts of another
parent than the runs they are compared with. The trials share one root (a run each)
and its daemon. The trials with 2 loader workers are compared with the uninterrupted
run with none: the dataset draws no random numbers and the workers' base seed is
drawn either way, so the two runs are the same.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile

import pytest

from helpers import stop_daemons_under
from hf_results import assert_same_bits

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "accelerate_job.py")
BATCHES, SAMPLES = 15, 60   # an epoch; 3 epochs, 24 updates, a snapshot every 4

# trial: (kill points, loader workers, the step each restart resumes from)
TRIALS = {
    "mid_epoch": ([["update", 6]], 0, [4]),
    "accumulating_after_an_epoch_end": ([["micro", 9]], 0, [8]),
    "snapshot_being_written": ([["handed", 12]], 0, [12]),
    "twice": ([["update", 5], ["micro", 18]], 0, [4, 16]),
    "twice_2_workers": ([["update", 10], ["micro", 22]], 2, [8, 20]),
}
WHOLES = {"stock": "none", "whole": "snapd"}


class Runs:
    """Starts accelerate_job.py children and keeps their exit codes and stderr."""

    def __init__(self, base, parents):
        self.base, self.parents, self.configs = base, parents, {}
        self.env = {k: v for k, v in os.environ.items() if k != "SNAPD_DAEMON"}
        self.env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.codes, self.errs = {}, {}

    def config(self, name, mode="snapd", kills=(), workers=0):
        out = os.path.join(self.base, name)
        os.makedirs(out, exist_ok=True)
        self.configs[name] = {"out": out, "mode": mode, "kills": list(kills),
                              "workers": workers, "root": os.path.join(self.base, "root"),
                              "run": name}

    def start(self, parent, names, attempt):
        started = {}
        for name in names:
            err = os.path.join(self.configs[name]["out"], f"err-{attempt}")
            started[name] = (self.parents[parent].start(
                JOB, [json.dumps(self.configs[name])], self.env, err, err), err)
        try:
            for name, (proc, err) in started.items():
                proc.wait(timeout=120)
                with open(err, errors="replace") as f:
                    self.codes.setdefault(name, []).append(proc.returncode)
                    self.errs.setdefault(name, []).append(f.read())
        finally:
            for proc, _ in started.values():
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def accelerate_runs(warm):
    base = tempfile.mkdtemp(prefix="sdacc-", dir="/tmp")   # daemon sockets: 107 bytes
    runs = Runs(base, warm)
    for name, mode in WHOLES.items():
        runs.config(name, mode)
    for name, (kills, workers, _) in TRIALS.items():
        runs.config(name, kills=kills, workers=workers)
    try:
        runs.start("first", list(runs.configs), 1)
        runs.start("resumed", list(TRIALS), 2)
        runs.start("first", [n for n in TRIALS if runs.codes[n][-1] < 0], 3)
        yield runs
    finally:
        stop_daemons_under(base)
        shutil.rmtree(base, ignore_errors=True)


def final(runs, name):
    """The run's final tensors (weights, optimizer state, the scheduler's position)
    and what it logged and fetched."""
    from safetensors.torch import load_file
    out = runs.configs[name]["out"]
    with open(os.path.join(out, "final.json")) as f:
        return load_file(os.path.join(out, "final.safetensors")), json.load(f)


def test_the_stock_loop_gains_the_plain_clients_lines():
    with open(JOB) as f:
        marked = [line.strip() for line in f if line.rstrip().endswith("# snapd")]
    assert marked == [
        "from snapd_client import Client  # snapd",
        'ckpt = Client(cfg["root"], run=cfg["run"], every=EVERY)  # snapd',
        "ckpt.track(model=model, optimizer=optimizer, scheduler=scheduler)  # snapd",
        "loader = ckpt.batches(loader)  # snapd",
        "step = ckpt.restore()  # snapd",
        "first_epoch = loader.epoch  # snapd",
        "ckpt.log(step, loss=loss.item())  # snapd",
        "ckpt.snapshot(step)  # snapd",
        "ckpt.close()  # snapd"]


def test_snapshots_leave_the_run_as_it_was(accelerate_runs):
    runs = accelerate_runs
    for name in WHOLES:
        assert runs.codes[name] == [0], runs.errs[name][-1][-3000:]
    stock, whole = final(runs, "stock"), final(runs, "whole")
    assert_same_bits(whole[0], stock[0])
    assert whole[1] == stock[1]
    assert whole[1]["taken"] == 3 * BATCHES and len(whole[1]["losses"]) == 24


@pytest.mark.parametrize("trial", sorted(TRIALS))
def test_killed_and_restarted_ends_bit_for_bit(accelerate_runs, trial):
    kills, _, resumed_at = TRIALS[trial]
    codes, errs = accelerate_runs.codes[trial], accelerate_runs.errs[trial]
    assert codes == [-signal.SIGKILL] * len(kills) + [0], errs[-1][-3000:]
    for err, step in zip(errs[1:], resumed_at):
        assert f"snapd: run {trial}: resuming from step {step} " in err, err[-3000:]
    want = final(accelerate_runs, "whole")
    got = final(accelerate_runs, trial)
    assert_same_bits(got[0], want[0])
    assert got[1]["losses"] == {str(s): want[1]["losses"][str(s)]
                                for s in range(resumed_at[-1] + 1, 25)}


def test_the_resumed_epoch_fetches_no_consumed_sample(accelerate_runs):
    """Resumed at update 4 (8 of epoch 0's 15 batches of 4 consumed), the restart
    takes the other 7 batches of that epoch and the 30 of the next two, and fetches
    their samples only: 28 + 120."""
    _, logged = final(accelerate_runs, "mid_epoch")
    assert logged["taken"] == BATCHES - 8 + 2 * BATCHES
    assert logged["fetched"] == (SAMPLES - 8 * 4) + 2 * SAMPLES
