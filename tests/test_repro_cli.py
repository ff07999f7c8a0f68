"""snapd repro refuses what cannot work before running anything, and says why; the
client takes the request only for its own root and run (snapd_client/repro.py). A command that stops before the step: in
tests/integration/test_repro.py (it starts a process)."""

from __future__ import annotations

import json
import os
import sys

import pytest
from click.testing import CliRunner
from helpers import train_to_nan

from snapd.cli import main
from snapd.commands.repro import report_lines, verdict
from snapd.errors import InvalidOption
from snapd_client.repro import requested

RUN = "r"   # the run train_to_nan trains


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("repro-cli"))
    train_to_nan(path)   # logs steps 1..60, an anomaly at 45
    return path


def repro(*args):
    result = CliRunner().invoke(main, ["repro", *args])
    return result.exit_code, result.output


@pytest.mark.parametrize("target, code, said", [
    ("r", 2, "name a step as RUN@STEP (r@37) or RUN@anomaly"),
    ("r@x", 2, "'x' is not a step"),
    ("nope@3", 2, "no run 'nope'"),
    ("r@61", 1, "the run's log holds no record of step 61"),
])
def test_targets_that_cannot_work_are_refused_before_running(root, target, code, said):
    got, out = repro(root, target, "--", sys.executable, "-c", "raise SystemExit(3)")
    assert got == code and said in out, out


def test_an_existing_reproduction_is_not_overwritten(root):
    os.makedirs(os.path.join(root, f"{RUN}.repro-30"))
    code, out = repro(root, f"{RUN}@30", "--", "true")
    assert code == 1 and "a reproduction of step 30 is there already" in out


def test_a_run_without_anomaly_says_so(tmp_path):
    os.makedirs(tmp_path / "q" / "log")
    code, out = repro(str(tmp_path), "q@anomaly", "--", "true")
    assert code == 1 and "run 'q' logged no anomaly" in out


def test_the_client_takes_the_request_for_its_own_root_and_run_only(tmp_path):
    asked = {"SNAPD_REPRO": json.dumps({"root": str(tmp_path), "run": "r", "step": 7,
                                        "out": "r.repro-7", "report": "/x"})}
    got = requested(str(tmp_path), "r", asked)
    assert (got.run, got.step, got.out) == ("r", 7, "r.repro-7")
    assert requested(str(tmp_path), "other", asked) is None
    assert requested(str(tmp_path / "elsewhere"), "r", asked) is None
    assert requested(str(tmp_path), "r", {}) is None
    with pytest.raises(InvalidOption) as e:
        requested(str(tmp_path), "r", {"SNAPD_REPRO": "{"})
    assert e.value.field == "SNAPD_REPRO"


def test_a_client_of_another_world_size_is_refused_and_says_so(root, tmp_path,
                                                                monkeypatch):
    """Run r logged step 7 on one rank: a command at world size 2 is refused on its
    rank, naming the field, before anything is read; its outcome file says why."""
    from snapd_client import Client
    report = tmp_path / "outcome.json"
    monkeypatch.setenv("SNAPD_REPRO", json.dumps({"root": root, "run": RUN, "step": 7,
                                                  "out": "r.repro-7",
                                                  "report": str(report)}))
    with pytest.raises(InvalidOption, match=r"logged step 7 on 1 rank\(s\) \(0\).*"
                       "run the command on 1 rank") as e:
        Client(root, RUN, rank=1, world_size=2)
    assert e.value.field == "world_size"
    with open(f"{report}.rank-1") as f:   # each rank's own outcome file
        outcome = json.load(f)
    assert (outcome["ok"], outcome["type"], outcome["cause"]) == \
        (False, "InvalidOption", "world_size")
    assert not os.path.exists(os.path.join(root, "r.repro-7"))


def test_the_report_of_many_ranks_names_each_ranks_batches():
    outcome = {"ok": True, "run": "r", "step": 19, "last": 19, "repro_run": "r.repro-19",
               "start": {"snapshot": "00000016", "step": 16}, "recomputed": 3,
               "checked": 3, "missing": 0, "snapshot": "/x/00000019", "world_size": 2}
    ranks = [{**outcome, "rank": 0}, {**outcome, "rank": 1, "missing": 1, "checked": 2}]
    merged = verdict(ranks, "r", 19)
    lines = report_lines(merged, 19, [{"batches": [[1, 6]], "samples": [3, 9]},
                                      {"batches": [[1, 6]], "samples": None}], None)
    assert lines == [
        "repro of r@19 on 2 ranks",
        "  started from: snapshot 00000016 (step 16)",
        "  recomputed: 3 steps on each of 2 ranks, 5 checked against each rank's own "
        "log, all matched (1 without a valid record to check)",
        "  step 19 consumed:",
        "    rank 0: epoch 1 batch 6; samples [3, 9]",
        "    rank 1: epoch 1 batch 6",
        "  state after step 19: run r.repro-19, /x/00000019"]


@pytest.mark.parametrize("outcomes, said", [
    ([{"ok": True, "rank": 0, "world_size": 2}], "only rank(s) 0 reported"),
    ([{"ok": True, "rank": 0, "world_size": 2},
      {"ok": False, "type": "ReplayDivergence", "error": "repro of run r, rank 1: step 18 "
       "differs"}], "ReplayDivergence: repro of run r, rank 1: step 18 differs"),
])
def test_a_rank_that_failed_or_never_reported_fails_the_reproduction(outcomes, said,
                                                                     capsys):
    with pytest.raises(SystemExit) as e:
        verdict(outcomes, "r", 19)
    assert e.value.code == 1 and said in capsys.readouterr().err
