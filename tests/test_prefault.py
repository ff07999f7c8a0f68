"""Faulting an arena in ahead of the first snapshot: in the background, on a thread
that no fork ever sees, and from track() without a thread of the warm-up's own."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from snapd import cpulanes, protocol as proto
from snapd_client import Client, prefault
from snapd_client.staging import Arena


def resident_bytes(arena: Arena) -> int:
    """The arena's bytes mapped in this process's page tables (smaps' Rss)."""
    start = arena.view(0, 0, 1).data_ptr()
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        if line.split()[0].split("-")[0] == f"{start:x}":
            rss = next(x for x in lines[i + 1:] if x.startswith("Rss:"))
            return int(rss.split()[1]) * 1024
    raise AssertionError(f"no mapping at {start:x}")


def prefault_threads() -> list:
    return [t for t in threading.enumerate() if t.name == "snapd-prefault" and t.is_alive()]


def test_a_background_fault_in_maps_every_page_before_the_first_copy(monkeypatch):
    monkeypatch.setattr(prefault, "PIECE", 1 << 20)   # 16 pieces: the thread loops
    arena = Arena(16 << 20, slots=2, background=True)
    try:
        arena.ready()
        assert resident_bytes(arena) == arena.size
        assert not prefault_threads()
    finally:
        arena.close()


def test_the_fault_in_runs_off_the_cpu_of_the_thread_that_started_it(monkeypatch):
    """The trainer's thread starts the fault-in: every piece the background thread
    faults in, it faults in on the process's other CPUs, and the trainer's thread
    stays where it may run."""
    cpus = cpulanes.process_cpus()
    if len(cpus) < 2:
        pytest.skip("one CPU: there is no other to move to (CI runs on two)")
    trainer = max(cpus)
    monkeypatch.setattr(prefault, "current_cpu", lambda: trainer)  # where start() runs
    monkeypatch.setattr(prefault, "PIECE", 1 << 20)
    seen, real = [], prefault.populate

    def populate(address, nbytes):
        if threading.current_thread().name == "snapd-prefault":
            seen.append(frozenset(os.sched_getaffinity(0)))
        real(address, nbytes)

    monkeypatch.setattr(prefault, "populate", populate)
    mine = os.sched_getaffinity(0)
    arena = Arena(8 << 20, slots=2, background=True)
    try:
        for thread in prefault_threads():   # started by the arena, on this thread
            thread.join(60)
        assert arena.faulted_in and not prefault_threads()
    finally:
        arena.close()
    assert len(seen) == 16 and set(seen) == {cpus - {trainer}}
    assert os.sched_getaffinity(0) == mine


def test_a_copy_waits_for_its_own_slots_pages_and_the_rest_goes_on(monkeypatch):
    """ready(slot) faults in what is left up to the end of that slot on the calling
    thread; the thread goes on with the later slots (the hot copy's) after."""
    monkeypatch.setattr(prefault, "PIECE", 1 << 20)
    gate, real = threading.Event(), prefault.populate

    def slow(address, nbytes):   # the thread's pieces are held back until the gate
        if threading.current_thread().name == "snapd-prefault" and not gate.is_set():
            # or until its job is paused (ready() joins the thread): ready() then waits
            # for the held piece, not for a timeout
            (job,) = [j for j in list(prefault._running)
                      if j.address <= address < j.address + j.nbytes]
            job._stop.wait(0.3)
        real(address, nbytes)

    monkeypatch.setattr(prefault, "populate", slow)
    arena = Arena(16 << 20, slots=2, background=True)
    try:
        assert arena.ready(0)
        assert arena._prefault.done >= arena.slot_bytes
        assert resident_bytes(arena) >= arena.slot_bytes
        assert resident_bytes(arena) < arena.size and prefault_threads()
        gate.set()
        assert arena.ready()
        assert resident_bytes(arena) == arena.size and not prefault_threads()
    finally:
        gate.set()
        arena.close()


def test_no_prefault_thread_is_alive_across_a_fork_and_the_parent_goes_on(monkeypatch):
    # 256 pieces: it is still running (64 MiB do that as well as 256 MiB did, at a
    # quarter of the page faults)
    monkeypatch.setattr(prefault, "PIECE", 256 << 10)
    arena = Arena(64 << 20, background=True)
    try:
        prefault._before_fork()        # what os.fork() runs first
        assert not prefault_threads()
        prefault._after_fork_in_parent()
        arena.ready()
        assert resident_bytes(arena) == arena.size
    finally:
        arena.close()
    assert not prefault_threads()


def test_close_stops_the_fault_in_before_the_memory_is_unmapped(monkeypatch):
    monkeypatch.setattr(prefault, "PIECE", 256 << 10)   # 256 pieces, as above
    arena = Arena(64 << 20, background=True)
    arena.close()
    assert not prefault_threads()


class Daemon:
    """What the warm-up asks of a daemon connection."""

    lost = None
    daemon_pid = 4242

    def __init__(self) -> None:
        self.asked: list = []

    def request(self, message):
        self.asked.append(type(message).__name__)
        return proto.HotReply() if isinstance(message, proto.HotGet) else proto.Ok()

    def close(self) -> None:
        pass


def test_track_attaches_the_arena_on_the_trainers_thread(tmp_path):
    c = Client(str(tmp_path), "r", daemon=True)
    c._handoff.conn = daemon = Daemon()
    before = set(threading.enumerate())
    try:
        c.track(model=torch.nn.Linear(256, 256))
        # Done when track() returns, by this thread: the only thread left is the
        # prefault's, which forks pause.
        assert daemon.asked == ["HotGet", "Attach"]
        assert c._handoff.arena is not None
        assert {t.name for t in set(threading.enumerate()) - before} <= {"snapd-prefault"}
    finally:
        c._closed = True
        c._handoff.close()
        c._lock.release()


def test_a_restarts_arena_waits_while_the_daemon_holds_the_earlier_one(tmp_path):
    class Holding(Daemon):
        def request(self, message):
            self.asked.append(type(message).__name__)
            return proto.HotReply("snapd-hot-x", "s", {}) \
                if isinstance(message, proto.HotGet) else proto.Ok()

    c = Client(str(tmp_path), "r", daemon=True)
    c._handoff.conn = daemon = Holding()
    try:
        c.track(model=torch.nn.Linear(8, 4))
        assert daemon.asked == ["HotGet"] and c._handoff.arena is None
    finally:
        c._closed = True
        c._handoff.close()
        c._lock.release()


def test_an_optimizer_before_its_first_step_gets_its_arena_after_that_step(tmp_path):
    c = Client(str(tmp_path), "r", daemon=True)
    c._handoff.conn = daemon = Daemon()
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.Adam(model.parameters())
    try:
        c.track(model=model, optimizer=opt)
        assert c._handoff.arena is None     # no moments yet: it would be made twice
        model(torch.ones(1, 256)).sum().backward()
        opt.step()
        weights = sum(p.numel() * 4 for p in model.parameters())
        assert daemon.asked == ["HotGet", "Attach"]
        assert c._handoff.arena.slot_bytes >= 3 * weights   # weights and two moments
        opt.step()
        assert daemon.asked == ["HotGet", "Attach"]         # once
    finally:
        c._closed = True
        c._handoff.close()
        c._lock.release()
