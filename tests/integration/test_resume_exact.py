"""Continuous run == interrupted-and-resumed run, bit for bit, the resumed half in a
fresh process; the replay check proves it on the recomputed steps; and each piece of
state left out makes the runs differ, with the replay check naming that piece.

Trainers are slow to start (torch in each) and the resumed half of a case runs alone,
leaving a core idle: two module fixtures run every case's trainers side by side in
rounds (separate runs or roots: nothing shared but a root's daemon), and the tests
read their traces. ``exact_runs``: the continuous and the interrupted run of every
case, then every resumed half; ``controls``: the runs the controls resume from, then
the seven resumes, each from its own copy of the root.

Each trainer is a child forked by a warm parent that has imported torch once
(warm.py, the ``warm`` fixture), not a process paying that import itself. The runs a
resume is compared with come from one parent, the resumes from another, so the two
sides of every comparison differ in hash seed, as separate interpreters do."""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import pytest

from helpers import stop_daemons_under

TRAINER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "trainer.py")
STEPS, CUT, DIED = 12, 5, 9   # snapshot at CUT, the first process dies after DIED


# What a trainer a test starts inherits there: tests/conftest.py lifts the unit lane's
# SNAPD_DAEMON=0 for integration tests, but only once the module fixtures have run.
DAEMON_ENV = {k: v for k, v in os.environ.items() if k != "SNAPD_DAEMON"}


def start_trainer(parent, tmp_path, name, env=None, **cfg):
    out = tmp_path / f"{name}.json"
    cfg = {"out": str(out), "steps": STEPS, **cfg}
    # Output to a file, not a pipe: the trainer's DataLoader workers, orphaned by its
    # os._exit, hold a pipe open until they notice (up to 5 s each run).
    log = tmp_path / f"{name}.log"
    log.write_text("")
    proc = parent.start(TRAINER, [json.dumps(cfg)], env, str(log))
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


def finish_all(started: dict) -> dict:
    """Wait for every trainer of ``started`` (name -> started); their traces. If one
    fails, those still running are killed."""
    done = {}
    try:
        for name, one in started.items():
            done[name] = finish_trainer(one)
    finally:
        for proc, _out, _log in started.values():
            proc.kill()
            proc.wait()
    return done


# Every pair of (model, loader workers, loader generator) values, in 4 cases of the 8.
CASES = [("momentum", 0, False), ("momentum", 2, True), ("transformer", 0, True),
         ("transformer", 2, False)]
# Through the daemon, in either mode; it still holds step CUT in memory at the resume.
DAEMON_CASES = [("wait", "momentum", 2), ("overlap", "transformer", 0)]


def case_settings() -> dict:
    """case id -> the trainer settings of that case (CASES with a user's default
    options, DAEMON_CASES naming the daemon and the mode)."""
    cases = {f"{m}-{w}-{g}": dict(model=m, workers=w, loader_generator=g)
             for m, w, g in CASES}
    cases.update({f"daemon-{mode}-{m}-{w}": dict(model=m, workers=w, loader_generator=True,
                                                 options={"daemon": True, "mode": mode})
                  for mode, m, w in DAEMON_CASES})
    return cases


@pytest.fixture(scope="module")
def exact_runs(tmp_path_factory, warm):
    """case id -> (whole, first, second): each case's continuous run and interrupted
    run (separate runs of the case's own root), then its resumed half in a fresh
    process. Every case's first two runs side by side, then every resumed half."""
    tmp = tmp_path_factory.mktemp("exact")
    short = tempfile.mkdtemp(prefix="sdre-", dir="/tmp")   # daemon sockets: 107 bytes
    cases = case_settings()
    roots = {case: os.path.join(short if "daemon" in cfg.get("options", {}) else str(tmp),
                                case, "root") for case, cfg in cases.items()}
    try:
        started = {}
        for case, cfg in cases.items():
            # the first round as a test's trainers ran: SNAPD_DAEMON lifted
            started[(case, "whole")] = start_trainer(
                warm["first"], tmp, f"{case}-whole", DAEMON_ENV, root=roots[case],
                run="whole", **cfg)
            started[(case, "first")] = start_trainer(
                warm["first"], tmp, f"{case}-first", DAEMON_ENV, root=roots[case],
                run="cut", stop=DIED, snapshot_at=[CUT], **cfg)
        done = finish_all(started)
        resumed = finish_all({case: start_trainer(warm["resumed"], tmp, f"{case}-second",
                                                  DAEMON_ENV, root=roots[case], run="cut",
                                                  **cfg)
                              for case, cfg in cases.items()})
        yield {case: (done[(case, "whole")], done[(case, "first")], resumed[case])
               for case in cases}
    finally:
        stop_daemons_under(str(tmp))
        stop_daemons_under(short)
        shutil.rmtree(short, ignore_errors=True)


@pytest.mark.parametrize("model,workers,loader_generator", CASES)
def test_resumed_run_equals_continuous_run_bit_for_bit(exact_runs, model, workers,
                                                       loader_generator):
    whole, first, second = exact_runs[f"{model}-{workers}-{loader_generator}"]
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
def controls(tmp_path_factory, warm):
    """control -> its resumed run; and the continuous run to compare with. The
    interrupted run's root (its snapshot at CUT) is copied once per control, and the
    seven resumes run side by side, each from its own copy."""
    tmp = tmp_path_factory.mktemp("controls")
    cfg = dict(model="momentum", workers=0, loader_generator=True)
    root = str(tmp / "root")
    try:
        # this first round inherits the session's SNAPD_DAEMON=0, as it always has
        whole = start_trainer(warm["first"], tmp, "whole", root=root, run="whole", **cfg)
        first = start_trainer(warm["first"], tmp, "first", root=root, run="cut", stop=DIED,
                              snapshot_at=[CUT], **cfg)
        whole, _ = finish_trainer(whole), finish_trainer(first)
        started = {}
        for control, (omit, _cause) in CONTROLS.items():
            shutil.copytree(root, tmp / control / "root",
                            ignore=shutil.ignore_patterns(".snapd.*"))
            # each resume as a test's trainer ran: SNAPD_DAEMON lifted
            started[control] = start_trainer(warm["resumed"], tmp / control, "second",
                                             DAEMON_ENV,
                                             root=str(tmp / control / "root"), run="cut",
                                             omit=list(omit), **cfg)
        yield whole, finish_all(started)
    finally:
        stop_daemons_under(str(tmp))


@pytest.mark.parametrize("control", sorted(CONTROLS))
def test_leaving_out_a_piece_makes_the_runs_differ(controls, control):
    whole, resumed = controls
    _omit, cause = CONTROLS[control]
    second = resumed[control]
    assert second["trace"] != whole["trace"][CUT:] or second["final"] != whole["final"]
    replay = second["replay"]
    assert replay["verdict"] == "diverged" and replay["cause"] == cause, replay
    if cause != "scalar:loss":  # a missing piece shows at the first recomputed step
        assert replay["step"] == CUT + 1, replay
    else:  # missing momentum changes the first update, so the second step's loss
        assert replay["step"] == CUT + 2, replay


@pytest.mark.parametrize("mode,model,workers", DAEMON_CASES)
def test_resumed_run_equals_continuous_run_through_the_daemon(exact_runs, mode, model,
                                                              workers):
    whole, first, second = exact_runs[f"daemon-{mode}-{model}-{workers}"]
    assert_same_run(whole, first, second)
    assert second["restored_from"] == "hot"  # the daemon still held step CUT in memory
