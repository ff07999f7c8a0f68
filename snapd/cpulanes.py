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
"""

from __future__ import annotations

import os
import threading


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity; the machine's count where the
    platform cannot say)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:   # not on Linux
        return os.cpu_count() or 1


class Lanes:
    """At most ``count`` holders at once: ``with lanes: work()``."""

    def __init__(self, count: int) -> None:
        if count < 1:
            raise ValueError(f"Lanes({count}): at least one lane")
        self.count = count
        self._free = threading.Semaphore(count)

    def __enter__(self) -> "Lanes":
        self._free.acquire()
        return self

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
