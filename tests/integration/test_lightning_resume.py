"""A stock Lightning fit with ``SnapdCallback``, SIGKILLed at chosen and at random
points and started again with the same command, ends on the weights and optimizer
state of the uninterrupted stock fit (no callback at all), bit for bit.

The fit (lightning_job.py): dropout, AdamW with a per-step OneCycle schedule, a
shuffled DataLoader with 0 and with 2 workers, accumulate_grad_batches=2,
bf16-mixed on the CPU; 3 epochs of 15 batches, 8 updates an epoch (steps end after
batches 1, 3, ..., 13 and 14 of an epoch), a snapshot every 3 updates (every 4 in
one trial, so that one lands on an epoch's last batch).

Variants (VARIANTS): a module that steps its optimizer itself (manual optimization)
with validation inside the epoch (val_check_interval=0.5: after batches 6 and 13 of
an epoch, and at its end), killed after the snapshot of step 15 at batch 28, which a
validation follows; the automatic fit validating so, killed before batch 17 (no
snapshot is offered at an epoch's last batch there: it resumes from step 4), with
Lightning's own ModelCheckpoint and fit(ckpt_path="last")
beside the callback, Lightning's last.ckpt newer than the snapshot; a torchdata
StatefulDataLoader with 2 workers, resumed from the snapshot at epoch 0's last batch
and killed again in epoch 2 (the second resume reads loop state written by a resumed
fit).

A kill ``("end", b)`` comes after batch b's hooks, the snapshot callback's included:
at a step boundary whose snapshot is taken, the trainer dies while the daemon writes
it. ``("start", b)`` comes before batch b's forward. Every trial's runs go side by
side in rounds, each round the next attempt of every trial not finished yet, forked
by a warm parent with Lightning imported; the two uninterrupted runs by the
session's "first" parent (warm.py), so that the two differ in hash seed as separate
interpreters do. Each process runs torch on one thread (OMP_NUM_THREADS=1), a dozen
of them side by side. One trial is killed from outside after a random delay.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import tempfile
import threading

import pytest

from helpers import stop_daemons_under
from lightning_fits import JOB, PRELOAD, job_env
from warm import Warm

# name: (workers, every, kills, the step each restart resumes from: None where the
# kill comes at a random time)
TRIALS = {
    "mid-accumulation": (0, 3, [["end", 10]], [3]),
    "during-snapshot": (0, 3, [["end", 11]], [6]),
    "epoch-start": (0, 3, [["start", 15]], [6]),
    "twice": (0, 3, [["end", 20], ["start", 36]], [9, 18]),
    "after-last-snapshot": (0, 3, [["end", 44]], [24]),
    "random-time": (0, 3, [], None),
    "workers-mid-accumulation": (2, 3, [["end", 6]], [3]),
    "workers-from-epoch-end": (2, 4, [["start", 17]], [8]),
    "workers-twice-during-snapshots": (2, 3, [["end", 5], ["end", 33]], [3, 18]),
    "manual-validation-mid-epoch": (0, 3, [["start", 29]], [15]),
    "validation-mid-epoch-from-epoch-end": (0, 4, [["start", 17]], [4]),
    "stateful-workers-twice-from-epoch-end": (2, 4, [["start", 17], ["start", 38]], [8, 20]),
}
# Trials of a variant of the stock fit (lightning_job.py), and the uninterrupted fit
# of the same variant each ends on.
VARIANTS = {
    "manual-validation-mid-epoch": {"manual": True, "val_check_interval": 0.5},
    "validation-mid-epoch-from-epoch-end": {"val_check_interval": 0.5, "resume": "both"},
    "stateful-workers-twice-from-epoch-end": {"stateful": True},
}
WHOLE = {"manual-validation-mid-epoch": "whole-manual-validation-mid-epoch",
         "validation-mid-epoch-from-epoch-end": "whole-validation-mid-epoch",
         "stateful-workers-twice-from-epoch-end": "whole-stateful-2"}
ATTEMPTS = 4   # a trial's runs at most: its kills, then the run that finishes


def _start(parent, outputs, name, attempt, cfg):
    out = os.path.join(outputs, f"{name}.{attempt}.out")
    err = os.path.join(outputs, f"{name}.{attempt}.err")
    proc = parent.start(JOB, [json.dumps(cfg)], job_env(), out, err,
                        cwd=os.path.dirname(JOB))
    return proc, out, err


def _finish(started):
    proc, out, err = started
    try:
        proc.wait(timeout=300)
    finally:
        proc.kill()
        proc.wait()
    with open(out) as f_out, open(err) as f_err:
        return proc.returncode, f_out.read().splitlines(), f_err.read()


@pytest.fixture(scope="module")
def fits(tmp_path_factory, warm):
    """name -> list of (returncode, stdout lines, stderr) of each attempt, for every
    trial and for the two uninterrupted stock fits ("whole-0", "whole-2" workers)."""
    tmp = tmp_path_factory.mktemp("lightning")
    outputs = str(tmp / "outputs")
    os.makedirs(outputs)
    base = tempfile.mkdtemp(prefix="sdlt-", dir="/tmp")   # daemon sockets: 107 bytes
    root = os.path.join(base, "root")
    parents = {"first": warm["first"], "resumed": Warm(PRELOAD)}
    rand = random.Random(29)
    results = {}
    try:
        cfgs = {}
        for name, (workers, every, kills, _) in TRIALS.items():
            marks = os.path.join(base, f"marks-{name}")
            os.makedirs(marks)
            cfgs[name] = {"root": root, "run": name, "workers": workers, "every": every,
                          "resume": "snapd", "kills": kills, "marks": marks,
                          **VARIANTS.get(name, {})}
        for workers in (0, 2):
            cfgs[f"whole-{workers}"] = {"root": root, "run": f"whole-{workers}",
                                        "workers": workers, "resume": "none"}
        cfgs["whole-validation-mid-epoch"] = {"root": root, "run": "whole-validation",
                                              "workers": 0, "resume": "none",
                                              "val_check_interval": 0.5}
        cfgs["whole-manual-validation-mid-epoch"] = {
            "root": root, "run": "whole-manual-validation", "workers": 0, "resume": "none",
            "manual": True, "val_check_interval": 0.5}
        cfgs["whole-stateful-2"] = {"root": root, "run": "whole-stateful-2", "workers": 2,
                                    "resume": "none", "stateful": True}
        pending = list(cfgs)
        for attempt in range(ATTEMPTS):
            started, timers = {}, []
            for name in pending:
                parent = parents["first" if name.startswith("whole") else "resumed"]
                started[name] = _start(parent, outputs, name, attempt, cfgs[name])
                if name == "random-time" and attempt == 0:
                    timer = threading.Timer(rand.uniform(1.0, 4.0), started[name][0].kill)
                    timer.start()
                    timers.append(timer)
            try:
                for name, one in started.items():
                    results.setdefault(name, []).append(_finish(one))
            finally:
                for timer in timers:
                    timer.cancel()
                for proc, _out, _err in started.values():
                    proc.kill()
                    proc.wait()
            pending = [n for n in pending if results[n][-1][0] == -signal.SIGKILL]
            if not pending:
                break
        yield results
    finally:
        parents["resumed"].close()
        stop_daemons_under(base)
        shutil.rmtree(base, ignore_errors=True)


def _final(runs):
    rc, out, err = runs[-1]
    assert rc == 0, err[-3000:]
    return [line for line in out if line.startswith(("weights ", "optimizer "))]


def test_the_uninterrupted_fit_is_the_same_with_and_without_workers(fits):
    assert len(_final(fits["whole-0"])) == 2
    assert _final(fits["whole-0"]) == _final(fits["whole-2"])


@pytest.mark.parametrize("name", sorted(TRIALS))
def test_killed_fit_resumes_bit_for_bit(fits, name):
    workers, _every, kills, resumed_from = TRIALS[name]
    runs = fits[name]
    if resumed_from is not None:   # each scripted kill happened, once
        assert [rc for rc, _, _ in runs] == [-signal.SIGKILL] * len(kills) + [0], \
            [err[-2000:] for _, _, err in runs]
        for (_, _, err), step in zip(runs[1:], resumed_from):
            assert f"snapd: run {name}: resuming from step {step} " in err, err[-3000:]
    assert _final(runs) == _final(fits[WHOLE.get(name, f"whole-{workers}")])


def test_a_lightning_checkpoint_beside_a_snapshot_gives_way_to_it(fits):
    """fit(ckpt_path="last") with Lightning saving every 2 steps, snapd every 4 (not at
    step 8, an epoch's last batch): killed at step 9, Lightning's last.ckpt is step
    8's and the run's snapshot step 4's. The restart resumes from the snapshot (exact
    above) and says it replaced the file's training state."""
    _, _, err = fits["validation-mid-epoch-from-epoch-end"][1]
    assert "resuming from step 4 " in err, err[-3000:]
    assert "the snapshot of step 4 replaces the training state of " in err, err[-3000:]
    assert "last.ckpt (fit's ckpt_path)" in err, err[-3000:]


def test_a_resume_mid_epoch_is_not_warned_about_as_unresumable(fits):
    """Lightning warns that a loader without state_dict() cannot resume mid-epoch:
    true of its own checkpoints, and silenced for a snapd resume."""
    _, _, err = fits["mid-accumulation"][1]
    assert "resuming from step 3" in err, err[-3000:]
    assert "your dataloader is not resumable" not in err, err[-3000:]
