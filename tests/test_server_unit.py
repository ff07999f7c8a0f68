"""The daemon's checks, without a daemon process: who may connect, which segment
names and descriptors are refused, and one write's outcome as events."""

from __future__ import annotations

import errno
import os
import socket
import threading
import time

import msgpack
import pytest
import torch

from snapd import cpulanes, protocol as p
from snapd.arena_map import MappedArena, HotCache, hot_segment_name, validate_shm_name
from snapd.cpulanes import Lanes
from snapd.daemon import Daemon, WriteQueue
from snapd.errors import SnapdError
from snapd.options import Options
from snapd.plan import from_descriptor
from snapd.reader import SnapshotReader
from snapd.server import (Connection, Submission, check_descriptor, peer_allowed,
                          plan_over_slot, submit_options)
from snapd.store import RunStore, SnapshotId

from helpers import client_descriptor

SLOT = 4096
PID_MAX_LIMIT = 1 << 22   # the most pids a 64-bit Linux kernel hands out


def test_peer_allowed_only_same_uid():
    assert peer_allowed(1000, 1000)
    assert not peer_allowed(1001, 1000)
    assert not peer_allowed(0, 1000)      # not even root
    assert not peer_allowed(1000, 0)


@pytest.mark.parametrize("name", ["snapd-0-123-ab12", "snapd-x", "snapd-a.b_c-D"])
def test_shm_name_accepted(name):
    assert validate_shm_name(name) == name


@pytest.mark.parametrize("name", ["../etc/passwd", "snapd-../../x", "snapd-a/b", "snapd-",
                                  "other-1", "/dev/shm/snapd-1", "snapd-a b", "snapd-\x00",
                                  "snapd-" + "a" * 300, 42, None, b"snapd-1"])
def test_shm_name_refused(name):
    with pytest.raises(SnapdError):
        validate_shm_name(name)


# --- arenas ---------------------------------------------------------------------------

@pytest.fixture
def shm(tmp_path):
    d = tmp_path / "shm"
    d.mkdir()
    return d


def segment(shm, name="snapd-unit-1", size=SLOT * 2):
    with open(shm / name, "wb") as f:
        f.truncate(size)
    return name


def test_arena_refuses_wrong_size_and_symlink(shm):
    name = segment(shm)
    with pytest.raises(SnapdError, match="bytes"):
        MappedArena(name, SLOT * 3, 1, shm_dir=str(shm))
    os.symlink(shm / name, shm / "snapd-link")
    with pytest.raises(SnapdError, match="cannot open"):
        MappedArena("snapd-link", SLOT * 2, 2, shm_dir=str(shm))
    with pytest.raises(SnapdError, match="equal slots"):
        MappedArena(name, SLOT * 2, 3, shm_dir=str(shm))


def test_arena_slots_and_retire(shm):
    arena = MappedArena(segment(shm), SLOT * 2, 2, shm_dir=str(shm))
    arena.acquire(1)
    with pytest.raises(SnapdError, match="busy"):
        arena.acquire(1)
    with pytest.raises(SnapdError, match="does not exist"):
        arena.acquire(2)
    arena.retire(unlink=True)            # the client left: finish slot 1 first
    assert os.path.exists(shm / arena.name) and not arena.closed
    arena.release(1)
    assert arena.closed and not os.path.exists(shm / arena.name)


def hot_arena(shm, slots=2) -> MappedArena:
    """A client's arena attached as hot: renamed to the daemon's name."""
    arena = MappedArena(segment(shm, size=SLOT * slots), SLOT * slots, slots,
                        shm_dir=str(shm))
    arena.take_name(hot_segment_name("r=1", 0))
    arena.hot = True
    return arena


def commit(hot, arena, slot: int, data: bytes, snapshot: str):
    """What the daemon does with a hot arena's slot around a commit: hold it."""
    arena.acquire(slot)
    arena.slot_view(slot)[:len(data)] = data
    desc = {"objects": [{"name": "m", "tensors": [
        {"path": ".x", "dtype": "uint8", "shape": [len(data)], "offset": 0,
         "nbytes": len(data)}]}]}
    entry = hot.publish("r=1", 0, arena, slot, desc, snapshot)
    arena.release(slot)
    return entry


