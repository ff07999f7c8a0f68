"""Continuous run == interrupted-and-resumed run, bit for bit, the resumed half in a
fresh process; the replay check proves it on the recomputed steps; and each piece of
state left out makes the runs differ, with the replay check naming that piece."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration  # every test here runs trainer processes

TRAINER = os.path.join(os.path.dirname(__file__), "trainer.py")
STEPS, CUT, DIED = 12, 5, 9   # snapshot at CUT, the first process dies after DIED


def start_trainer(tmp_path, name, **cfg):
    out = tmp_path / f"{name}.json"
    cfg = {"out": str(out), "steps": STEPS, **cfg}
    # Output to a file, not a pipe: the trainer's DataLoader workers, orphaned by its
    # os._exit, hold a pipe open until they notice (up to 5 s each run).
    log = tmp_path / f"{name}.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, TRAINER, json.dumps(cfg)], stdout=f,
                                stderr=subprocess.STDOUT)
    return proc, out, log


def finish_trainer(started):
    proc, out, log = started
    try:
        assert proc.wait(timeout=300) == 0, log.read_text()[-3000:]
    finally:
        proc.kill()
        proc.wait()
    with open(out) as f:
        return json.load(f)


def run_trainer(tmp_path, name, **cfg):
    return finish_trainer(start_trainer(tmp_path, name, **cfg))


def continuous_and_resumed(tmp_path, root=None, omit=(), **cfg):
    """The continuous run and the interrupted one side by side (separate runs of one
    root: nothing shared but the daemon), then the resumed half."""
    root = root or str(tmp_path / "root")
    whole = start_trainer(tmp_path, "whole", root=root, run="whole", **cfg)
    first = start_trainer(tmp_path, "first", root=root, run="cut", stop=DIED,
                          snapshot_at=[CUT], **cfg)
    whole, first = finish_trainer(whole), finish_trainer(first)
    second = run_trainer(tmp_path, "second", root=root, run="cut", omit=list(omit), **cfg)
    return whole, first, second


# Every pair of (model, loader workers, loader generator) values, in 4 cases of the 8.
CASES = [("momentum", 0, False), ("momentum", 2, True), ("transformer", 0, True),
         ("transformer", 2, False)]


@pytest.mark.parametrize("model,workers,loader_generator", CASES)
def test_resumed_run_equals_continuous_run_bit_for_bit(tmp_path, model, workers,
                                                       loader_generator):
    whole, first, second = continuous_and_resumed(
        tmp_path, model=model, workers=workers, loader_generator=loader_generator)
    assert_same_run(whole, first, second)
    # the resumed stretch crosses later epoch boundaries
    assert whole["final"]["cursor"][0] >= 2


def assert_same_run(whole, first, second):
    assert first["trace"] == whole["trace"][:DIED]
    assert second["trace"] == whole["trace"][CUT:], "the resumed steps differ"
    assert second["final"] == whole["final"]
    replay = second["replay"]
    assert replay["verdict"] == "match" and replay["checked"] == DIED - CUT, replay


# Negative controls: the comparison above can fail. Each leaves one piece out.
CONTROLS = {  # name: (pieces left out, the cause the replay check must name)
    "weights_only": (("optimizer", "scheduler", "rng:python", "rng:numpy", "rng:torch",
                      "rng:gen:loader", "cursor"), "cursor"),
    "cleared_momentum": (("optimizer",), "scalar:loss"),
    "rng_torch": (("rng:torch",), "rng:torch"),
    "rng_numpy": (("rng:numpy",), "rng:numpy"),
    "rng_python": (("rng:python",), "rng:python"),
    "rng_loader_generator": (("rng:gen:loader",), "rng:gen:loader"),
    "cursor": (("cursor",), "cursor"),
}


@pytest.fixture(scope="module")
def control_base(tmp_path_factory):
    """The continuous run to compare with, and the interrupted run's root (its
    snapshot at CUT) that each control resumes from a copy of; no resumed run here:
    each control makes its own."""
    tmp = tmp_path_factory.mktemp("controls")
    cfg = dict(model="momentum", workers=0, loader_generator=True)
    root = str(tmp / "root")
    whole = start_trainer(tmp, "whole", root=root, run="whole", **cfg)
    first = start_trainer(tmp, "first", root=root, run="cut", stop=DIED, snapshot_at=[CUT],
                          **cfg)
    whole, _ = finish_trainer(whole), finish_trainer(first)
    return tmp, whole, cfg


@pytest.mark.parametrize("control", sorted(CONTROLS))
def test_leaving_out_a_piece_makes_the_runs_differ(control_base, tmp_path, control):
    base, whole, cfg = control_base
    shutil.copytree(base / "root", tmp_path / "root",
                    ignore=shutil.ignore_patterns(".snapd.*"))
    omit, cause = CONTROLS[control]
    second = run_trainer(tmp_path, "second", root=str(tmp_path / "root"), run="cut",
                         omit=list(omit), **cfg)
    assert second["trace"] != whole["trace"][CUT:] or second["final"] != whole["final"]
    replay = second["replay"]
    assert replay["verdict"] == "diverged" and replay["cause"] == cause, replay
    if cause != "scalar:loss":  # a missing piece shows at the first recomputed step
        assert replay["step"] == CUT + 1, replay
    else:  # missing momentum changes the first update, so the second step's loss
        assert replay["step"] == CUT + 2, replay


@pytest.mark.parametrize("mode,model,workers", [("wait", "momentum", 2),
                                                ("overlap", "transformer", 0)])
def test_resumed_run_equals_continuous_run_through_the_daemon(tmp_path, short_root, mode,
                                                              model, workers):
    cfg = dict(model=model, workers=workers, loader_generator=True,
               options={"daemon": True, "mode": mode})
    whole, first, second = continuous_and_resumed(tmp_path, root=short_root, **cfg)
    assert_same_run(whole, first, second)
    assert second["restored_from"] == "hot"  # the daemon still held step CUT in memory
