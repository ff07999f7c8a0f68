"""Recovery planning reads the log tail and pointers only, in bounded bytes; the replay
comparison names the first differing piece."""

from __future__ import annotations

import pytest

from helpers import LOGGED_RNG, LONG_LOG_STEPS, logged_step
from snapd.logwriter import LogWriter
from snapd.progress import expected_steps, read_progress
from snapd.store import RunStore
from snapd_client.journal import compare

RNG = LOGGED_RNG


def step_record(step, **changes):
    return {**logged_step(step), **changes}


def test_plan_on_a_long_log_reads_a_bounded_number_of_bytes(long_log):
    """The log: steps 1..120,000, a commit every 1000 but the last, three segments of
    5 MiB (tests/helpers.py)."""
    plan = read_progress(long_log, 0)
    assert plan.reached == LONG_LOG_STEPS
    assert plan.committed_step == LONG_LOG_STEPS - 1000
    assert plan.at_risk == 1000
    assert plan.steps_per_s == pytest.approx(100.0)
    assert plan.bytes_read < 1 << 20, plan.bytes_read  # each segment holds 4 MiB or more


def test_expected_steps_prefers_the_newest_record_of_a_replayed_step(tmp_path):
    store = RunStore(str(tmp_path), "r")
    store.ensure()
    with LogWriter(store.path, 0, flush_interval=None) as writer:
        for step in range(1, 11):                      # first run: 1..10
            writer.append(step_record(step, scalars={"loss": 1.0}))
        writer.append({"kind": "resume", "step": 5})
        for step in range(6, 9):                       # resumed run: 6..8, then died
            writer.append(step_record(step, scalars={"loss": 2.0}))
    found = expected_steps(store, 0, after=5, upto=10)
    assert sorted(found) == [6, 7, 8, 9, 10]
    assert [found[s]["scalars"]["loss"] for s in (6, 7, 8, 9, 10)] == [2.0, 2.0, 2.0, 1.0, 1.0]


def test_plan_of_a_run_without_log():
    import tempfile
    store = RunStore(tempfile.mkdtemp(), "new")
    plan = read_progress(store, 0)
    assert plan.reached is None and plan.at_risk is None and plan.latest is None


@pytest.mark.parametrize("change,cause", [
    ({"cursor": [0, 9]}, "cursor"),
    ({"rng": {**RNG, "numpy": 99}}, "rng:numpy"),
    ({"rng": {**RNG, "gen:loader": 99}}, "rng:gen:loader"),
    ({"scalars": {"loss": 0.5000001}}, "scalar:loss"),
])
def test_compare_names_the_first_differing_piece(change, cause):
    old = step_record(7)
    assert compare(old, dict(old)) is None
    assert compare(old, {**old, **change})[0] == cause


def test_cursor_is_named_before_rng_when_both_differ():
    old = step_record(7)
    new = {**old, "cursor": [3, 3], "rng": {**RNG, "torch": 0}}
    assert compare(old, new)[0] == "cursor"
