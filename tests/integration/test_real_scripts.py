"""Three training scripts in the style of real ones (karpathy/nanoGPT, pytorch/examples'
word_language_model, karpathy/minGPT's adder), each with snapd added in at most six
lines: SIGKILLed mid-epoch and restarted, each ends bit for bit on the uninterrupted
run; and a script that forgets one loop value is caught by the replay check, which
names untracked state.

The scripts live in tests/scripts_real/; the lines snapd added end in ``# snapd``.
Each prints its losses on stdout and, at the end, a digest of its weights: two runs
are the same run iff the lines they both print are equal.

The module's eleven runs go in two rounds, each side by side (a root per script, the
runs of one root share only its daemon): every uninterrupted run and every run killed
mid-epoch, then every restart. The tests read the runs they name (``runs``). Each
run is a child forked by a warm parent that imported torch once (warm.py, the
``warm`` fixture): the restarts by another parent than the runs they are compared
with, so that the two differ in hash seed, as separate interpreters do.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile

import pytest

from helpers import stop_daemons_under

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts_real")
# script: (the step it is killed after, the snapshot it must resume from)
CASES = {"nanogpt_style.py": (25, 20), "word_lm_style.py": (45, 42),
         "mingpt_adder_style.py": (37, 30)}


def start_script(parent, outputs, name, path, **cfg):
    """``path`` run by a child of ``parent``; its stdout and stderr go to files in
    ``outputs`` named after ``name``."""
    # the real daemon: the module fixture that starts these runs comes before the
    # function-scoped one that lifts the unit lane's SNAPD_DAEMON=0 (tests/conftest.py)
    env = {k: v for k, v in os.environ.items() if k != "SNAPD_DAEMON"}
    out, err = (os.path.join(outputs, f"{name}.{stream}") for stream in ("out", "err"))
    proc = parent.start(path, [json.dumps(cfg)], env, out, err, cwd=os.path.dirname(path))
    return proc, out, err


def finish_script(started):
    proc, out, err = started
    try:
        proc.wait(timeout=240)
    finally:
        proc.kill()
        proc.wait()
    with open(out) as f_out, open(err) as f_err:
        return proc.returncode, f_out.read().splitlines(), f_err.read()


def finish_all(started: dict) -> dict:
    """name -> (returncode, stdout lines, stderr) of every run of ``started``; if one
    fails to finish, those still running are killed."""
    try:
        return {name: finish_script(one) for name, one in started.items()}
    finally:
        for proc, _out, _err in started.values():
            proc.kill()
            proc.wait()


FORGETFUL = "nanogpt_forgets_xy.py"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, warm):
    """(script, run) -> (returncode, stdout lines, stderr): for each script of CASES the
    uninterrupted run ("whole"), the run killed mid-epoch ("first") and its restart
    ("second"); the same two of FORGETFUL, nanogpt_style.py with the prefetched batch
    X, Y left out of track_globals."""
    tmp = tmp_path_factory.mktemp("scripts")
    with open(os.path.join(SCRIPTS, "nanogpt_style.py")) as f:
        text = f.read()
    assert '"X", "Y", ' in text
    forgetful = tmp / FORGETFUL
    forgetful.write_text(text.replace('"X", "Y", ', ""))
    paths = {**{script: os.path.join(SCRIPTS, script) for script in CASES},
             FORGETFUL: str(forgetful)}
    kill_at = {**{script: cut for script, (cut, _) in CASES.items()},
               FORGETFUL: CASES["nanogpt_style.py"][0]}
    base = tempfile.mkdtemp(prefix="sdrs-", dir="/tmp")   # daemon sockets: 107 bytes
    roots = {script: os.path.join(base, str(i)) for i, script in enumerate(paths)}
    outputs = str(tmp / "outputs")
    os.makedirs(outputs)
    compared, restarts = warm["first"], warm["resumed"]
    try:
        first = {(script, "first"): start_script(compared, outputs, f"{i}-first", path,
                                                 root=roots[script], run="cut",
                                                 kill_at=kill_at[script])
                 for i, (script, path) in enumerate(paths.items())}
        first.update({(script, "whole"): start_script(compared, outputs, f"{i}-whole",
                                                      paths[script], root=roots[script],
                                                      run="whole")
                      for i, script in enumerate(CASES)})
        done = finish_all(first)
        done.update(finish_all({(script, "second"): start_script(
            restarts, outputs, f"{i}-second", path, root=roots[script], run="cut")
            for i, (script, path) in enumerate(paths.items())}))
        yield done
    finally:
        stop_daemons_under(base)
        shutil.rmtree(base, ignore_errors=True)


def snapd_lines(path):
    with open(path) as f:
        return [line for line in f if line.rstrip().endswith("# snapd")]


@pytest.mark.parametrize("script", sorted(CASES))
def test_script_adds_at_most_six_lines(script):
    lines = snapd_lines(os.path.join(SCRIPTS, script))
    assert 4 <= len(lines) <= 6, lines  # the import, a client, restore, close at least


@pytest.mark.parametrize("script", sorted(CASES))
def test_killed_mid_epoch_resumes_bit_for_bit(runs, script):
    resumed_at = CASES[script][1]
    rc, whole, err = runs[(script, "whole")]
    assert rc == 0, err[-3000:]
    assert whole[-1].startswith("weights ")
    rc_first, first, err_first = runs[(script, "first")]
    assert rc_first == -signal.SIGKILL, err_first[-3000:]
    rc, second, err = runs[(script, "second")]
    assert rc == 0, err[-3000:]
    assert f"resuming from step {resumed_at}" in err, err[-3000:]
    assert first == whole[:len(first)]
    # the resumed run prints what the whole one printed from the snapshot on: the
    # losses of the recomputed steps too, and the same final weights
    assert second == whole[-len(second):]
    assert len(first) + len(second) > len(whole), "nothing was recomputed"


@pytest.mark.parametrize("script", sorted(CASES))
def test_a_restart_on_the_same_node_reads_the_daemons_hot_copy(runs, script):
    resumed_at = CASES[script][1]
    rc, _, err = runs[(script, "second")]
    assert rc == 0, err[-3000:]
    assert f"snapd: run cut: resuming from step {resumed_at} (hot)" in err, err[-3000:]


def test_a_loop_that_logs_no_step_is_told_nothing_is_checked(runs):
    """minGPT's adder calls no ckpt.log(): the resume line says what it knows."""
    _, _, err = runs[("mingpt_adder_style.py", "second")]
    assert "snapd: run cut: resuming from step 30 (hot); the log holds no step record " \
           "(log() is never called, or the log was lost), so nothing is checked\n" \
           in err, err[-3000:]


def test_a_forgotten_loop_value_is_named_as_untracked_state(runs):
    """The prefetched batch X, Y left out of track_globals: the resumed run's first
    update trains on the wrong batch with the right RNG streams."""
    resumed_at = CASES["nanogpt_style.py"][1]
    rc, _, err = runs[(FORGETFUL, "first")]
    assert rc == -signal.SIGKILL, err[-3000:]
    rc, _, err = runs[(FORGETFUL, "second")]
    assert rc != 0 and "ReplayDivergence" in err, err[-3000:]
    assert f"step {resumed_at + 1} differs" in err, err[-3000:]
    assert "untracked state" in err, err[-3000:]
