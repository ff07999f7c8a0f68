"""Three training scripts in the style of real ones (karpathy/nanoGPT, pytorch/examples'
word_language_model, karpathy/minGPT's adder), each with snapd added in at most six
lines: SIGKILLed mid-epoch and restarted, each ends bit for bit on the uninterrupted
run; and a script that forgets one loop value is caught by the replay check, which
names untracked state.

The scripts live in tests/scripts_real/; the lines snapd added end in ``# snapd``.
Each prints its losses on stdout and, at the end, a digest of its weights: two runs
are the same run iff the lines they both print are equal.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts_real")
# script: (the step it is killed after, the snapshot it must resume from)
CASES = {"nanogpt_style.py": (25, 20), "word_lm_style.py": (45, 42),
         "mingpt_adder_style.py": (37, 30)}


def start_script(path, **cfg):
    return subprocess.Popen([sys.executable, path, json.dumps(cfg)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=os.path.dirname(path))


def finish_script(proc):
    try:
        out, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
        proc.wait()
    return proc.returncode, out.splitlines(), err


def run_script(path, **cfg):
    return finish_script(start_script(path, **cfg))


def snapd_lines(path):
    with open(path) as f:
        return [line for line in f if line.rstrip().endswith("# snapd")]


@pytest.mark.parametrize("script", sorted(CASES))
def test_script_adds_at_most_six_lines(script):
    lines = snapd_lines(os.path.join(SCRIPTS, script))
    assert 4 <= len(lines) <= 6, lines  # the import, a client, restore, close at least


@pytest.mark.parametrize("script", sorted(CASES))
def test_killed_mid_epoch_resumes_bit_for_bit(short_root, script):
    path, (kill_at, resumed_at) = os.path.join(SCRIPTS, script), CASES[script]
    # the uninterrupted run and the one killed side by side (two runs of one root)
    whole = start_script(path, root=short_root, run="whole")
    first = start_script(path, root=short_root, run="cut", kill_at=kill_at)
    (rc, whole, err), (rc_first, first, err_first) = finish_script(whole), finish_script(first)
    assert rc == 0, err[-3000:]
    assert whole[-1].startswith("weights ")
    assert rc_first == -signal.SIGKILL, err_first[-3000:]
    rc, second, err = run_script(path, root=short_root, run="cut")
    assert rc == 0, err[-3000:]
    assert f"resuming from step {resumed_at}" in err, err[-3000:]
    assert first == whole[:len(first)]
    # the resumed run prints what the whole one printed from the snapshot on: the
    # losses of the recomputed steps too, and the same final weights
    assert second == whole[-len(second):]
    assert len(first) + len(second) > len(whole), "nothing was recomputed"


def test_a_forgotten_loop_value_is_named_as_untracked_state(short_root, tmp_path):
    """The prefetched batch X, Y left out of track_globals: the resumed run's first
    update trains on the wrong batch with the right RNG streams."""
    with open(os.path.join(SCRIPTS, "nanogpt_style.py")) as f:
        text = f.read()
    assert '"X", "Y", ' in text
    forgetful = tmp_path / "nanogpt_forgets_xy.py"
    forgetful.write_text(text.replace('"X", "Y", ', ""))
    kill_at, resumed_at = CASES["nanogpt_style.py"]
    rc, _, err = run_script(str(forgetful), root=short_root, run="cut", kill_at=kill_at)
    assert rc == -signal.SIGKILL, err[-3000:]
    rc, _, err = run_script(str(forgetful), root=short_root, run="cut")
    assert rc != 0 and "ReplayDivergence" in err, err[-3000:]
    assert f"step {resumed_at + 1} differs" in err, err[-3000:]
    assert "untracked state" in err, err[-3000:]