def test_the_hot_copy_is_the_committed_slot_held_in_place(shm):
    arena = hot_arena(shm)
    assert arena.name.startswith(f"snapd-hot-{os.getuid()}-r_1-0-{os.getpid()}x")
    assert os.listdir(shm) == [arena.name]     # renamed, not copied
    hot = HotCache(shm_dir=str(shm))
    first = commit(hot, arena, 0, b"abc", "00000001")
    assert first.shm == arena.name and first.plan["objects"][0]["tensors"][0]["offset"] == 0
    with pytest.raises(SnapdError, match="hot copy"):   # nobody writes it while held
        arena.acquire(0)
    second = commit(hot, arena, 1, b"de", "00000002")
    assert hot.get("r=1", 0) == second
    # Offsets from the start of the file: a reader needs no slot number.
    assert second.plan["objects"][0]["tensors"][0]["offset"] == SLOT
    arena.acquire(0)   # the older slot is the client's again
    arena.release(0)
    arena.retire(unlink=True)   # the client died: kept for its restart
    assert not arena.closed and os.listdir(shm) == [arena.name]
    hot.close()                 # let go (expired, or the daemon stops)
    assert arena.closed and os.listdir(shm) == [] and hot.get("r=1", 0) is None


def test_a_dead_clients_held_arena_goes_at_expiry(shm):
    arena = hot_arena(shm)
    hot = HotCache(shm_dir=str(shm))
    commit(hot, arena, 0, b"abcd", "00000001")
    arena.retire(unlink=True)
    assert hot.expire([("r=1", 0)], linger=0.0) == []   # a client of the run is back
    hot.touch("r=1", 0)
    assert hot.expire([], linger=60.0) == []
    assert hot.expire([], linger=0.0) == [("r=1", 0)]
    assert arena.closed and os.listdir(shm) == []


def test_hot_copies_of_dead_daemons_are_reclaimed(shm):
    dead = PID_MAX_LIMIT + 1   # above the kernel's largest pid: never a live process
    uid = os.getuid()
    for name in (f"snapd-hot-{uid}-r-0-{dead}xab12",
                 f"snapd-hot-{uid}-r-0-{os.getpid()}xab12",      # a live daemon's
                 f"snapd-hot-{uid + 1}-r-0-{dead}xab12",         # another user's
                 f"snapd-{uid}-{dead}-ab"):                      # a client arena
        (shm / name).write_bytes(b"x")
    assert HotCache(shm_dir=str(shm)).reclaim_orphans() == 1
    assert not (shm / f"snapd-hot-{uid}-r-0-{dead}xab12").exists()
    assert len(list(shm.iterdir())) == 3


# --- descriptors ------------------------------------------------------------------------

def descriptor(run="r", step=1, offset=0, nbytes=None):
    t = {"path": ".w", "dtype": "float32", "shape": [4], "device": "cpu",
         "offset": offset, "nbytes": 16 if nbytes is None else nbytes}
    return {"run": run, "step": step, "lineage": {"id": 0}, "rng": {}, "rank": 0,
            "objects": [{"name": "model", "type": "T", "skeleton": b"\x90",
                         "metadata": None, "tensors": [t]}]}


@pytest.mark.parametrize("offset,nbytes", [(SLOT - 8, 16), (-4, 16), (0, 12), (SLOT, 16)])
def test_descriptor_outside_slot_refused(offset, nbytes):
    slot = memoryview(bytearray(SLOT))
    with pytest.raises(SnapdError):
        plan_over_slot(descriptor(offset=offset, nbytes=nbytes), slot)


def test_descriptor_malformed_refused():
    slot = memoryview(bytearray(SLOT))
    bad = descriptor()
    del bad["objects"][0]["tensors"][0]["offset"]
    with pytest.raises(SnapdError, match="malformed"):
        plan_over_slot(bad, slot)
    assert plan_over_slot(descriptor(offset=SLOT - 16), slot).nbytes == 16


def test_descriptor_must_match_submit_and_names_must_be_plain():
    check_descriptor(descriptor(), "r", 0, 1)
    with pytest.raises(SnapdError, match="step"):
        check_descriptor(descriptor(step=2), "r", 0, 1)
    hostile = descriptor()
    hostile["objects"][0]["name"] = "../../outside"
    with pytest.raises(SnapdError, match="plain"):
        check_descriptor(hostile, "r", 0, 1)


