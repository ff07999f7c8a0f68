"""Which snapshot() calls take a snapshot (snapd_client/schedule.py): every call, the
multiples of ``every=N``, or the cadence under ``every="auto"``; a call that takes none
returns a done handle at once and copies and logs nothing; the ``cadence`` record;
the warning when max_loss cannot be met; the time between failures learned from the
run's resumes; and many ranks following rank 0's interval. In-process clients
(daemon=False) and injected clocks: nothing sleeps."""

from __future__ import annotations

import os
import threading
import warnings

import pytest
import torch

from helpers import small_model_and_opt, small_train_step
from snapd import statelog
from snapd.errors import DistributedNotReady, InvalidOption
from snapd.options import Options
from snapd.store import RunStore
from snapd_client import CadenceWarning, Client
from snapd_client.handle import SnapshotHandle
from snapd_client.journal import resume_times
from snapd_client.schedule import Schedule

CADENCE_FIELDS = {"kind", "time", "step", "interval_s", "interval_steps", "bound",
                  "expected_loss_s", "mtbf_s", "mtbf_from", "delta_s", "stall_s", "step_s"}


class Clock:
    """Monotonic seconds that move only when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


class Counted:
    """Tracked state that counts how often a snapshot reads it (copies it)."""

    def __init__(self) -> None:
        self.value, self.reads = torch.arange(4.0), 0

    def state_dict(self):
        self.reads += 1
        return {"value": self.value}

    def load_state_dict(self, state) -> None:
        self.value.copy_(state["value"])


def logged(root: str, kind: str) -> list:
    return [r for r in statelog.read_records(os.path.join(root, "r"), 0)
            if r["kind"] == kind]


def auto_client(root: str, clock: Clock, **options) -> Client:
    """An in-process client under every="auto" whose cadence reads ``clock``."""
    client = Client(root, "r", daemon=False, every="auto", **options)
    client._schedule = Schedule(client.options, history=client._resume_times,
                                clock=clock)
    return client


# --- every=None and every=N ----------------------------------------------------------

def test_by_default_every_call_takes_a_snapshot(tmp_path):
    client = Client(str(tmp_path), "r", daemon=False)
    client.track(state=Counted())
    assert [client.snapshot(step).taken for step in (1, 2)] == [True, True]
    assert client.close().committed == (1, 2)


def test_every_n_takes_the_multiples_of_n_and_other_calls_copy_and_log_nothing(tmp_path):
    root = str(tmp_path)
    client = Client(root, "r", daemon=False, every=3)
    state = Counted()
    client.track(state=state)
    state.reads = 0
    handles = {}
    for step in range(1, 8):
        client.log(step, loss=float(step))
        handles[step] = client.snapshot(step, metric=torch.tensor(float(step)))
    assert [s for s, h in handles.items() if h.taken] == [3, 6]
    passed = handles[4]
    assert passed.done() and not passed.failed and not passed.skipped
    assert passed.wait() is None and passed.result is None
    assert repr(passed) == "<SnapshotHandle step=4 not taken>"
    assert state.reads == 2   # read (copied) at steps 3 and 6 only
    assert client.close().committed == (3, 6)
    assert [(r["event"], r["step"]) for r in logged(root, "snapshot")] == [
        ("staged", 3), ("committed", 3), ("staged", 6), ("committed", 6)]
    assert logged(root, "cadence") == []   # only "auto" logs its decisions
    assert [sid.step for sid in RunStore(root, "r").committed()] == [3, 6]


def test_a_call_that_takes_none_still_checks_its_step(tmp_path):
    client = Client(str(tmp_path), "r", daemon=False, every=3)
    with pytest.raises(InvalidOption) as caught:
        client.snapshot(-1)
    assert caught.value.field == "step"
    client.close()


# --- every="auto" ---------------------------------------------------------------------

def test_auto_takes_the_first_call_then_every_interval_and_logs_each_decision(tmp_path):
    root, clock = str(tmp_path), Clock()
    # A failure may cost 1 s; each step takes 0.1 s; the snapshot's own stall (real
    # time, a few ms) counts against max_loss too: a snapshot every 9 steps (rounded
    # down). The overhead budget (half the time) stays below max_loss for any stall
    # < 0.5 s.
    client = auto_client(root, clock, max_loss=1.0, overhead=0.5)
    client.track(state=Counted())
    taken = []
    for step in range(1, 26):
        clock.advance(0.1)
        client.log(step, loss=0.0)
        if client.snapshot(step).taken:
            taken.append(step)
    # The first, the probe one undisturbed step after the first is durable, then
    # every interval.
    assert taken == [1, 3, 12, 21]
    client.close()
    records = logged(root, "cadence")
    assert [r["step"] for r in records] == taken
    assert all(set(r) == CADENCE_FIELDS for r in records)
    first, probe, later = records[0], records[1], records[2]
    assert (first["bound"], first["interval_steps"], first["step_s"]) == ("first", 1, None)
    assert first["delta_s"] is None
    assert (first["mtbf_s"], first["mtbf_from"]) == (24 * 3600, "default")
    assert (probe["bound"], probe["delta_s"]) == ("probe", first["stall_s"])
    # In-process, a snapshot is durable when snapshot() returns: D is 0 on this clock,
    # and no step runs while one is in flight, so delta is the probe's stall.
    assert (later["bound"], later["interval_steps"]) == ("max_loss", 9)
    assert later["delta_s"] == probe["stall_s"]
    assert later["interval_s"] == pytest.approx(1.0 - probe["stall_s"])
    assert later["expected_loss_s"] == pytest.approx(later["interval_s"] / 2)
    assert later["step_s"] == pytest.approx(0.1)
    stalls = {r["step"]: r["stall"] for r in logged(root, "snapshot")
              if r["event"] == "staged"}
    assert {r["step"]: r["stall_s"] for r in records} == stalls
    assert client.cadence.step_s == pytest.approx(0.1)


def test_a_max_loss_below_the_overhead_floor_is_warned_once_at_the_callers_line(tmp_path):
    clock = Clock()
    client = auto_client(str(tmp_path), clock, max_loss=0.001)
    client.track(state=Counted())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(1, 8):
            clock.advance(0.1)
            client.snapshot(step)
    client.close()
    cadence = [w for w in caught if issubclass(w.category, CadenceWarning)]
    assert len(cadence) == 1
    assert cadence[0].filename == __file__
    assert str(cadence[0].message).startswith("max_loss=0.001 s cannot be met: the "
                                              "overhead bound needs at least")
    assert client.cadence.decide(8).bound == "overhead"   # the lower bound won


def train(root: str, steps: int, **options) -> Client:
    """One life of a small run under every="auto": restore, ``steps`` steps, close."""
    model, opt = small_model_and_opt()
    client = Client(root, "r", daemon=False, every="auto", **options)
    client.track(model=model, optimizer=opt)
    start = client.restore()
    for step in range(start + 1, start + steps + 1):
        client.log(step, loss=small_train_step(model, opt, step))
        client.snapshot(step)
    client.close()
    return client


def test_the_time_between_failures_is_learned_from_the_runs_resumes(tmp_path):
    root = str(tmp_path)
    fresh = train(root, 3, mtbf=3600.0)
    assert fresh.journal.resume_times == []
    assert (fresh.cadence.mtbf_s, fresh.cadence.mtbf_from) == (3600.0, "option")
    once = train(root, 3)   # one resume: no time between two failures yet
    assert (once.cadence.mtbf_s, once.cadence.mtbf_from) == (24 * 3600, "default")
    twice = train(root, 3, mtbf=3600.0)   # two: the run's own figure wins
    resumes = [r["time"] for r in logged(root, "resume")]
    assert twice.journal.resume_times == resumes and len(resumes) == 2
    assert logged(root, "resume")[-1]["resumes"] == resumes
    assert twice.cadence.mtbf_from == "history"
    assert twice.cadence.mtbf_s == pytest.approx(resumes[1] - resumes[0])


def test_resume_times_of_older_records_and_of_a_warm_start():
    assert resume_times({"kind": "resume", "mode": "resume", "time": 5.0}) == [5.0]
    assert resume_times({"kind": "resume", "mode": "resume", "time": 9.0,
                         "resumes": [5.0, 9.0]}) == [5.0, 9.0]
    assert resume_times({"kind": "resume", "mode": "warm_start", "time": 5.0}) == []
    assert resume_times(None) == []


# --- many ranks ----------------------------------------------------------------------

class ThreadStore:
    """torch.distributed's key-value store as the schedule uses it, shared by rank
    threads: set never waits; wait blocks until the keys are set or times out."""

    def __init__(self) -> None:
        self.values, self.changed = {}, threading.Condition()
        self.sets = []   # (key, value) in order

    def set(self, key, value):
        with self.changed:
            self.values[key] = str(value).encode()
            self.sets.append((key, value))
            self.changed.notify_all()

    def get(self, key):
        with self.changed:
            return self.values[key]

    def check(self, keys):
        with self.changed:
            return all(k in self.values for k in keys)

    def wait(self, keys, timeout):
        with self.changed:
            if not self.changed.wait_for(lambda: all(k in self.values for k in keys),
                                         timeout.total_seconds()):
                raise RuntimeError(f"Wait timeout for {keys}")


def follow(schedule: Schedule, clock: Clock, step_s: float, steps: int = 40) -> tuple:
    """A rank's loop as snapshot() drives its schedule: ``steps`` steps of ``step_s``;
    the steps it took, and its cadence records in the order the client logs them."""
    taken, records = [], []
    for step in range(1, steps + 1):
        clock.advance(step_s)
        take = schedule.decide(step)
        records += schedule.late_records()
        if take:
            schedule.publish(step)
            records.append(schedule.taken(SnapshotHandle(step), 0.002, clock()))
            taken.append(step)
    records += schedule.close()
    return taken, [r for r in records if r is not None]


def rank_schedules(options, store, world=2, **kw):
    return [Schedule(options, rank=rank, world_size=world, clock=Clock(),
                     store=lambda: store, scope=lambda: "r/s", **kw)
            for rank in range(world)]


def test_every_rank_takes_the_steps_rank_0s_interval_gives_through_the_store():
    options = Options(every="auto", max_loss=1.0, overhead=0.5)
    store = ThreadStore()
    # Rank 1 measures steps half as long: alone it would aim at 19 steps, not 9
    # (max_loss less the 2 ms stall, rounded down).
    speeds = {0: 0.1, 1: 0.05}
    schedules = rank_schedules(options, store)
    out = {}

    def run(rank):
        out[rank] = follow(schedules[rank], schedules[rank].clock, speeds[rank])

    workers = [threading.Thread(target=run, args=(rank,)) for rank in (0, 1)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(30)
    # The first snapshot has no interval measured (1 step): the next call takes one.
    # (At step 2 the one step timed so far is 0.098 s, the stall left out: 10 steps.)
    (taken0, records0), (taken1, records1) = out[0], out[1]
    assert taken0 == taken1 == [1, 2, 12, 21, 30, 39]
    # Only rank 0 writes, once per snapshot; its records carry what it wrote.
    assert [int(v) for _, v in store.sets] == [r["interval_steps"] for r in records0] \
        == [1, 10, 9, 9, 9, 9]
    assert [k for k, _ in store.sets][:2] == ["snapd/cadence/r/s/1", "snapd/cadence/r/s/2"]
    # The follower's records, one per snapshot, carry rank 0's interval, not its own.
    assert [(r["step"], r["interval_steps"]) for r in records1] == \
        [(r["step"], r["interval_steps"]) for r in records0]
    assert {r["bound"] for r in records1[2:]} == {"max_loss"}
    alone = Schedule(options, clock=Clock())
    assert follow(alone, alone.clock, speeds[1])[0] != taken1


def test_rank_0_never_waits_for_another_rank():
    # No collective: rank 0 runs its whole loop while no other rank has started.
    store = ThreadStore()
    rank0, _ = rank_schedules(Options(every="auto", max_loss=1.0, overhead=0.5), store)
    taken, _ = follow(rank0, rank0.clock, 0.1)
    assert taken == [1, 2, 12, 21, 30, 39] and len(store.sets) == 6


def test_a_follower_decides_nothing_before_rank_0s_interval_arrives():
    store = ThreadStore()
    options = Options(every="auto", max_loss=1.0, overhead=0.5)
    rank0, rank1 = rank_schedules(options, store)
    assert rank1.decide(1)
    rank1.publish(1)
    rank1.taken(SnapshotHandle(1), 0.002, rank1.clock())
    assert rank1.late_records() == [] and rank1.close() == []   # nothing read yet
    decided = []
    thread = threading.Thread(target=lambda: decided.append(rank1.decide(2)))
    thread.start()
    thread.join(0.3)
    assert thread.is_alive() and decided == []   # waiting for rank 0's interval of step 1
    assert rank0.decide(1)
    rank0.publish(1)
    thread.join(10)
    assert decided == [True]   # rank 0's interval after the first snapshot: one step
    assert [r["interval_steps"] for r in rank1.late_records()] == [1]
    # Its last snapshot's record is logged at close(), once rank 0's interval is there.
    rank1.publish(2)
    rank1.taken(SnapshotHandle(2), 0.002, rank1.clock())
    assert rank1.close() == []
    assert rank0.decide(2)
    rank0.publish(2)
    assert [(r["step"], r["interval_steps"]) for r in rank1.close()] == \
        [(2, rank0.decision.interval_steps)]


def test_a_follower_whose_interval_never_comes_says_which_step_and_key():
    store = ThreadStore()
    _, rank1 = rank_schedules(Options(every="auto"), store, wait_s=0.2)
    assert rank1.decide(5)
    rank1.publish(5)
    with pytest.raises(DistributedNotReady) as caught:
        rank1.decide(6)
    assert caught.value.field == "every"
    text = str(caught.value)
    assert "snapshot(6) on rank 1" in text and "after the snapshot of step 5" in text
    assert "snapd/cadence/r/s/" in text and "every rank must call snapshot(step)" in text


@pytest.mark.parametrize("rank", [0, 1])
def test_many_ranks_under_auto_need_a_process_group_from_the_first_snapshot(rank):
    schedule = Schedule(Options(every="auto"), rank=rank, world_size=2)
    assert schedule.decide(1)
    with pytest.raises(DistributedNotReady) as caught:
        schedule.publish(1)
    assert caught.value.field == "every"
    assert "call dist.init_process_group first, or give every=N" in str(caught.value)


# --- the options -----------------------------------------------------------------------

def test_the_cadence_options_come_from_the_environment():
    got = Options.resolve(environ={"SNAPD_EVERY": "auto", "SNAPD_MAX_LOSS": "2.5",
                                   "SNAPD_MTBF": "3600", "SNAPD_OVERHEAD": "0.02"})
    assert (got.every, got.max_loss, got.mtbf, got.overhead) == ("auto", 2.5, 3600.0, 0.02)
    assert Options.resolve(environ={"SNAPD_EVERY": "25"}).every == 25


@pytest.mark.parametrize("given, field, text", [
    ({"every": 0}, "every", "every=0: None (each snapshot() call takes one), a positive "
     "step count N (the steps that are multiples of N) or 'auto' (as often as it pays)"),
    ({"every": "often"}, "every", "every='often': None"),
    ({"every": True}, "every", "every=True: None"),
    ({"overhead": 1.0}, "overhead", "overhead=1.0: the share of training time snapshots "
     "may stall it, between 0 and 1 (0.01: one percent)"),
    ({"max_loss": 0}, "max_loss", "max_loss=0: the most seconds of training a failure "
     "may lose, a positive number, or None"),
    ({"mtbf": -5.0}, "mtbf", "mtbf=-5.0: the seconds between failures, a positive "
     "number, or None"),
])
def test_a_cadence_option_out_of_range_is_refused_naming_the_field(given, field, text):
    with pytest.raises(InvalidOption) as caught:
        Options(**given)
    assert caught.value.field == field
    assert str(caught.value).startswith(text)


def test_the_first_waits_for_the_schedules_settled_signal_and_no_probe_follows():
    # The client hands the schedule whether its staging memory is made and faulted in
    # whole; one rank with no max_loss takes its first snapshot once it is (a steady
    # one), and the next only at a measured interval: no probe.
    clock, settled = Clock(), [False]
    schedule = Schedule(Options(every="auto", mtbf=600.0), clock=clock,
                        settled=lambda: settled[0])
    taken = []
    for step in range(0, 60):
        clock.advance(0.05)
        settled[0] = step >= 5
        if schedule.decide(step):
            taken.append((step, schedule.decision.bound))
            clock.advance(0.05)
            schedule.cadence.taken(step, 0.05)
            schedule.cadence.durable(step, 0.1)
    assert taken == [(5, "first")]


@pytest.mark.parametrize("options, world_size", [
    ({"max_loss": 30.0}, 1),   # the wait would be training at risk before any snapshot
    ({}, 2),                   # every rank must take the same first step
])
def test_under_max_loss_or_many_ranks_the_first_does_not_wait(options, world_size):
    clock, settled = Clock(), [False]
    schedule = Schedule(Options(every="auto", mtbf=600.0, **options), clock=clock,
                        settled=lambda: settled[0], world_size=world_size)
    assert schedule.decide(0) and schedule.decision.bound == "first"
    assert not schedule.cadence.first_waits
