"""How many of a writing process's threads hash and compress at once: one fewer than
the CPUs the process may run on, and never fewer than one.

Why: on a machine of few cores a trainer loses, while a snapshot is written, the
cores the daemon's threads take. A snapshot's write mostly waits for the disk
(direct I/O); what needs a CPU is its SHA-256s, its xxh3 digests and its
compression, each file's SHA-256 on a thread of its own (snapd/shapipe.py), and two
files written at once (``writer_threads``). So two, three or four of those threads
could want a CPU at once on two CPUs. Measured on a 2-CPU VM, a one-thread loop of a
1 GiB MLP + AdamW ran as fast beside one thread hashing 1 GiB every 2.5 s as alone
(21.3-21.7 s against 21.9-22.2 s for 40 steps), and 1.2-3.1 s slower beside two
threads sharing the same work. With a snapshot every 10 steps, what each snapshot
cost that loop in its own steps fell from 454 ms (median of 28, four lanes) to 230 ms
(one lane) (docs/benchmarks.md, "One CPU lane for the daemon's hashing").

A thread holds a lane for one piece of work (a chunk encoded and digested, a chunk
hashed) and gives it back before waiting for the disk. On a machine with many cores
the lanes are many and nothing waits for one. On two CPUs there is one lane: the
work is the same, done on one core, and a snapshot becomes durable later, by the
part that ran side by side before (1 GiB: 1.2-1.7 s instead of about 1.0 s).

**The trainer's CPU kept free.** Each ``submit`` says on which CPU the training thread
called ``snapshot()`` (:func:`current_cpu`); the daemon keeps that CPU free of its
lanes (:meth:`Lanes.keep_free`): a thread that takes a lane first moves itself off
the CPUs the run's trainers were last seen on, while others remain. Why: the
scheduler otherwise wakes the daemon's threads on the trainer's CPU and, to balance
the two, moves the trainer to the other one. A moved thread leaves behind its
caches and, as far as the measurements below tell, the pages it freed, which wait in
the old CPU's free lists; its next allocations take other pages, and on a virtual
machine that hands freed memory back to its host those are faulted in from the host.
Measured on a 2-CPU VM, a GPT-2 Trainer step (whose gradients, freed and reallocated
at every step, are 400 MB of fresh pages) that the scheduler moved during a
snapshot's write spent 0.5-1.4 s more zeroing pages, after one of the first
snapshots of every run (5 of 5 runs); with the daemon kept off the trainer's CPU,
in none (2 runs, and 5 rounds of scripts/bench_frameworks.py; docs/benchmarks.md,
"The trainer's CPU kept free").
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Dict, FrozenSet, Hashable, Optional


def process_cpus() -> FrozenSet[int]:
    """The CPUs this thread may run on (empty where the platform cannot say)."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except AttributeError:   # not on Linux
        return frozenset()


def usable_cpus() -> int:
    """How many CPUs this process may run on (its affinity; the machine's count where
    the platform cannot say)."""
    return len(process_cpus()) or os.cpu_count() or 1


try:
    _sched_getcpu = ctypes.CDLL(None, use_errno=True).sched_getcpu
    _sched_getcpu.restype = ctypes.c_int
except (AttributeError, OSError):   # no such call in this C library
    _sched_getcpu = None


def move_onto(cpus: FrozenSet[int]) -> None:
    """Let the calling thread run on ``cpus`` only (Linux: this thread, not the
    process); where that fails (a cpuset changed under us), it runs where it did."""
    try:
        os.sched_setaffinity(0, cpus)
    except (AttributeError, OSError):
        pass


def keep_off(cpu: Optional[int]) -> None:
    """Move the calling thread off ``cpu`` onto the other CPUs it may run on; it
    stays where it is when there is no other, or ``cpu`` is None or not one of them."""
    mine = process_cpus()
    rest = mine - {cpu}
    if cpu is not None and rest and rest != mine:
        move_onto(rest)


def current_cpu() -> Optional[int]:
    """The CPU the calling thread runs on now (None where the platform cannot say):
    a ``submit`` carries the training thread's, for the daemon to keep free."""
    if _sched_getcpu is None:
        return None
    cpu = _sched_getcpu()
    return cpu if cpu >= 0 else None


class Lanes:
    """At most ``count`` holders at once: ``with lanes: work()``. A holder runs on
    the CPUs no trainer was last seen on (:meth:`keep_free`), or on all of
    ``cpus`` (default: this process's) while none is kept or every one is."""

    def __init__(self, count: int, cpus: Optional[FrozenSet[int]] = None) -> None:
        if count < 1:
            raise ValueError(f"Lanes({count}): at least one lane")
        self.count = count
        self.cpus = process_cpus() if cpus is None else frozenset(cpus)
        self._free = threading.Semaphore(count)
        self._lock = threading.Lock()
        self._kept: Dict[Hashable, int] = {}
        self._allowed = self.cpus          # where a holder runs now
        self._placed = threading.local()   # .cpus: what this thread last set itself to

    def keep_free(self, who: Hashable, cpu: Optional[int]) -> None:
        """``who`` (a run's rank) trains on ``cpu``: keep the lanes off it; None (the
        client left, or cannot say) forgets it. A CPU outside ``cpus`` is ignored."""
        with self._lock:
            if cpu is None:
                self._kept.pop(who, None)
            else:
                self._kept[who] = cpu
            rest = self.cpus - set(self._kept.values())
            self._allowed = rest if rest else self.cpus

    @property
    def kept(self) -> FrozenSet[int]:
        """The CPUs the lanes keep off now (the daemon's status shows them)."""
        with self._lock:
            return self.cpus - self._allowed

    def __enter__(self) -> "Lanes":
        self._free.acquire()
        self._place()
        return self

    def _place(self) -> None:
        """Move this thread onto the allowed CPUs, if it is not there yet: a system
        call when the kept set changed, none on every other lane taken."""
        allowed = self._allowed
        if not hasattr(self._placed, "cpus"):   # a new thread: it runs where its maker did
            self._placed.cpus = process_cpus()
        if self._placed.cpus == allowed or not allowed:
            return
        move_onto(allowed)
        self._placed.cpus = allowed

    def __exit__(self, *exc) -> None:
        self._free.release()


_shared = None
_shared_lock = threading.Lock()


def shared() -> Lanes:
    """This process's lanes, one fewer than its usable CPUs (at least one), made at
    the first write."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = Lanes(max(1, usable_cpus() - 1))
        return _shared