def test_submit_options():
    opts = submit_options(Options(), {"keep_last": 3, "compression": 1, "future": 1})
    assert (opts.keep_last, opts.compression) == (3, 1)
    with pytest.raises(SnapdError):
        submit_options(Options(), {"keep_last": -1})
    with pytest.raises(SnapdError):
        submit_options(Options(), {"best_mode": "median"})


# --- one connection over a socketpair ---------------------------------------------------

class FakeHandler:
    def __init__(self, root="/r"):
        self.root, self.options, self.queued, self.lines = root, Options(), [], []

    def enqueue(self, sub):
        self.queued.append(sub)

    def status(self):
        return {"pid": os.getpid()}

    def hot(self, run, rank):
        return p.HotReply()

    def client_done(self, run, rank):
        self.lines.append(f"done {run} {rank}")

    def client_left(self, run, rank, clean):
        self.lines.append(f"left {run} {rank} clean={clean}")

    def log(self, message):
        self.lines.append(message)


def connected(handler):
    ours, theirs = socket.socketpair()
    ours.settimeout(10)
    conn = Connection(theirs, handler, os.getpid())
    thread = threading.Thread(target=conn.serve, daemon=True)
    thread.start()
    return ours, conn, thread


def ask(sock, message, rid):
    p.send(sock, message, id=rid)
    return p.recv(sock)


def test_garbage_frame_closes_connection():
    handler = FakeHandler()
    sock, conn, thread = connected(handler)
    assert ask(sock, p.Hello(p.PROTOCOL_VERSION, 1), 1)["op"] == "welcome"
    sock.sendall(b"\x03\x00\x00\x00\xc1\xc1\xc1")
    thread.join(5)
    assert not thread.is_alive() and conn.closed
    assert "protocol error" in handler.lines[-1]


def test_reply_ops_and_missing_ids_are_protocol_errors():
    for frame in ({"op": "welcome", "id": 1, "protocol": 1, "daemon_pid": 1, "root": "/"},
                  {"op": "hello", "protocol": 1, "pid": 1}):
        sock, conn, thread = connected(FakeHandler())
        p.send(sock, p.Hello(p.PROTOCOL_VERSION, 1), id=1)
        p.recv(sock)
        payload = msgpack.packb(frame)
        sock.sendall(len(payload).to_bytes(4, "little") + payload)
        thread.join(5)
        assert conn.closed


def test_submit_outside_slot_is_an_error_reply(shm):
    handler = FakeHandler()
    name = segment(shm, size=SLOT)
    sock, conn, thread = connected(handler)
    ask(sock, p.Hello(p.PROTOCOL_VERSION, 1, "r"), 1)
    conn.arenas[("r", 0)] = MappedArena(name, SLOT, 1, shm_dir=str(shm))  # attach, in shm
    reply = ask(sock, p.Submit("r", 0, 1, 0, descriptor(offset=SLOT - 8)), 2)
    assert reply["op"] == "error" and "outside" in reply["message"] and reply["re"] == 2
    assert conn.arenas[("r", 0)].busy == set() and handler.queued == []
    reply = ask(sock, p.Submit("r", 0, 1, 0, descriptor()), 3)
    assert reply == {"op": "accepted", "re": 3, "step": 1}
    assert conn.arenas[("r", 0)].busy == {0}
    sock.close()
    thread.join(5)


def test_a_submit_keeps_its_trainers_cpu_free_until_the_client_leaves(shm, monkeypatch):
    lanes = Lanes(1, cpus=frozenset({0, 1}))
    monkeypatch.setattr(cpulanes, "_shared", lanes)
    handler = FakeHandler()
    name = segment(shm, size=SLOT)
    sock, conn, thread = connected(handler)
    ask(sock, p.Hello(p.PROTOCOL_VERSION, 1, "r"), 1)
    conn.arenas[("r", 0)] = MappedArena(name, SLOT, 1, shm_dir=str(shm))  # attach, in shm
    for rid, bad in enumerate(("1", -1, True, 1.0), start=2):
        reply = ask(sock, p.Submit("r", 0, 1, 0, descriptor(), cpu=bad), rid)
        assert reply["op"] == "error" and reply["field"] == "cpu", reply
        assert "int >= 0" in reply["message"] and conn.arenas[("r", 0)].busy == set()
    assert lanes.kept == frozenset()
    reply = ask(sock, p.Submit("r", 0, 1, 0, descriptor(), cpu=1), 9)
    assert reply == {"op": "accepted", "re": 9, "step": 1}
    assert lanes.kept == {1}
    sock.close()
    thread.join(5)
    assert lanes.kept == frozenset()


