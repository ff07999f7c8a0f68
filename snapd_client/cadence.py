"""The cadence: how often a snapshot pays for itself, decided again at every step.

A snapshot costs the trainer a stall (delta: the staging copy, or backpressure) each
time it is taken; a failure costs the training done since the last durable snapshot.
Young (1974) and Daly (2006) give the interval between snapshots that minimises the
sum, from delta and the mean time between failures M. Nothing here is configured
ahead: the step time comes from the clock between calls, delta from the stalls the
client reports, the time to durable D from the writer, so a slower disk or a growing
model moves the interval with them. Three bounds keep the formula from hurting: an
overhead budget (never cost more than that fraction of training, kept as a ledger
over the process: :meth:`Cadence._owed`), the writer's pace
(never snapshot faster than snapshots become durable) and ``max_loss`` (never risk
more than that many seconds of training). docs/operations.md "Snapshot cadence"
states every rule, with the formula.

What a snapshot costs is more than its stall: while the daemon writes it, it shares
the machine with the trainer (CPU, memory bandwidth), and the steps taken meanwhile
run slower. Each snapshot's cost, delta, is its stall plus that slowdown: the time the
steps run while it was in flight took beyond the same steps at the step time measured
with nothing in flight. A snapshot copied into staging memory still faulting in (or
into an arena it has to make) pays one-time set-up besides: so the process's first
waits, up to ``FIRST_WAIT_S`` of training, for the client to say its staging memory
is ready (``first_waits``), and then measures a steady cost like any other. A first
taken before that (the wait ran out, or it may not wait: many ranks, ``max_loss``)
stands for delta only until a second one, a probe taken as soon as the first is
durable and the staging memory is ready, is measured.

Pure logic: no I/O, no torch, an injected clock. The client calls :meth:`Cadence.decide`
at every ``snapshot(step)`` and reports back with :meth:`Cadence.taken` and
:meth:`Cadence.durable` (the latter from the thread that learns of durability, hence
the lock).
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Deque, Dict, Iterable, Optional, Sequence, Tuple

from snapd.errors import InvalidOption

__all__ = ["Cadence", "Decision", "DEFAULT_MTBF_S", "daly_interval", "mtbf_from_history"]

DEFAULT_MTBF_S = 24 * 3600.0  # M when neither the run's history nor mtbf= gives one
STEP_WINDOW = 16              # step-time samples whose median is the step time
COST_WINDOW = 5               # durable snapshots whose median cost is delta
FIRST_WAIT_S = 60.0           # training the first snapshot waits for staging memory


@dataclass(frozen=True)
class Decision:
    """What :meth:`Cadence.decide` made of one step.

    ``interval_steps`` is always this rank's own estimate; after
    :meth:`Cadence.set_interval_steps`, ``take`` follows the interval applied there.
    """

    take: bool                 # take a snapshot at this call
    interval_s: float          # seconds of training between snapshots it aims at now
    interval_steps: int        # the same in steps at the measured step time (>= 1)
    bound: str                 # the rule that set it: "first" (no cost measured yet),
                               # "probe" (the first is durable: measure a steady one),
                               # "young-daly", "overhead", "writer", "max_loss"
    expected_loss_s: float     # expected training lost per failure at this interval
    mtbf_s: float              # M used
    mtbf_from: str             # "option", "history", "default"
    delta_s: Optional[float]   # the cost per snapshot weighed (None: none measured yet)


def daly_interval(delta: float, mtbf: float) -> float:
    """Daly's higher-order optimum interval for a stall ``delta`` and an MTBF ``mtbf``.

    Its first term is Young's sqrt(2 delta M); the corrections matter once delta is
    no longer small against M. From delta >= 2M on, the series no longer holds and
    the interval is M itself.
    """
    if delta >= 2 * mtbf:
        return mtbf
    ratio = delta / (2 * mtbf)
    return math.sqrt(2 * delta * mtbf) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - delta


def mtbf_from_history(history: Iterable[float]) -> Optional[float]:
    """M learned from the wall times at which the run was interrupted and resumed: the
    mean gap between the first and the last, None with fewer than two (or no gap).

    Only the time between interruptions counts: a quiet stretch before the first or
    after the last would need the run's start, which the log does not pin, and leaving
    it out errs towards a shorter M, that is, towards snapshotting more often.
    """
    times = sorted(t for t in history if math.isfinite(t))
    if len(times) < 2:
        return None
    gap = (times[-1] - times[0]) / (len(times) - 1)
    return gap if gap > 0 else None


def choose_mtbf(history: Sequence[float], mtbf: Optional[float]) -> Tuple[float, str]:
    """(M, where it came from): the run's own history wins over the option, which wins
    over the default."""
    learned = mtbf_from_history(history)
    if learned is not None:
        return learned, "history"
    if mtbf is not None:
        return float(mtbf), "option"
    return DEFAULT_MTBF_S, "default"


@dataclass(frozen=True)
class Unreachable:
    """max_loss below a lower bound: the lower bound (``name``, ``floor``) won."""

    name: str        # "overhead" or "writer"
    floor: float     # the interval the lower bound needs, seconds
    ceiling: float   # the interval max_loss allows, seconds (max_loss - D - delta)


def bounded_interval(delta: float, durable: float, mtbf: float, overhead: float,
                     max_loss: Optional[float], owed: float = 0.0
                     ) -> Tuple[float, str, Optional[Unreachable]]:
    """(tau, the rule that set it, the conflict when max_loss could not be met).
    ``owed``: seconds of training the overhead budget is still owed for snapshots
    already taken (:meth:`Cadence.owed_s`), added to its floor."""
    tau, bound = daly_interval(delta, mtbf), "young-daly"

    def lower_bound(owed: float) -> Tuple[str, float]:
        # The larger lower bound is the one that binds; on a tie, the overhead budget.
        return max((("overhead", delta / overhead + owed), ("writer", durable)),
                   key=lambda b: b[1])

    name, floor = lower_bound(owed)
    if floor > tau:
        tau, bound = floor, name
    if max_loss is None:
        return tau, bound, None
    # A failure just before the next snapshot is durable loses tau + its stall + D.
    ceiling = max_loss - durable - delta
    if tau <= ceiling:
        return tau, bound, None
    # max_loss is a promise: what the budget is owed gives way to it (and stays owed),
    # the budget's own rate does not.
    steady_name, steady_floor = lower_bound(0.0)
    if ceiling >= steady_floor:
        return ceiling, "max_loss", None
    return floor, name, Unreachable(steady_name, steady_floor, ceiling)


def unreachable_sentence(max_loss: float, durable: float, conflict: Unreachable) -> str:
    """The one warning: both figures, and what to change."""
    fix = ("raise max_loss or overhead" if conflict.name == "overhead" else
           "raise max_loss, or make snapshots durable sooner (a faster disk, "
           "compression off)")
    return (f"max_loss={max_loss:g} s cannot be met: the {conflict.name} bound needs "
            f"at least {conflict.floor:.1f} s between snapshots, but max_loss allows at "
            f"most {conflict.ceiling:.1f} s (max_loss less the {durable:.1f} s a "
            f"snapshot takes to become durable and its stall), so snapshots are taken every "
            f"{conflict.floor:.1f} s; {fix}.")


class Cadence:
    """Decides, at every step, whether this one takes a snapshot.

    ``overhead``: the fraction of training time snapshots may cost; ``max_loss``:
    the most seconds of training a failure may cost (None: no limit); ``mtbf``: M in
    seconds, used when ``history`` (the wall times of this run's interruptions, two or
    more) cannot give it; ``clock``: seconds, monotonic (injected by tests);
    ``first_waits``: the first snapshot waits for ``settled`` (at most
    ``FIRST_WAIT_S`` of training) and, taken settled, is a steady one: no probe.
    """

    def __init__(self, *, overhead: float = 0.01, max_loss: Optional[float] = None,
                 mtbf: Optional[float] = None, history: Sequence[float] = (),
                 clock: Callable[[], float] = time.monotonic,
                 first_waits: bool = False) -> None:
        _check_positive("overhead", overhead, below=1.0)
        _check_positive("max_loss", max_loss)
        _check_positive("mtbf", mtbf)
        self.overhead = float(overhead)
        self.max_loss = None if max_loss is None else float(max_loss)
        self.mtbf_s, self.mtbf_from = choose_mtbf(history, mtbf)
        self.first_waits = first_waits
        self._clock = clock
        self._lock = threading.Lock()
        self._step_times: Deque[float] = deque(maxlen=STEP_WINDOW)
        # Step times with no snapshot in flight: what a step costs undisturbed.
        self._idle_times: Deque[float] = deque(maxlen=STEP_WINDOW)
        self._costs: Deque[float] = deque(maxlen=COST_WINDOW)  # steady snapshots'
        self._first_stall: Optional[float] = None   # the process's first snapshot's
        self._first_step: Optional[int] = None
        self._first_settled = False   # the first was decided with the staging ready
        # The first, when it paid set-up: left out of delta, and a probe follows it.
        self._setup_step: Optional[int] = None
        # Snapshots taken and not yet durable: step -> _InFlight; and those durable
        # since the last call, whose cost waits for the step they became durable in.
        self._in_flight: Dict[int, _InFlight] = {}
        self._settled: Dict[int, _InFlight] = {}
        self._busy_in_sample = False     # a snapshot was in flight in the timed gap
        self._durable: Tuple[int, float] = (-1, 0.0)     # (step, seconds to durable)
        self._previous_call: Optional[Tuple[int, float]] = None  # (step, clock)
        self._stalled_since_call = 0.0   # stall inside the interval being timed
        self._last_taken: Optional[int] = None
        # The overhead budget's ledger: the training timed so far, what the snapshots
        # after the process's first cost (stalls, then slowdowns as they settle), and
        # the training timed when the newest was taken. The first is left out, steady
        # or not: the ledger starts there (measuring a cost takes one snapshot).
        self._trained = 0.0
        self._spent = 0.0
        self._trained_at_last = 0.0
        self._own_steps = 1              # this rank's interval in steps
        self._applied_steps: Optional[int] = None  # rank 0's, once set
        self._warning: Optional[str] = None
        self._warned = False
        self._bounded_for: Optional[Tuple[Tuple[float, float, float],
                                          Tuple[float, str, Optional[Unreachable]]]] = None

    @property
    def step_s(self) -> Optional[float]:
        """The measured step time (seconds of training per step); None until known."""
        with self._lock:
            return statistics.median(self._step_times) if self._step_times else None

    @property
    def stall_s(self) -> Optional[float]:
        """delta: the median cost of the last durable snapshots (stall and slowdown);
        before one is measured, the steady stalls, else the first's; None before any."""
        with self._lock:
            return self._delta()

    def _delta(self) -> Optional[float]:
        if self._costs:
            return statistics.median(self._costs)
        steady = [f.stall for s, f in {**self._settled, **self._in_flight}.items()
                  if s != self._setup_step]
        if steady:
            return statistics.median(steady)
        return self._first_stall

    def decide(self, step: int, settled: bool = True) -> Decision:
        """Whether ``step`` takes a snapshot, and the interval as estimated now.
        ``settled``: a snapshot now would cost a steady one (the client's staging
        memory is made and faulted in whole); the probe waits for it, and so does the
        first under ``first_waits``."""
        with self._lock:
            self._time_step(step)
            delta = self._delta()
            if delta is None:
                return self._first(settled)
            if settled and self._probe_due():
                return Decision(True, 0.0, 1, "probe", self._durable[1], self.mtbf_s,
                                self.mtbf_from, delta)
            durable = self._durable[1]
            tau, bound, conflict = self._bounded(delta, durable, self._owed())
            if conflict is not None and not self._warned and self._warning is None:
                self._warning = unreachable_sentence(self.max_loss, durable, conflict)
            # Under max_loss the steps are rounded down: the bound is a promise.
            self._own_steps = self._steps_for(tau, down=bound == "max_loss")
            # Many ranks: every rank follows rank 0's interval, so they all take the
            # same steps; this rank's own estimate is still what the decision reports
            # (on rank 0 it is the value it puts in the job's store, schedule.py).
            acting = self._applied_steps or self._own_steps
            take = self._last_taken is None or step - self._last_taken >= acting
            return Decision(take, tau, self._own_steps, bound, tau / 2 + durable,
                            self.mtbf_s, self.mtbf_from, delta)

    def _bounded(self, delta: float, durable: float, owed: float
                 ) -> Tuple[float, str, Optional[Unreachable]]:
        """bounded_interval() for these inputs, worked out again only when one has
        changed: they move at a snapshot's events, and this runs at every step."""
        key = (delta, durable, owed)
        if self._bounded_for is None or self._bounded_for[0] != key:
            self._bounded_for = (key, bounded_interval(delta, durable, self.mtbf_s,
                                                       self.overhead, self.max_loss,
                                                       owed=owed))
        return self._bounded_for[1]

    def taken(self, step: int, stall_s: float) -> None:
        """A snapshot was taken at ``step`` and stalled training ``stall_s`` seconds."""
        with self._lock:
            stall = max(0.0, float(stall_s))
            if self._first_stall is None:
                self._first_stall, self._first_step = stall, step
                if not self._first_settled:
                    self._setup_step = step
            else:
                self._spent += stall
            self._trained_at_last = self._trained
            self._in_flight[step] = _InFlight(stall)
            self._busy_in_sample = True
            self._last_taken = step
            # The stall lies inside the interval until the next decide(); it is not
            # training time.
            self._stalled_since_call += stall

    def durable(self, step: int, durable_s: float) -> None:
        """The snapshot taken at ``step`` became durable ``durable_s`` seconds after it
        was taken. Reports may arrive out of order; the newest step's counts. Its cost
        (stall and slowdown) joins delta at the next call, which times the step it
        became durable in, unless it is the process's first."""
        with self._lock:
            if step >= self._durable[0]:
                self._durable = (step, max(0.0, float(durable_s)))
            done = self._in_flight.pop(step, None)
            if done is not None:
                self._settled[step] = done
            # One durable means the writer is past every older one: a snapshot that
            # failed or was skipped never reports, and must not count as in flight.
            for older in [s for s in self._in_flight if s < step]:
                del self._in_flight[older]

    def set_interval_steps(self, n: int) -> None:
        """Many ranks: take snapshots every ``n`` steps (rank 0's estimate) instead of
        this rank's own, until the next call."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"set_interval_steps({n!r}): an interval of at least one "
                             "step")
        with self._lock:
            self._applied_steps = n

    @property
    def owed_s(self) -> float:
        """Seconds of training the overhead budget is still owed (see :meth:`_owed`)."""
        with self._lock:
            return self._owed()

    def _owed(self) -> float:
        """The budget kept over the whole process, not per interval: the snapshots
        since the first have cost ``spent``, which ``spent / overhead`` seconds of
        training pay for. Beyond the training timed up to the newest snapshot, that
        much more must run before the next one's own ``delta / overhead`` starts:
        a probe, where one is taken (one snapshot more, once), is paid back, and an
        interval cut short by rounding to whole steps is made up at the next. Never
        negative: training run under the budget earns no burst of snapshots later."""
        return max(0.0, self._spent / self.overhead - self._trained_at_last)

    def warning(self) -> Optional[str]:
        """Once: the sentence saying max_loss cannot be met and why; else None."""
        with self._lock:
            sentence, self._warning = self._warning, None
            if sentence is not None:
                self._warned = True
            return sentence

    def _first(self, settled: bool) -> Decision:
        # No stall measured yet: nothing to weigh, so the first call takes one (and,
        # should it not be taken after all, the next call tries again), unless it
        # waits for the staging memory: a copy into pages still faulting in measures
        # set-up, and then a probe must follow; waiting is cheaper than that snapshot.
        waits = self.first_waits and not settled and self._trained < FIRST_WAIT_S
        self._first_settled = self.first_waits and settled
        return Decision(self._last_taken is None and not waits, 0.0, 1, "first",
                        self._durable[1], self.mtbf_s, self.mtbf_from, None)

    def _probe_due(self) -> bool:
        """Only the first snapshot is measured, it paid set-up, it is durable, and a
        step has run undisturbed since: take a second now, to measure what a steady
        one costs. Many ranks follow rank 0's interval instead (one step after the
        first)."""
        return (self._applied_steps is None and not self._costs
                and self._setup_step is not None
                and self._last_taken == self._setup_step
                and self._durable[0] >= self._setup_step and bool(self._idle_times))

    def _idle_step(self) -> Optional[float]:
        return statistics.median(self._idle_times) if self._idle_times else None

    def _time_step(self, step: int) -> None:
        """One step-time sample from the clock since the previous call, per step and
        without the snapshot stall inside it. A step that does not move forward (a
        repeated call, a restore to an earlier step) only restarts the timing. A
        sample during which a snapshot was in flight is charged to the oldest one (its
        slowdown), the one it became durable in included; one with none is an
        undisturbed step. A snapshot durable since the last call has its cost now."""
        now = self._clock()
        if self._previous_call is not None:
            previous_step, previous_time = self._previous_call
            if step > previous_step:
                steps = step - previous_step
                training = max(0.0, now - previous_time - self._stalled_since_call)
                self._trained += training
                self._step_times.append(training / steps)
                if not self._busy_in_sample:
                    self._idle_times.append(training / steps)
                elif self._settled or self._in_flight:
                    charged = {**self._settled, **self._in_flight}
                    charged[min(charged)].add(training, steps)
        if self._settled:
            for settled_step, done in self._settled.items():
                slowdown = done.slowdown(self._idle_step())
                if settled_step != self._setup_step:
                    self._costs.append(done.stall + slowdown)
                if settled_step != self._first_step:
                    self._spent += slowdown
            self._settled.clear()
        self._previous_call = (step, now)
        self._stalled_since_call = 0.0
        self._busy_in_sample = bool(self._in_flight)

    def _steps_for(self, tau: float, down: bool = False) -> int:
        """tau in steps at the measured step time (rounded down when ``down``); until a
        step time is measured (or the clock has not moved), the previous estimate
        stands."""
        step_time = statistics.median(self._step_times) if self._step_times else 0.0
        if step_time <= 0:
            return self._own_steps
        return max(1, math.floor(tau / step_time) if down else round(tau / step_time))


class _InFlight:
    """One snapshot between taken and durable: its stall, and the training time and
    steps of the samples timed while it was in flight."""

    def __init__(self, stall: float) -> None:
        self.stall, self.training, self.steps = stall, 0.0, 0

    def add(self, training: float, steps: int) -> None:
        self.training += training
        self.steps += steps

    def slowdown(self, idle_step: Optional[float]) -> float:
        """The time those steps took beyond the same steps undisturbed: summed with
        its sign before the clamp, so that noise either way cancels; 0 when no
        undisturbed step has been measured to set it against."""
        if idle_step is None or self.steps == 0:
            return 0.0
        return max(0.0, self.training - idle_step * self.steps)


def _check_positive(name: str, value: Optional[float], below: Optional[float] = None
                    ) -> None:
    """An option that is a positive number of seconds, or a fraction under ``below``
    (the same ranges as snapd.options checks, for a Cadence made without Options)."""
    if value is None and below is None:
        return
    number = (not isinstance(value, bool) and isinstance(value, (int, float))
              and math.isfinite(value))
    if number and value > 0 and (below is None or value < below):
        return
    what = (f"a fraction of training time between 0 and {below:g}, e.g. 0.01 for 1%"
            if below is not None else "a positive number of seconds")
    raise InvalidOption(f"{name}={value!r}: use {what} (Options({name}=...) or "
                        f"SNAPD_{name.upper()})", field=name)
