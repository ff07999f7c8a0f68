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


def test_a_client_of_many_ranks_refuses_a_reproduction(tmp_path, monkeypatch):
    from snapd_client import Client
    monkeypatch.setenv("SNAPD_REPRO", json.dumps({"root": str(tmp_path), "run": "r",
                                                  "step": 7, "out": "r.repro-7",
                                                  "report": str(tmp_path / "o")}))
    with pytest.raises(InvalidOption, match="many ranks is not supported yet") as e:
        Client(str(tmp_path), "r", rank=1, world_size=2)
    assert e.value.field == "world_size"
    assert not os.path.exists(tmp_path / "r")   # read-only: nothing created
