"""The real daemon, as a separate process, over its real socket (docs/protocol.md).

Each test starts ``python -m snapd serve --root R``, talks to it with snapd.protocol
only, stages tensors in a /dev/shm segment it creates itself, and reads what the
daemon committed back with snapd.reader. Daemons are SIGKILLed and segments removed
in teardown, whatever happened.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import socket
import subprocess
import tempfile

import pytest
import torch

from snapd import peer as peer_mod
from snapd import protocol as p
from snapd.arena_map import rebased
from snapd.plan import from_descriptor
from snapd.store import RunStore, SnapshotId
from snapd_client.state import flatten

from harness import Peer, assert_snapshot_equals, big_states, sample_states, submit
from helpers import stop_daemons_under, wait_for

pytestmark = pytest.mark.integration


# --- the protocol, end to end ----------------------------------------------------------

def test_submit_commits_bit_for_bit_and_hot_copy(harness):
    root, run = harness.root(), harness.run
    harness.start(root)
    arena = harness.arena(1 << 20, slots=2)
    states = sample_states(0)
    with Peer(root, hello=True, run=run) as peer:
        arena.attach(peer, run, hot=True)   # the committed slot is the hot copy
        desc = submit(peer, arena, run, 10, states, slot=1, metric=0.5)
        event = peer.event()
        assert event["op"] == "committed", event
        assert (event["run"], event["step"], event["slot"], event["name"]) == \
            (run, 10, 1, "00000010")
        store = RunStore(root, run)
        assert store.read_pointer("LATEST") == SnapshotId(0, 10)
        assert store.read_pointer("BEST") == SnapshotId(0, 10)
        assert_snapshot_equals(store.snapshot_path(SnapshotId(0, 10)), states)

        hot = peer.request(p.HotGet(run, 0))
        assert hot["op"] == "hot_reply" and hot["snapshot"] == "00000010"
        with open(f"/dev/shm/{hot['shm']}", "rb") as f:
            held = bytearray(f.read())
        plan = from_descriptor(hot["plan"], memoryview(held))
        assert hot["plan"] == rebased(desc, arena.size // 2)   # slot 1, in the file
        for obj, name in zip(plan.objects, states):
            flat = flatten(states[name], name)
            for t, want in zip(obj.tensors, flat.tensors):
                assert bytes(t.data) == want.contiguous().reshape(-1).view(
                    torch.uint8).numpy().tobytes()

        status = peer.request(p.Status())["status"]
        assert status["runs"][run]["last_committed"] == "00000010"
        assert {"pid", "root", "in_flight", "clients", "cpu_percent", "rss",
                "disk_free"} <= set(status)
        assert any(c["run"] == run and c["alive"] for c in status["clients"])
        assert peer.request(p.HotGet("nobody", 0))["shm"] is None


def test_refusals_keep_the_connection(harness):
    root, run = harness.root(), harness.run
    harness.start(root)
    arena = harness.arena(1 << 16)
    with Peer(root, hello=True, run=run) as peer:
        bad = peer.request(p.Attach(run, 0, "../etc/passwd", 10, 1))
        assert bad["op"] == "error" and "refused" in bad["message"]
        wrong = peer.request(p.Attach(run, 0, arena.name, arena.size + 1, 1))
        assert wrong["op"] == "error" and "bytes" in wrong["message"]
        arena.attach(peer, run)
        desc = arena.stage(0, run, 1, sample_states())
        desc["objects"][0]["tensors"][0]["offset"] = arena.slot_bytes - 4
        outside = peer.request(p.Submit(run, 0, 1, 0, desc, {}))
        assert outside["op"] == "error" and "outside" in outside["message"]
        busy_desc = arena.stage(0, run, 2, sample_states())
        assert peer.request(p.Submit(run, 0, 2, 0, busy_desc, {}))["op"] == "accepted"
        assert peer.request(p.Ping())["op"] == "pong"
        assert peer.event()["op"] == "committed"


def test_not_msgpack_closes_only_that_connection(harness):
    root = harness.root()
    harness.start(root)
    with Peer(root) as peer:
        peer.sock.sendall(b"\x04\x00\x00\x00\xc1\xc1\xc1\xc1")   # 0xc1: never msgpack
        with pytest.raises((EOFError, ConnectionResetError)):
            p.recv(peer.sock)
    with Peer(root) as peer:   # no hello first: also closed
        raw = peer_mod.connect(root, timeout=60)
        p.send(raw, p.Ping(), id=1)
        with pytest.raises((EOFError, ConnectionResetError)):
            p.recv(raw)
        raw.close()
        assert peer.request(p.Ping())["op"] == "pong"


def test_protocol_mismatch(harness):
    root = harness.root()
    harness.start(root)
    raw = peer_mod.connect(root, timeout=60)
    p.send(raw, p.Hello(99, os.getpid()), id=1)
    reply = p.recv(raw)
    assert reply["op"] == "error" and reply["kind"] == "ProtocolMismatch"
    with pytest.raises((EOFError, ConnectionResetError)):
        p.recv(raw)
    raw.close()


# --- one daemon per root, and its socket -------------------------------------------------

def test_second_daemon_is_refused(harness):
    root = harness.root()
    first = harness.start(root)
    second = harness.start(root, ready=False)
    assert second.proc.wait(30) == 2
    text = second.text()
    assert root in text and str(first.proc.pid) in text
    assert oct(os.stat(os.path.join(root, ".snapd.sock")).st_mode & 0o777) == "0o600"
    with Peer(root) as peer:   # the first one is untouched
        assert peer.request(p.Ping())["pid"] == first.proc.pid


def test_stale_socket_is_replaced(harness):
    root = harness.root()
    first = harness.start(root)
    first.kill()
    first.proc.wait(10)
    assert os.path.exists(os.path.join(root, ".snapd.sock"))   # left behind
    second = harness.start(root)
    with Peer(root) as peer:
        assert peer.request(p.Ping())["pid"] == second.proc.pid


QUICK_CHECK = {"SNAPD_ROOT_CHECK_SECONDS": "0.2"}


def test_deleting_the_root_stops_the_daemon_and_frees_its_hot_copy(harness):
    root, run = harness.root(), harness.run
    daemon = harness.start(root, extra_env=QUICK_CHECK)
    arena = harness.arena(1 << 20, slots=2)
    with Peer(root, hello=True, run=run) as peer:
        arena.attach(peer, run, hot=True)
        submit(peer, arena, run, 1, sample_states(0))
        assert peer.event()["op"] == "committed"
        hot = f"/dev/shm/{peer.request(p.HotGet(run, 0))['shm']}"
        assert os.path.exists(hot)
        shutil.rmtree(root)
        assert daemon.proc.wait(60) == 0
    assert "was removed or replaced" in daemon.text()
    assert not os.path.exists(hot)
    assert not glob.glob(f"/dev/shm/snapd-hot-{os.getuid()}-{run}-*")


def test_a_socket_bound_by_another_is_left_in_place(harness):
    root = harness.root()
    daemon = harness.start(root, extra_env=QUICK_CHECK)
    path = os.path.join(root, ".snapd.sock")
    os.unlink(path)
    other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        other.bind(path)   # as a newer daemon would after the root was recreated
        theirs = os.stat(path).st_ino
        assert daemon.proc.wait(60) == 0
        assert os.stat(path).st_ino == theirs   # not unlinked on the way out
    finally:
        other.close()


# --- finishing what was accepted ---------------------------------------------------------

def test_sigterm_drains_in_flight(harness):
    root, run = harness.root(), harness.run
    daemon = harness.start(root)
    arena = harness.arena(40 << 20)
    states = big_states(32)
    with Peer(root, hello=True, run=run) as peer:
        arena.attach(peer, run)
        submit(peer, arena, run, 5, states, compression=3)
        daemon.kill(signal.SIGTERM)
        event = peer.event()
        assert event["op"] == "committed", event
    assert daemon.proc.wait(60) == 0
    assert not os.path.exists(os.path.join(root, ".snapd.sock"))
    assert_snapshot_equals(RunStore(root, run).snapshot_path(SnapshotId(0, 5)), states)
    harness.start(root)   # the lock was released


def test_dropped_client_still_commits_and_segment_is_unlinked(harness):
    root, run = harness.root(), harness.run
    harness.start(root)
    arena = harness.arena(24 << 20)
    states = big_states(16)
    peer = Peer(root, hello=True, run=run)
    arena.attach(peer, run)
    submit(peer, arena, run, 3, states, compression=3)
    peer.close()   # the trainer is gone; the daemon owes the snapshot anyway
    store = RunStore(root, run)
    assert wait_for(lambda: store.read_pointer("LATEST") == SnapshotId(0, 3))
    assert_snapshot_equals(store.snapshot_path(SnapshotId(0, 3)), states)
    assert wait_for(lambda: not os.path.exists(arena.path), timeout=60)


def test_sigkill_mid_write_keeps_previous(harness):
    root, run = harness.root(), harness.run
    daemon = harness.start(root)
    arena = harness.arena(136 << 20)
    small = sample_states(1)
    store = RunStore(root, run)
    with Peer(root, hello=True, run=run) as peer:
        arena.attach(peer, run)
        submit(peer, arena, run, 1, small)
        assert peer.event()["op"] == "committed"
        # zstd level 19 writes slowly: the kill surely lands inside the write.
        submit(peer, arena, run, 2, big_states(128), compression=19)
        assert wait_for(lambda: any(os.scandir(t) for t in store.tmp_dirs()),
                        interval=0.002)
        daemon.kill()
    daemon.proc.wait(10)
    assert store.committed() == [SnapshotId(0, 1)]
    assert store.read_pointer("LATEST") == SnapshotId(0, 1)
    assert len(store.tmp_dirs()) == 1
    assert_snapshot_equals(store.snapshot_path(SnapshotId(0, 1)), small)
    harness.start(root)
    assert store.tmp_dirs() == []


# --- disk space ------------------------------------------------------------------------

@pytest.fixture
def small_disk():
    mnt = tempfile.mkdtemp(prefix="snapd-fs-", dir="/tmp")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", mnt],
                          capture_output=True, text=True)
    if done.returncode != 0:
        os.rmdir(mnt)
        pytest.skip(f"cannot mount a 20 MiB tmpfs (needs root): {done.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", mnt], check=False)
    os.rmdir(mnt)


def test_insufficient_space(harness, small_disk):
    run = harness.run
    root = os.path.join(small_disk, "root")
    daemon = harness.start(root)
    arena = harness.arena(40 << 20)
    first, huge = big_states(4), big_states(32, seed=2)
    store = RunStore(root, run)
    with Peer(root, hello=True, run=run) as peer:
        arena.attach(peer, run)
        submit(peer, arena, run, 1, first)
        assert peer.event()["op"] == "committed"
        submit(peer, arena, run, 2, huge, keep_last=1)
        failed = peer.event()
    assert failed["op"] == "failed" and failed["kind"] == "InsufficientSpace"
    assert root in failed["message"] and "bytes" in failed["message"]
    daemon.kill(signal.SIGTERM)
    assert daemon.proc.wait(30) == 0
    # The guard passes (min_free < 0), so the disk fills during the write: ENOSPC.
    harness.start(root, extra_env={"SNAPD_MIN_FREE_BYTES": str(-(1 << 30))})
    assert not os.path.exists(arena.path)   # unlinked once its connection dropped
    arena = harness.arena(40 << 20)
    with Peer(root, hello=True, run=run) as peer:
        arena.attach(peer, run)
        submit(peer, arena, run, 3, huge)
        enospc = peer.event()
    assert enospc["op"] == "failed" and enospc["kind"] == "InsufficientSpace"
    assert "filled up" in enospc["message"]
    assert store.committed() == [SnapshotId(0, 1)] and store.tmp_dirs() == []
    assert store.read_pointer("LATEST") == SnapshotId(0, 1)
    assert_snapshot_equals(store.snapshot_path(SnapshotId(0, 1)), first)


@pytest.mark.integration
def test_a_root_deeper_than_a_unix_socket_path_still_works(tmp_path):
    """sun_path holds 107 bytes; a deep root is reached through /proc/self/fd."""
    import torch
    from snapd_client import Client
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    assert len(str(deep / ".snapd.sock")) > 107
    model = torch.nn.Linear(3, 3)
    client = Client(str(deep), "r", daemon=True)
    client.track(model=model)
    try:
        client.snapshot(1).wait()
        client.close()
        assert os.path.isdir(deep / "r" / "snapshots" / "00000001")
        assert os.path.exists(deep / ".snapd.sock")
    finally:
        stop_daemons_under(str(tmp_path))
