"""The automatic cadence (snapd_client/cadence.py), simulated: an injected clock and
injected costs stand for the training steps, the snapshot stalls and the writer, so
no test sleeps. The formulas are written out again here, from the papers' form, and
the cadence is checked against them."""

from __future__ import annotations

import math

import pytest

from snapd.errors import InvalidOption
from snapd_client.cadence import (DEFAULT_MTBF_S, FIRST_WAIT_S, Cadence, Decision,
                                  daly_interval, mtbf_from_history)


class Clock:
    """A monotonic clock that moves only when the simulation says so."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def train(cadence, clock, steps, *, step_s, stall_s, durable_s=0.0, start=0):
    """Steps ``start`` .. ``start + steps - 1`` as the client runs them: snapshot(step)
    asks the cadence, a taken snapshot stalls ``stall_s`` and is durable
    ``durable_s`` later, then the next step trains ``step_s``. Returns the steps taken
    and every decision."""
    taken, decisions = [], []
    for step in range(start, start + steps):
        decision = cadence.decide(step)
        decisions.append(decision)
        if decision.take:
            clock.now += stall_s
            cadence.taken(step, stall_s)
            cadence.durable(step, durable_s)
            taken.append(step)
        clock.now += step_s
    return taken, decisions


def young(delta, m):
    return math.sqrt(2 * delta * m)


def daly(delta, m):
    """Daly (2006), eq. 37: sqrt(2 delta M) [1 + 1/3 (delta/2M)^1/2 + 1/9 (delta/2M)]
    - delta, for delta < 2M; M beyond."""
    if delta >= 2 * m:
        return m
    x = delta / (2 * m)
    y = young(delta, m)
    return y + y * x ** 0.5 / 3 + y * x / 9 - delta


# --- the formula ------------------------------------------------------------------

TABLE = [  # (delta: stall s, M: mtbf s, step time s)
    (1.0, 86400.0, 0.5),
    (0.2, 600.0, 0.05),
    (10.0, 3600.0, 2.0),
    (30.0, 7200.0, 1.0),
    (120.0, 1000.0, 3.0),
    (0.01, 86400.0, 0.25),
]


@pytest.mark.parametrize("delta,m,step_s", TABLE)
def test_the_interval_is_dalys_and_its_steps_follow_the_step_time(delta, m, step_s):
    clock = Clock()
    cadence = Cadence(overhead=0.99, mtbf=m, clock=clock)
    _, decisions = train(cadence, clock, 4, step_s=step_s, stall_s=delta)
    last = decisions[-1]
    expected = daly(delta, m)
    assert last.bound == "young-daly"
    assert last.interval_s == pytest.approx(expected, rel=1e-12)
    assert last.interval_steps == max(1, round(expected / step_s))
    assert last.expected_loss_s == pytest.approx(expected / 2)
    assert (last.mtbf_s, last.mtbf_from) == (m, "option")
    # Daly's corrections are of the order delta against Young's sqrt(2 delta M).
    assert abs(expected - young(delta, m)) <= delta


def test_with_a_stall_of_two_mtbf_or_more_the_interval_is_the_mtbf():
    assert daly_interval(2000.0, 1000.0) == 1000.0
    assert daly_interval(5000.0, 1000.0) == 1000.0
    assert daly_interval(1999.0, 1000.0) == pytest.approx(daly(1999.0, 1000.0))


def test_the_step_time_leaves_out_the_snapshot_stall():
    clock = Clock()
    cadence = Cadence(clock=clock)
    assert cadence.step_s is None and cadence.stall_s is None
    train(cadence, clock, 5, step_s=0.5, stall_s=3.0)
    assert cadence.step_s == pytest.approx(0.5)
    assert cadence.stall_s == 3.0


def test_calls_that_skip_steps_measure_the_time_per_step():
    clock = Clock()
    cadence = Cadence(clock=clock)
    for step in (0, 10, 20, 30):
        cadence.decide(step)
        clock.now += 4.0   # ten steps of 0.4 s between calls
    assert cadence.step_s == pytest.approx(0.4)


# --- the first call ---------------------------------------------------------------

def test_the_first_call_takes_a_snapshot_before_any_cost_is_known():
    clock = Clock()
    cadence = Cadence(clock=clock)
    first = cadence.decide(0)
    assert first == Decision(take=True, interval_s=0.0, interval_steps=1, bound="first",
                             expected_loss_s=0.0, mtbf_s=DEFAULT_MTBF_S,
                             mtbf_from="default", delta_s=None)
    # Not taken after all (the daemon refused it): the next call tries again.
    clock.now += 1.0
    assert cadence.decide(1).take and cadence.decide(1).bound == "first"
    cadence.taken(1, 0.5)
    clock.now += 1.0
    after = cadence.decide(2)
    assert after.bound != "first" and not after.take


def test_a_restarted_run_takes_at_its_first_call_too():
    clock = Clock()
    taken, _ = train(Cadence(clock=clock), clock, 4, step_s=1.0, stall_s=1.0, start=5000)
    assert taken == [5000, 5002]   # the first, then the probe


# --- the bounds -------------------------------------------------------------------

def test_the_overhead_budget_takes_over_when_dalys_interval_stalls_too_much():
    clock = Clock()
    cadence = Cadence(overhead=0.005, mtbf=86400.0, clock=clock)
    taken, decisions = train(cadence, clock, 6001, step_s=1.0, stall_s=10.0)
    assert daly(10.0, 86400.0) < 10.0 / 0.005
    # The first, the probe, then the probe's 10 s paid back (2000 s of training less
    # the 2 s run before it), then one every 2000 s.
    assert taken == [0, 2, 4000, 6000]
    assert (decisions[3].bound, decisions[3].interval_s) == ("overhead", 3998.0)
    assert (decisions[-1].bound, decisions[-1].interval_s) == ("overhead", 2000.0)
    assert decisions[-1].interval_steps == 2000
    # A budget the formula already meets leaves the formula in charge.
    clock = Clock()
    _, decisions = train(Cadence(overhead=0.02, mtbf=86400.0, clock=clock), clock, 4,
                         step_s=1.0, stall_s=10.0)
    assert decisions[-1].bound == "young-daly"


def test_never_faster_than_snapshots_become_durable():
    clock = Clock()
    cadence = Cadence(mtbf=86400.0, clock=clock)
    _, decisions = train(cadence, clock, 4, step_s=1.0, stall_s=1.0, durable_s=5000.0)
    last = decisions[-1]
    assert 1.0 / 0.01 < daly(1.0, 86400.0) < 5000.0   # overhead < formula < writer
    assert (last.bound, last.interval_s) == ("writer", 5000.0)
    assert last.expected_loss_s == 5000.0 / 2 + 5000.0


def test_max_loss_caps_the_interval_less_the_time_to_durable():
    clock = Clock()
    cadence = Cadence(max_loss=300.0, mtbf=86400.0, clock=clock)
    _, decisions = train(cadence, clock, 4, step_s=1.0, stall_s=1.0, durable_s=50.0)
    last = decisions[-1]
    assert daly(1.0, 86400.0) > 249.0 > 100.0    # formula > max_loss - D - delta > overhead
    assert (last.bound, last.interval_s, last.interval_steps) == ("max_loss", 249.0, 249)
    # A failure just before the next snapshot is durable loses tau + its stall + D
    # = max_loss.
    assert last.interval_s + 1.0 + 50.0 == 300.0
    assert last.expected_loss_s == 124.5 + 50.0
    assert cadence.warning() is None


def test_an_unreachable_max_loss_yields_to_the_overhead_budget_with_one_warning():
    clock = Clock()
    cadence = Cadence(max_loss=600.0, mtbf=86400.0, clock=clock)
    _, decisions = train(cadence, clock, 4, step_s=1.0, stall_s=10.0, durable_s=20.0)
    # Right after the probe the budget is still owed its cost; the warning names the
    # steady figure, the one an option can change.
    assert (decisions[-1].bound, decisions[-1].interval_s) == ("overhead", 1000.0 + 998.0)
    assert cadence.warning() == (
        "max_loss=600 s cannot be met: the overhead bound needs at least 1000.0 s "
        "between snapshots, but max_loss allows at most 570.0 s (max_loss less the "
        "20.0 s a snapshot takes to become durable and its stall), so snapshots are "
        "taken every "
        "1000.0 s; raise max_loss or overhead.")
    train(cadence, clock, 3, step_s=1.0, stall_s=10.0, durable_s=20.0, start=4)
    assert cadence.warning() is None


def test_an_unreachable_max_loss_yields_to_the_writer_with_one_warning():
    clock = Clock()
    cadence = Cadence(max_loss=600.0, mtbf=86400.0, clock=clock)
    _, decisions = train(cadence, clock, 4, step_s=1.0, stall_s=1.0, durable_s=900.0)
    assert (decisions[-1].bound, decisions[-1].interval_s) == ("writer", 900.0)
    assert cadence.warning() == (
        "max_loss=600 s cannot be met: the writer bound needs at least 900.0 s "
        "between snapshots, but max_loss allows at most -301.0 s (max_loss less the "
        "900.0 s a snapshot takes to become durable and its stall), so snapshots are "
        "taken every 900.0 s; raise max_loss, or make snapshots durable sooner (a faster disk, "
        "compression off).")
    assert cadence.warning() is None


def test_interval_steps_is_at_least_one_and_then_every_step_is_taken():
    clock = Clock()
    cadence = Cadence(overhead=0.99, mtbf=60.0, clock=clock)
    taken, decisions = train(cadence, clock, 6, step_s=100.0, stall_s=0.001)
    assert decisions[-1].interval_s < 100.0 / 2
    assert decisions[-1].interval_steps == 1
    assert taken == [0, 1, 2, 3, 4, 5]


def test_a_clock_that_does_not_move_keeps_the_interval_at_one_step():
    clock = Clock()
    cadence = Cadence(clock=clock)
    _, decisions = train(cadence, clock, 4, step_s=0.0, stall_s=0.0)
    assert [d.interval_steps for d in decisions] == [1, 1, 1, 1]


# --- M ----------------------------------------------------------------------------

def test_m_is_the_mean_gap_between_the_runs_interruptions():
    assert mtbf_from_history([5000.0, 1000.0, 3400.0]) == 2000.0
    assert mtbf_from_history([1000.0, 1000.0]) is None       # no gap: nothing learned
    assert mtbf_from_history([1000.0]) is None
    assert mtbf_from_history([]) is None
    cadence = Cadence(mtbf=99.0, history=[1.7e9, 1.7e9 + 7200.0, 1.7e9 + 3600.0])
    assert (cadence.mtbf_s, cadence.mtbf_from) == (3600.0, "history")


@pytest.mark.parametrize("history,mtbf,expected", [
    ((), 7200.0, (7200.0, "option")),
    ((1.7e9,), 7200.0, (7200.0, "option")),           # one interruption is no rate
    ((1.7e9, 1.7e9), 7200.0, (7200.0, "option")),
    ((), None, (DEFAULT_MTBF_S, "default")),
    ((1.7e9,), None, (24 * 3600.0, "default")),
])
def test_m_falls_back_to_the_option_then_to_a_day(history, mtbf, expected):
    clock = Clock()
    cadence = Cadence(mtbf=mtbf, history=history, clock=clock)
    _, decisions = train(cadence, clock, 2, step_s=1.0, stall_s=1.0)
    assert (decisions[-1].mtbf_s, decisions[-1].mtbf_from) == expected
    assert decisions[-1].interval_s == pytest.approx(daly(1.0, expected[0]))


# --- re-estimation ----------------------------------------------------------------

def test_a_slower_step_shortens_the_interval_in_steps_not_in_seconds():
    clock = Clock()
    cadence = Cadence(mtbf=86400.0, clock=clock)
    _, fast = train(cadence, clock, 40, step_s=0.5, stall_s=1.0)
    _, slow = train(cadence, clock, 40, step_s=2.0, stall_s=1.0, start=40)
    seconds = daly(1.0, 86400.0)
    assert fast[-1].interval_s == slow[-1].interval_s == pytest.approx(seconds)
    assert fast[-1].interval_steps == round(seconds / 0.5)
    assert slow[-1].interval_steps == round(seconds / 2.0)


def test_a_growing_stall_lengthens_the_interval_and_spaces_the_snapshots():
    clock = Clock()
    cadence = Cadence(mtbf=3600.0, overhead=0.5, clock=clock)
    taken_small, small = train(cadence, clock, 400, step_s=1.0, stall_s=1.0)
    taken_big, big = train(cadence, clock, 2000, step_s=1.0, stall_s=9.0, start=400)
    assert small[-1].interval_s == pytest.approx(daly(1.0, 3600.0))
    # Three stalls of 9 s out of the last five make the median 9 s.
    assert big[-1].interval_s == pytest.approx(daly(9.0, 3600.0))
    assert big[-1].interval_s > 2.5 * small[-1].interval_s   # about sqrt(9) times
    late_gaps = {b - a for a, b in zip(taken_big[3:], taken_big[4:])}
    assert late_gaps == {big[-1].interval_steps}
    assert {b - a for a, b in zip(taken_small[1:], taken_small[2:])} == {
        small[-1].interval_steps}


def test_one_slow_step_or_one_slow_snapshot_does_not_move_the_interval():
    clock = Clock()
    cadence = Cadence(mtbf=3600.0, overhead=0.5, clock=clock)
    _, before = train(cadence, clock, 300, step_s=1.0, stall_s=1.0)
    clock.now += 60.0   # an evaluation pause between two steps
    taken, after = train(cadence, clock, 84, step_s=1.0, stall_s=9.0, start=300)
    assert len(taken) == 1   # one snapshot stalled 9 s, the four before it 1 s
    assert after[0].interval_steps == before[-1].interval_steps == 84
    assert after[-1].interval_s == pytest.approx(daly(1.0, 3600.0))


def test_an_older_snapshots_durability_arriving_late_does_not_count():
    clock = Clock()
    cadence = Cadence(mtbf=86400.0, clock=clock)
    train(cadence, clock, 4, step_s=1.0, stall_s=1.0)   # the first and the probe
    cadence.durable(10, 3000.0)
    cadence.durable(4, 7000.0)
    clock.now += 1.0
    assert (cadence.decide(4).bound, cadence.decide(4).interval_s) == ("writer", 3000.0)


# --- what a snapshot costs: the probe, the slowdown while it is written ------------

def train_writing(cadence, clock, steps, *, step_s, stalls, durable_s, slow=1.0,
                  start=0):
    """As :func:`train`, with a writer: a taken snapshot stalls ``stalls(n)`` (n: the
    how-manieth taken) and is durable ``durable_s`` after its stall; every step that
    runs while one is in flight takes ``slow`` times ``step_s`` (the daemon shares the
    machine). Returns the steps taken, every decision, the slowdown each snapshot
    caused (seconds beyond its steps at ``step_s``)."""
    taken, decisions, in_flight, slowdown = [], [], [], {}
    for step in range(start, start + steps):
        decision = cadence.decide(step)
        decisions.append(decision)
        if decision.take:
            stall = stalls(len(taken))
            clock.now += stall
            cadence.taken(step, stall)
            in_flight.append((step, clock.now - stall, clock.now + durable_s))
            taken.append(step)
        if in_flight:
            slowdown[in_flight[0][0]] = (slowdown.get(in_flight[0][0], 0.0)
                                         + step_s * (slow - 1))
        clock.now += step_s * (slow if in_flight else 1.0)
        while in_flight and clock.now >= in_flight[0][2] - 1e-9:
            done, called_at, _ = in_flight.pop(0)
            cadence.durable(done, clock.now - called_at)
    return taken, decisions, slowdown


def test_a_probe_right_after_the_first_is_durable_measures_a_steady_stall():
    # The first snapshot of a process pays its set-up: 5 s against 0.05 s later. At a
    # 1 % budget that first stall alone would ask for 500 s between snapshots.
    clock = Clock()
    cadence = Cadence(overhead=0.01, mtbf=600.0, clock=clock)
    taken, decisions, _ = train_writing(
        cadence, clock, 400, step_s=0.05, stalls=lambda n: 5.0 if n == 0 else 0.05,
        durable_s=0.5)
    # Durable 0.5 s after its stall, during steps 0-9; step 10 runs undisturbed; the
    # call after it takes the probe.
    probe = taken[1]
    assert probe == 11 and decisions[probe].bound == "probe"
    assert decisions[probe].delta_s == 5.0     # what it knew when it took it
    assert [d.bound for d in decisions[1:probe]] == ["overhead"] * (probe - 1)
    assert decisions[1].interval_s == 5.0 / 0.01
    # From then on the steady stall is delta. The probe itself is paid back first:
    # the budget's 5 s for the next one plus 5 s for the probe, less the 0.55 s of
    # training before it (steps 0-10).
    after = decisions[probe + 1]
    assert after.delta_s == 0.05
    assert (after.bound, after.interval_s) == ("overhead", pytest.approx(10.0 - 0.55))
    assert taken[2] - taken[1] == after.interval_steps == 189
    # Then Daly's interval for 0.05 s, about sqrt(2 * 0.05 * 600) = 7.7 s (above the
    # budget's 5 s), 154 steps.
    steady = decisions[taken[2] + 1]
    assert (steady.bound, steady.interval_s, steady.interval_steps) == (
        "young-daly", pytest.approx(daly(0.05, 600.0)), round(daly(0.05, 600.0) / 0.05))
    assert taken[3] - taken[2] == steady.interval_steps


def test_the_probe_waits_until_the_staging_memory_is_faulted_in_whole():
    # The arena's later slots fault in in the background: a probe copied into them
    # would measure that set-up, not a steady snapshot. Until the client says it is
    # settled, the probe waits; the first's cost still stands for delta meanwhile.
    clock = Clock()
    cadence = Cadence(overhead=0.01, mtbf=600.0, clock=clock)
    assert cadence.decide(0).take
    clock.now += 5.0
    cadence.taken(0, 5.0)
    cadence.durable(0, 0.5)
    decisions = []
    for step in range(1, 6):
        clock.now += 0.05
        decisions.append(cadence.decide(step, settled=step >= 4))
        if decisions[-1].take:
            cadence.taken(step, 0.05)
    assert [d.take for d in decisions] == [False, False, False, True, False]
    assert [d.bound for d in decisions[:3]] == ["overhead"] * 3
    assert decisions[3].bound == "probe"


def first_waiting(cadence, clock, steps, *, ready_at, step_s, stall_s, durable_steps):
    """Steps 0 .. ``steps`` - 1 with the staging memory ready from step ``ready_at``:
    a taken snapshot stalls ``stall_s`` and is durable ``durable_steps`` steps later,
    every step trains ``step_s``. Returns the steps taken and every decision."""
    taken, decisions, due = [], [], {}
    for step in range(steps):
        decision = cadence.decide(step, settled=step >= ready_at)
        decisions.append(decision)
        if decision.take:
            clock.now += stall_s
            cadence.taken(step, stall_s)
            due[step + durable_steps] = step
            taken.append(step)
        clock.now += step_s
        if step in due:
            cadence.durable(due.pop(step), durable_steps * step_s)
    return taken, decisions


def test_the_first_waits_for_ready_staging_memory_and_then_needs_no_probe():
    # Its pages faulting in, the first would measure set-up; it waits for them, and
    # so costs what any later one does: delta from it at once, no probe, and the
    # next one a whole budget's interval later (the first is left out of the ledger).
    clock = Clock()
    cadence = Cadence(overhead=0.01, mtbf=600.0, clock=clock, first_waits=True)
    taken, decisions = first_waiting(cadence, clock, 600, ready_at=30, step_s=0.05,
                                     stall_s=0.05, durable_steps=10)
    assert [d.take for d in decisions[:31]] == [False] * 30 + [True]
    assert {d.bound for d in decisions[:31]} == {"first"}
    assert "probe" not in {d.bound for d in decisions}
    # Durable at step 40; from step 41 on delta is its stall, and the interval
    # Daly's for it, about 7.7 s (the 1 % budget asks only 5 s).
    later = decisions[41]
    assert later.delta_s == 0.05
    assert (later.bound, later.interval_s) == ("young-daly",
                                               pytest.approx(daly(0.05, 600.0)))
    assert taken[1] - taken[0] == later.interval_steps == round(daly(0.05, 600.0) / 0.05)
    # A tighter budget binds with no debt carried from the first: 0.05 s / 0.001.
    clock = Clock()
    cadence = Cadence(overhead=0.001, mtbf=600.0, clock=clock, first_waits=True)
    taken, decisions = first_waiting(cadence, clock, 2500, ready_at=3, step_s=0.05,
                                     stall_s=0.05, durable_steps=10)
    assert taken[:2] == [3, 3 + 1000]
    assert decisions[taken[1]].bound == "overhead"


def test_a_first_that_waited_its_limit_is_taken_and_then_probed():
    # Staging memory slow to say ready: the first waits FIRST_WAIT_S of training at
    # most, then pays its set-up, and a probe measures a steady cost once it is
    # durable and the memory is ready.
    clock = Clock()
    cadence = Cadence(overhead=0.01, mtbf=600.0, clock=clock, first_waits=True)
    step_s = 1.0
    limit = math.ceil(FIRST_WAIT_S / step_s)
    taken, decisions = first_waiting(cadence, clock, limit + 20, ready_at=limit + 5,
                                     step_s=step_s, stall_s=0.05, durable_steps=2)
    assert taken[:2] == [limit, limit + 5]
    assert decisions[limit].bound == "first"
    assert decisions[limit + 5].bound == "probe"


def test_without_first_waits_the_first_is_taken_at_once_as_before():
    clock = Clock()
    cadence = Cadence(overhead=0.01, mtbf=600.0, clock=clock)
    taken, decisions = first_waiting(cadence, clock, 40, ready_at=30, step_s=0.05,
                                     stall_s=0.05, durable_steps=10)
    # The first at once, set-up and all; the probe when the memory is ready.
    assert taken[:2] == [0, 30]
    assert decisions[30].bound == "probe"


def test_the_slowdown_while_a_snapshot_is_written_counts_as_its_cost():
    # Steps take 1.5x while the daemon writes (10 of them, 0.25 s beyond 0.5 s): the
    # snapshot costs its 0.05 s stall plus that 0.25 s, and the budget is set by 0.3 s.
    clock = Clock()
    cadence = Cadence(overhead=0.01, mtbf=600.0, clock=clock)
    taken, decisions, slowdown = train_writing(
        cadence, clock, 2000, step_s=0.05, stalls=lambda n: 5.0 if n == 0 else 0.05,
        durable_s=0.5, slow=1.5)
    steady = [slowdown[t] for t in taken[1:-1]]
    assert steady and all(s == pytest.approx(steady[0]) for s in steady)
    last = decisions[-1]
    assert last.delta_s == pytest.approx(0.05 + steady[0])
    assert (last.bound, last.interval_s) == ("overhead", pytest.approx(last.delta_s / 0.01))
    # The snapshots taken cost at most the budget of the training between them.
    gaps = [b - a for a, b in zip(taken[2:], taken[3:])]
    assert gaps and all(last.delta_s / (g * 0.05) <= 0.01 + 1e-9 for g in gaps)


@pytest.mark.parametrize("overhead, step_s, stall, slow", [
    (0.01, 0.05, 0.1, 1.5),      # a budget that binds from the probe on
    (0.05, 0.05, 0.05, 1.2),
    (0.01, 0.5, 2.0, 1.0),
    (0.002, 0.02, 0.01, 2.0),
])
def test_over_the_whole_run_snapshots_cost_no_more_than_the_budget(overhead, step_s,
                                                                   stall, slow):
    # The budget is a ledger over the process, not a rate per interval: the probe (one
    # snapshot more) is paid back, so that when each snapshot after the probe is
    # taken, what every snapshot since the first cost (stall and slowdown, its own
    # included) is within the budget of the training run so far, to a step's rounding.
    # A rate per interval alone would stay one snapshot's cost over it for good.
    clock = Clock()
    cadence = Cadence(overhead=overhead, mtbf=10.0, clock=clock)   # Daly's: shorter
    taken, decisions, slowdown = train_writing(
        cadence, clock, 20000, step_s=step_s,
        stalls=lambda n: 50 * stall if n == 0 else stall, durable_s=0.3, slow=slow)
    assert len(taken) >= 4 and decisions[taken[1]].bound == "probe"
    assert decisions[-1].bound == "overhead"
    cost = {t: stall + slowdown.get(t, 0.0) for t in taken[1:]}
    for k, t in enumerate(taken[2:], start=2):
        spent = sum(cost[u] for u in taken[1:k + 1])
        trained = t * step_s + sum(slowdown.get(u, 0.0) for u in taken[:k])
        assert spent <= overhead * (trained + step_s * slow) + 1e-9, (k, t)


def test_what_the_budget_is_owed_gives_way_to_max_loss_and_its_rate_does_not():
    # Right after the probe the budget asks 1000 s (above Daly's 632 s) + what the
    # probe is owed; max_loss allows 1200 s: it wins, and no warning (the steady
    # 1000 s fits under it).
    clock = Clock()
    cadence = Cadence(overhead=0.01, max_loss=1250.0, mtbf=20000.0, clock=clock)
    _, decisions = train(cadence, clock, 4, step_s=1.0, stall_s=10.0, durable_s=40.0)
    assert cadence.owed_s == pytest.approx(998.0)
    assert (decisions[-1].bound, decisions[-1].interval_s) == ("max_loss", 1200.0)
    assert cadence.warning() is None


def test_a_snapshot_that_never_becomes_durable_stops_counting_as_written():
    # The probe fails (never durable); the next one is: the failed one no longer
    # counts as in flight, and delta is the one that completed.
    clock = Clock()
    cadence = Cadence(overhead=0.5, mtbf=600.0, clock=clock)
    cadence.decide(0)
    cadence.taken(0, 2.0)
    clock.now += 1.0
    cadence.durable(0, 1.0)
    for step in (1, 2):
        cadence.decide(step)
        clock.now += 1.0
    assert cadence.decide(3).bound == "probe"
    clock.now += 0.1
    cadence.taken(3, 0.1)          # never reports durable
    clock.now += 1.0
    cadence.decide(4)
    clock.now += 0.2
    cadence.taken(4, 0.2)
    clock.now += 1.0               # a step as fast as an undisturbed one
    cadence.durable(4, 1.2)
    decision = cadence.decide(5)
    assert decision.delta_s == pytest.approx(0.2)   # the durable one's stall only
    assert cadence.stall_s == pytest.approx(0.2)


# --- many ranks -------------------------------------------------------------------

def test_every_rank_follows_rank_zeros_interval_and_still_reports_its_own():
    clocks = [Clock(), Clock()]
    ranks = [Cadence(overhead=0.99, mtbf=600.0, clock=clock) for clock in clocks]
    step_times = (0.5, 2.0)   # rank 1 measures a slower step
    taken = [[], []]
    for step in range(600):
        decisions = [cadence.decide(step) for cadence in ranks]
        assert decisions[0].take == decisions[1].take
        if decisions[0].take:
            for rank, cadence in enumerate(ranks):
                clocks[rank].now += 1.0
                cadence.taken(step, 1.0)
                taken[rank].append(step)
            for cadence in ranks:   # what the client's broadcast from rank 0 applies
                cadence.set_interval_steps(decisions[0].interval_steps)
        for rank, clock in enumerate(clocks):
            clock.now += step_times[rank]
    assert taken[0] == taken[1] and len(taken[0]) > 2
    # The first snapshot's interval is one step: the second call takes one too.
    assert taken[0][:2] == [0, 1] and taken[0][2] > 2
    own = round(daly(1.0, 600.0) / 2.0)
    assert decisions[1].interval_steps == own != decisions[0].interval_steps


def test_an_applied_interval_must_be_a_whole_number_of_steps():
    cadence = Cadence()
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="at least one step"):
            cadence.set_interval_steps(bad)


# --- options ----------------------------------------------------------------------

@pytest.mark.parametrize("name,value", [
    ("overhead", 0), ("overhead", 1), ("overhead", 1.5), ("overhead", -0.01),
    ("overhead", None), ("overhead", "1%"), ("max_loss", 0), ("max_loss", -60.0),
    ("max_loss", math.inf),
    ("mtbf", 0.0), ("mtbf", True), ("mtbf", math.nan),
])
def test_a_value_the_cadence_cannot_use_is_refused_naming_the_option(name, value):
    with pytest.raises(InvalidOption) as caught:
        Cadence(**{name: value})
    assert caught.value.field == name
    assert str(caught.value).startswith(f"{name}={value!r}: use ")
    assert f"SNAPD_{name.upper()}" in str(caught.value)
