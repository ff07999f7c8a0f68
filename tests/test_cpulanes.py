"""snapd/cpulanes.py: a writing process hashes and compresses on one fewer core than it
may run on (at least one), whatever number of files and threads a snapshot's write
uses, and off the CPU its trainers were last seen on; the snapshot written that way
is the same snapshot."""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from snapd import cpulanes, writer
from snapd.commands.verifysha import file_sha256
from snapd.cpulanes import Lanes
from snapd.options import Options
from snapd.reader import SnapshotReader
from snapd.store import RunStore

from helpers import plan_for


class RecordedLanes(Lanes):
    """Lanes that note which thread held one, from when to when, the most held at
    once (``peak``), and where each holder might run and ran (``placed``: its
    affinity, ``ran_on``: its CPU, as it took the lane)."""

    def __init__(self, count: int) -> None:
        super().__init__(count)
        self.spans, self._mine = [], threading.local()
        self.peak, self._held, self._lock = 0, 0, threading.Lock()
        self.placed, self.ran_on = set(), set()

    def __enter__(self):
        super().__enter__()
        with self._lock:
            self._held += 1
            self.peak = max(self.peak, self._held)
            self.placed.add(frozenset(os.sched_getaffinity(0)))
            self.ran_on.add(cpulanes.current_cpu())
        self._mine.since = time.perf_counter()
        return self

    def __exit__(self, *exc):
        me = threading.current_thread()
        self.spans.append(((me.name, me.ident), self._mine.since, time.perf_counter()))
        with self._lock:
            self._held -= 1
        super().__exit__(*exc)


@pytest.mark.parametrize("cpus, lanes", [(1, 1), (2, 1), (3, 2), (16, 15)])
def test_one_core_is_left_to_the_trainer(monkeypatch, cpus, lanes):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)))
    monkeypatch.setattr(cpulanes, "_shared", None)
    assert cpulanes.shared().count == lanes
    assert cpulanes.shared() is cpulanes.shared()   # one per process


def test_at_least_one_lane():
    with pytest.raises(ValueError):
        Lanes(0)


def two_object_plan():
    g = torch.Generator().manual_seed(0)
    model = plan_for({"w": torch.randn(1 << 20, generator=g)})
    optim = plan_for({"m": torch.randn(1 << 20, generator=g),
                      "v": torch.randn(1 << 20, generator=g)}, name="optimizer")
    return dataclasses.replace(model, objects=model.objects + optim.objects)


def test_two_files_written_at_once_hash_one_at_a_time_on_one_lane(tmp_path, monkeypatch):
    """Two writer threads, each file's SHA-256 on a thread of its own: four threads that
    need a CPU, and never two of them at once with one lane."""
    lanes = RecordedLanes(1)
    monkeypatch.setattr(writer, "shared_lanes", lambda: lanes)
    result = writer.write_snapshot(RunStore(str(tmp_path), "r"), two_object_plan(),
                                   Options(writer_threads=2, chunk_bytes=64 << 10,
                                           compression="off", sha256=True))
    assert lanes.peak == 1
    spans = sorted(lanes.spans, key=lambda s: s[1])
    assert all(a[2] <= b[1] for a, b in zip(spans, spans[1:]))   # never side by side
    holders = {holder for holder, _, _ in spans}
    names = [name for name, _ in holders]
    assert names.count("snapd-sha256") == 2, holders   # one per file
    assert len(names) == 4, holders                     # and both writer threads
    assert_the_same_snapshot_as_ever(result.path)


def assert_the_same_snapshot_as_ever(path):
    """Every file's xxh3s and its SHA-256 as the manifest records them."""
    reader = SnapshotReader(path)
    reader.verify()
    files = reader.manifest["files"]
    assert len(files) == 2
    for name, entry in files.items():
        assert file_sha256(os.path.join(path, name)) == entry["sha256"], name


def test_lanes_allow_as_many_holders_as_they_have(tmp_path, monkeypatch):
    lanes = RecordedLanes(2)
    monkeypatch.setattr(writer, "shared_lanes", lambda: lanes)
    result = writer.write_snapshot(RunStore(str(tmp_path), "r"), two_object_plan(),
                                   Options(writer_threads=2, chunk_bytes=64 << 10,
                                           compression="off", sha256=True))
    assert 1 <= lanes.peak <= 2
    assert_the_same_snapshot_as_ever(result.path)


# --- the trainer's CPU kept free ------------------------------------------------------

def two_cpus():
    cpus = cpulanes.process_cpus()
    if len(cpus) < 2:
        pytest.skip("one CPU: there is no other to move to (CI runs on two)")
    return cpus


def test_current_cpu_is_one_this_thread_may_run_on():
    assert cpulanes.current_cpu() in cpulanes.process_cpus()


def test_kept_cpus_follow_the_trainers_and_never_take_every_cpu():
    lanes = Lanes(1, cpus=frozenset({0, 1}))
    assert lanes.kept == frozenset()
    lanes.keep_free(("r", 0), 0)
    assert lanes.kept == {0}
    lanes.keep_free(("r", 0), 1)            # the trainer moved: the latest CPU counts
    assert lanes.kept == {1}
    lanes.keep_free(("r", 1), 0)            # a rank on each CPU: none is left, so the
    assert lanes.kept == frozenset()        # lanes run anywhere rather than nowhere
    lanes.keep_free(("r", 1), None)         # that rank's client left
    assert lanes.kept == {1}
    lanes.keep_free(("other", 0), 7)        # a CPU this process may not use
    assert lanes.kept == {1}
    one = Lanes(1, cpus=frozenset({3}))
    one.keep_free(("r", 0), 3)
    assert one.kept == frozenset()          # one CPU: nothing to keep it from


def test_a_snapshot_is_hashed_off_the_trainers_cpu(tmp_path, monkeypatch):
    """Every thread that takes a lane (both writer threads, each file's SHA-256
    thread) runs off the CPU kept free; the thread that asked for the write stays
    where it was."""
    cpus = two_cpus()
    trainer = min(cpus)
    lanes = RecordedLanes(1)
    lanes.keep_free(("r", 0), trainer)
    monkeypatch.setattr(writer, "shared_lanes", lambda: lanes)
    mine = os.sched_getaffinity(0)
    result = writer.write_snapshot(RunStore(str(tmp_path), "r"), two_object_plan(),
                                   Options(writer_threads=2, chunk_bytes=64 << 10,
                                           compression="off", sha256=True))
    assert lanes.placed == {cpus - {trainer}}
    assert trainer not in lanes.ran_on
    assert len({holder for holder, _, _ in lanes.spans}) == 4
    assert os.sched_getaffinity(0) == mine
    assert_the_same_snapshot_as_ever(result.path)


def test_a_thread_goes_back_to_every_cpu_once_no_trainer_is_kept(monkeypatch):
    cpus = two_cpus()
    lanes = Lanes(1)
    trainer = max(cpus)

    def hold():
        with lanes:
            return frozenset(os.sched_getaffinity(0))

    with ThreadPoolExecutor(1) as one_thread:   # the same thread each time
        lanes.keep_free(("r", 0), trainer)
        assert one_thread.submit(hold).result() == cpus - {trainer}
        lanes.keep_free(("r", 0), None)
        assert one_thread.submit(hold).result() == cpus