# --- one write, as the daemon does it -----------------------------------------------------

class EventSink:
    finished = False   # the client has not said bye

    def __init__(self, arena):
        self.arena, self.events, self.busy_at_send = arena, [], []

    def send_event(self, message):
        self.busy_at_send.append(self.arena.busy)
        self.events.append(message)
        return True


def staged_submission(shm, root_opts=Options(), slots=1):
    name = segment(shm, "snapd-unit-w", SLOT * slots)
    arena = MappedArena(name, SLOT * slots, slots, shm_dir=str(shm))
    if slots > 1:   # attached as hot: the committed slot is held
        arena.take_name(hot_segment_name("r", 0))
        arena.hot = True
    arena.acquire(0)
    view = arena.slot_view(0)
    data = torch.arange(8, dtype=torch.float32)
    view[:32] = data.numpy().tobytes()
    desc = client_descriptor({"model": {"w": data}}, [0], step=4)
    sink = EventSink(arena)
    sub = Submission(sink, arena, 0, view, from_descriptor(desc, view), desc, root_opts)
    return sub, sink, arena


def test_commit_frees_slot_before_the_event(root, shm):
    daemon = Daemon(root, Options(min_free_bytes=0))
    daemon.hot_cache = HotCache(shm_dir=str(shm))
    sub, sink, arena = staged_submission(shm, slots=2)
    daemon._write(sub)
    daemon.writes.drain()
    [event] = sink.events
    assert isinstance(event, p.Committed) and event.name == "00000004"
    assert sink.busy_at_send == [set()]
    hot = daemon.hot_cache.get("r", 0)
    assert hot.snapshot == "00000004" and hot.plan == sub.desc   # slot 0: no rebase
    assert hot.shm == arena.name and hot.slot == 0
    assert (shm / hot.shm).read_bytes()[:32] == torch.arange(8.0).numpy().tobytes()
    daemon.hot_cache.close()
    reader = SnapshotReader(RunStore(root, "r").snapshot_path(SnapshotId(0, 4)))
    assert torch.equal(reader.load_object("model")[0], torch.arange(8.0))


def test_enospc_during_write_is_a_failed_event(root, shm):
    def full_disk(store, plan, opts, progress=None):   # a writer that fills the disk half way
        tmp = store.new_tmp_dir(plan.sid)
        with open(os.path.join(tmp, "model.tensors"), "wb") as f:
            f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device",
                      os.path.join(tmp, "model.tensors"))

    daemon = Daemon(root, Options(min_free_bytes=0), writer=full_disk)
    daemon.hot_cache = HotCache(shm_dir=str(shm))
    sub, sink, arena = staged_submission(shm)
    daemon._write(sub)
    daemon.writes.drain()
    [event] = sink.events
    assert isinstance(event, p.Failed) and event.kind == "InsufficientSpace"
    assert "filled up" in event.message and root in event.message
    assert RunStore(root, "r").tmp_dirs() == [] and arena.busy == set()


def test_guard_refuses_before_writing(root, shm):
    daemon = Daemon(root, Options(min_free_bytes=1 << 62))
    daemon.hot_cache = HotCache(shm_dir=str(shm))
    sub, sink, _ = staged_submission(shm)
    daemon._write(sub)
    daemon.writes.drain()
    [event] = sink.events
    assert event.kind == "InsufficientSpace" and "min_free_bytes" in event.message
    assert RunStore(root, "r").committed() == []


def test_write_queue_keeps_each_runs_order():
    done, lock = [], threading.Lock()

    class Job:
        def __init__(self, run, step):
            self.run, self.step, self.started, self.rank = run, step, None, 0

    def work(job):
        time.sleep(0.01 if job.step % 2 else 0.0)  # the behaviour: odd steps are slow jobs
        with lock:
            done.append((job.run, job.step))

    queue = WriteQueue(3, work)
    for step in range(6):
        for run in ("a", "b"):
            queue.put(Job(run, step))
    queue.drain()
    for run in ("a", "b"):
        assert [s for r, s in done if r == run] == list(range(6))
    with pytest.raises(SnapdError, match="stopping"):
        queue.put(Job("a", 9))
