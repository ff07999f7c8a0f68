"""The real daemon against peers that misbehave, and the memory it holds for runs.

Peers that never read their replies, announce frames larger than the protocol allows,
open more connections than the cap, never say hello (hundreds of them, while a trainer
snapshots) or drip it a byte at a time; an arena name that is not the peer's own. Then the hot copies: released at a clean close, kept a while after a
crash, bounded in total; and arenas that no death leaves in /dev/shm.
"""

from __future__ import annotations

import glob
import os
import secrets
import socket
import struct
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
import torch

from snapd import peer as peer_mod
from snapd import protocol as p
from snapd.errors import DaemonUnavailable
from snapd.lobby import LOBBY_SIZE
from snapd.store import RunStore, SnapshotId
from snapd_client import Client

from harness import UID, Env, Peer, big_states, close_as_if_killed, sample_states, submit
from helpers import stop_daemons_under, wait_exited, wait_for, wait_until
from jobs import job_env

pytestmark = pytest.mark.integration


def flood_pings(peer: Peer) -> int:
    """Send pings and read nothing until the daemon stops taking them."""
    frame = p.encode(p.Ping(), id=1 << 30)
    peer.sock.setblocking(False)
    sent = 0
    try:
        while sent < 200_000:
            peer.sock.send(frame)
            sent += 1
    except BlockingIOError:
        pass
    return sent


def hung_up(sock: socket.socket) -> bool:
    """The daemon closed this connection (within the socket's timeout)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:   # closed with our bytes unread
        return True
    except socket.timeout:
        return False


def still_open(sock: socket.socket) -> bool:
    """The daemon has neither closed this connection nor sent on it, as of now."""
    sock.setblocking(False)   # a socket timeout would wait out its seconds first
    try:
        sock.recv(1)
        return False
    except BlockingIOError:   # nothing to read, and not closed
        return True
    except ConnectionResetError:
        return False


def idle_connection(root: str) -> socket.socket:
    """A connection that will never say hello. Its connect blocks while the listen
    backlog is full (a socket with a timeout would get EAGAIN instead)."""
    sock = peer_mod.connect(root)
    assert sock is not None
    sock.settimeout(30)
    return sock


def drip(sock: socket.socket, data: bytes, every: float, give_up: float) -> float:
    """Send ``data`` one byte every ``every`` seconds until the daemon hangs up: the
    seconds that took (``give_up`` or more: it never did)."""
    start = time.monotonic()
    for byte in data:
        try:
            sock.send(bytes([byte]))
        except (BrokenPipeError, ConnectionResetError):
            break
        if time.monotonic() - start >= give_up:
            break
        time.sleep(every)   # the peer's own pace, not a wait on the daemon
    return time.monotonic() - start


# --- defect: peers that never read ----------------------------------------------------

def test_peers_that_never_read_do_not_stall_other_runs(harness):
    root, run = harness.root(), harness.run
    daemon = harness.start(root, extra_env={"SNAPD_PEER_TIMEOUT": "2"})
    hostile = []
    for i in range(2):   # one per writer thread
        peer = Peer(root, hello=True, run=f"{run}h{i}")
        arena = harness.arena(8 << 20)
        arena.attach(peer, f"{run}h{i}")
        submit(peer, arena, f"{run}h{i}", 1, big_states(4, seed=i), compression=19)
        assert flood_pings(peer) > 0
        hostile.append(peer)
    arena = harness.arena(1 << 20)
    with Peer(root, hello=True, run=run) as good:
        arena.attach(good, run)
        submit(good, arena, run, 1, sample_states())
        good.sock.settimeout(20)
        assert good.event()["op"] == "committed"
        assert good.request(p.Ping())["op"] == "pong"
    for i in range(2):   # the dropped peers' snapshots were still written
        store = RunStore(root, f"{run}h{i}")
        assert wait_for(lambda: store.read_pointer("LATEST") == SnapshotId(0, 1), 60)
    assert wait_for(lambda: daemon.text().count("read none of its replies") == 2, 10), \
        daemon.text()
    for peer in hostile:
        peer.close()


def test_a_frame_longer_than_the_protocol_allows_is_refused_at_its_prefix(harness):
    root = harness.root()
    daemon = harness.start(root)
    rss = psutil.Process(daemon.proc.pid).memory_info().rss
    for _ in range(8):
        with Peer(root, hello=True) as peer:
            peer.sock.settimeout(5)
            # One byte over the documented bound (docs/protocol.md, "Framing").
            peer.sock.sendall(struct.pack("<I", (64 << 20) + 1) + b"\x80" * 1024)
            assert hung_up(peer.sock), "the daemon kept reading the frame"
    assert "exceeds" in daemon.text()
    grew = psutil.Process(daemon.proc.pid).memory_info().rss - rss
    assert grew < 32 << 20, f"daemon RSS grew {grew >> 20} MiB"
    with Peer(root, hello=True) as peer:
        assert peer.request(p.Ping())["op"] == "pong"


def test_connections_beyond_the_cap_are_refused_and_silent_ones_dropped(harness):
    root = harness.root()
    daemon = harness.start(root, extra_env={"SNAPD_MAX_CONNECTIONS": "4",
                                            "SNAPD_HELLO_TIMEOUT": "1"})
    peers = [Peer(root, hello=True) for _ in range(4)]
    # The cap counts connections that said hello: the fifth hello is refused.
    extra = peer_mod.connect(root, timeout=10)
    p.send(extra, peer_mod.hello(), id=1)
    refusal = p.recv(extra)
    assert refusal["op"] == "error" and refusal["kind"] == "DaemonUnavailable"
    assert refusal["field"] == "max_connections" and refusal["path"].endswith(".snapd.sock")
    assert "already has 4 connections" in refusal["message"]
    assert hung_up(extra)
    extra.close()
    # A silent connection is not refused at the cap: it waits for its hello, and is
    # closed after hello_timeout, with nothing sent.
    silent = peer_mod.connect(root, timeout=10)
    assert hung_up(silent)
    silent.close()
    assert wait_for(lambda: "no hello within 1.0 s" in daemon.text(), 10), daemon.text()
    threads = psutil.Process(daemon.proc.pid).num_threads()
    assert threads < 4 * 2 + 16, f"{threads} threads for 4 connections"
    watcher = peers.pop()
    for peer in peers:
        peer.close()
    # Until the daemon has seen those close, a new hello is still over the cap.
    wait_until(lambda: len(watcher.request(p.Status())["status"]["clients"]) == 1, 60,
               "the daemon to see three peers gone")
    watcher.close()
    with Peer(root, hello=True) as peer:
        assert peer.request(p.Ping())["op"] == "pong"


TRAINER = textwrap.dedent("""
    import sys
    import torch
    from snapd_client import Client
    client = Client(sys.argv[1], sys.argv[2])
    client.track(model=torch.nn.Linear(4, 4))
    client.snapshot(1).wait()
    client.close()
    print("committed")
""")


def test_idle_connections_that_never_say_hello_do_not_lock_out_a_trainer(harness, tmp_path,
                                                                        warm):
    root, run = harness.root(), harness.run
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    # A hello_timeout longer than the test: the lobby, not the timeout, makes room.
    extra_env = {"SNAPD_HELLO_TIMEOUT": "300"}
    daemon = harness.start(root, extra_env=extra_env)
    idle = [idle_connection(root) for _ in range(200)]
    try:
        # a child of a warm parent (warm.py): no import of torch of its own
        trainer = warm["first"].run(str(script), [root, run], env=job_env(**extra_env),
                                    timeout=120)
        assert trainer.returncode == 0 and "committed" in trainer.stdout, \
            trainer.stderr[-3000:] + daemon.text()[-3000:]
        assert RunStore(root, run).read_pointer("LATEST") == SnapshotId(0, 1)
        # The lobby held the newest LOBBY_SIZE: the older ones were closed, oldest
        # first, as newer ones came in; the newest is still waiting for its hello.
        evicted = len(idle) - LOBBY_SIZE
        assert all(hung_up(sock) for sock in idle[:evicted])
        assert still_open(idle[-1]), "the newest idle connection was closed"
        proc = psutil.Process(daemon.proc.pid)
        assert proc.num_threads() < 16, f"{proc.num_threads()} threads"
        assert proc.num_fds() < LOBBY_SIZE + 64, f"{proc.num_fds()} descriptors"
        assert "already has" not in daemon.text()
    finally:
        for sock in idle:
            sock.close()


def test_a_peer_that_drips_its_hello_is_closed_at_hello_timeout(harness):
    root = harness.root()
    daemon = harness.start(root, extra_env={"SNAPD_HELLO_TIMEOUT": "2"})
    # A first frame announced at 4000 bytes, never finished: each byte comes well
    # within peer_timeout (30 s) of the one before, so only a deadline ends it.
    partial = struct.pack("<I", 4000) + b"\xa0" * 3999
    with peer_mod.connect(root, timeout=10) as sock:
        took = drip(sock, partial, every=0.05, give_up=2 + 10)
    assert 2 <= took < 2 + 4, f"closed after {took:.1f} s, hello_timeout is 2 s"
    assert wait_for(lambda: "no hello within 2.0 s" in daemon.text(), 10), daemon.text()
    with Peer(root, hello=True) as peer:
        assert peer.request(p.Ping())["op"] == "pong"


def test_a_peer_attaches_only_arenas_it_created(harness):
    root, run = harness.root(), harness.run
    harness.start(root)
    hot_arena = harness.arena(1 << 20, slots=2)
    with Peer(root, hello=True, run=run) as peer:   # the daemon now holds a hot copy
        hot_arena.attach(peer, run, hot=True)
        submit(peer, hot_arena, run, 1, sample_states())
        assert peer.event()["op"] == "committed"
        hot = peer.request(p.HotGet(run, 0))["shm"]
        assert hot and os.path.exists(f"/dev/shm/{hot}")
        size = os.path.getsize(f"/dev/shm/{hot}")
        # another process's arena name (pid 1); a fresh nonce: another suite may run
        other = f"snapd-{UID}-1-{secrets.token_hex(4)}"
        fd = os.open(f"/dev/shm/{other}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, 1 << 20)
            for name, nbytes in ((hot, size), (other, 1 << 20)):
                reply = peer.request(p.Attach(run, 0, name, nbytes, 1))
                assert reply["op"] == "error" and "created" in reply["message"], reply
        finally:
            os.close(fd)
            os.unlink(f"/dev/shm/{other}")
        assert os.path.exists(f"/dev/shm/{hot}")


# --- defect: a snapd/ folder in the trainer's working directory ------------------------

TRAINER_IN_CWD = textwrap.dedent("""
    import torch
    from snapd_client import Client
    client = Client("snapd", "r")          # the root is ./snapd, beside the script
    client.track(model=torch.nn.Linear(4, 4))
    client.snapshot(1).wait()
    client.close()
    print("committed")
""")


def test_a_snapd_folder_in_the_working_directory_does_not_shadow_the_daemon(tmp_path):
    (tmp_path / "snapd").mkdir()
    script = tmp_path / "train.py"
    script.write_text(TRAINER_IN_CWD)
    try:
        done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, timeout=120,
                              capture_output=True, text=True)
        assert done.returncode == 0 and "committed" in done.stdout, done.stderr
        assert os.path.isdir(tmp_path / "snapd" / "r" / "snapshots" / "00000001")
    finally:
        stop_daemons_under(str(tmp_path))


def test_a_daemon_that_cannot_start_fails_the_first_snapshot_naming_its_log(tmp_path):
    root = tmp_path / "root"
    (root / ".snapd.lock").mkdir(parents=True)   # the daemon cannot take its lock
    client = Client(str(root), "r")
    client.track(model=torch.nn.Linear(4, 4))
    start = time.monotonic()
    with pytest.raises(DaemonUnavailable) as failure:
        client.snapshot(1)
    assert type(failure.value).__name__ == "DaemonStartFailed"
    assert str(root / ".snapd.log") in str(failure.value)
    assert "cannot serve" in str(failure.value)   # the log's reason, quoted
    assert time.monotonic() - start < 60   # not the 120 s timeout; generous for load
    client.close()


def test_starting_the_daemon_leaves_no_child_process_running(tmp_path, recwarn):
    import gc
    gc.collect()      # what earlier tests left unclosed is not this test's to count
    recwarn.clear()
    root = str(tmp_path / "root")
    client = Client(root, "r")
    client.track(model=torch.nn.Linear(4, 4))
    try:
        client.snapshot(1).wait()
        gc.collect()
        assert not [w for w in recwarn.list if issubclass(w.category, ResourceWarning)]
        assert psutil.Process(client.daemon_pid).ppid() != os.getpid()
        client.close()
    finally:
        stop_daemons_under(str(tmp_path))


# --- defect: the hot copies of finished runs --------------------------------------------

class Blob:
    def __init__(self, nbytes: int) -> None:
        self.x = torch.randn(nbytes // 4)

    def state_dict(self):
        return {"x": self.x}

    def load_state_dict(self, state):
        self.x = state["x"].clone()


def hot_files(run: str) -> list:
    return glob.glob(f"/dev/shm/snapd-hot-{UID}-{run}-*")


@pytest.fixture
def runs():
    env = Env()
    yield env
    env.cleanup()
    for path in glob.glob(f"/dev/shm/snapd-hot-{UID}-{env.run}*"):
        os.unlink(path)


def snapshot_run(root: str, run: str, nbytes: int) -> Client:
    client = Client(root, run)
    client.track(blob=Blob(nbytes))
    client.snapshot(1).wait()
    return client


def hot_mappings(daemon: psutil.Process, run: str) -> list:
    """The daemon's mappings of this run's hot segments (unlinked ones included: a
    mapping, not a name, is what holds the memory)."""
    return [m.path for m in daemon.memory_maps(grouped=False)
            if f"snapd-hot-{UID}-{run}-" in m.path]


def test_a_clean_close_releases_the_hot_copy_and_its_memory(runs):
    # Mappings, not RSS: how much of a spare segment is resident depends on how far
    # its background fault-in got, which a loaded machine makes a race.
    daemon = None
    for i in range(3):
        run = f"{runs.run}{i}"
        client = snapshot_run(runs.root, run, 32 << 20)
        daemon = daemon or runs.daemon(client)
        assert len(hot_files(run)) == 1   # the arena, which holds the committed slot
        assert hot_mappings(daemon, run), "the committed snapshot has no hot copy"
        client.close()
        assert wait_for(lambda: not hot_files(run), 60), hot_files(run)
        assert wait_for(lambda: not hot_mappings(daemon, run), 60), hot_mappings(daemon, run)


def test_a_crashed_clients_hot_copy_lingers_then_is_released(runs, monkeypatch):
    monkeypatch.setenv("SNAPD_HOT_LINGER_SECONDS", "2")
    monkeypatch.setenv("SNAPD_ROOT_CHECK_SECONDS", "0.2")
    client = snapshot_run(runs.root, runs.run, 4 << 20)
    runs.daemon(client)
    close_as_if_killed(client)
    assert hot_files(runs.run), "a crashed trainer's hot copy is kept for a restart"
    again = Client(runs.root, runs.run)
    again.track(blob=Blob(4 << 20))
    assert again.restore() == 1 and again.restored_from == "hot"
    close_as_if_killed(again)
    assert wait_for(lambda: not hot_files(runs.run), 60), "kept past hot_linger_seconds"


def test_hot_copies_together_stay_under_hot_max_bytes(runs, monkeypatch):
    monkeypatch.setenv("SNAPD_HOT_MAX_BYTES", str(20 << 20))
    for i in range(3):
        close_as_if_killed(snapshot_run(runs.root, f"{runs.run}{i}", 8 << 20))
    held = sum(os.path.getsize(f) for f in glob.glob(f"/dev/shm/snapd-hot-{UID}-{runs.run}*"))
    assert held <= 20 << 20, f"{held} bytes of hot copies"
    assert hot_files(f"{runs.run}2"), "the newest run's copy is the one kept"


# --- arenas that no death leaves behind --------------------------------------------------

def test_no_arena_is_left_when_the_daemon_dies_before_the_trainer(runs):
    client = snapshot_run(runs.root, runs.run, 1 << 20)
    daemon = runs.daemon(client)
    daemon.kill()
    assert not wait_exited([daemon], 10)
    assert not glob.glob(f"/dev/shm/snapd-{UID}-{os.getpid()}-*")
    client.close()


def test_a_new_daemon_unlinks_arenas_of_dead_clients(harness):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    path = f"/dev/shm/snapd-{UID}-{dead.pid}-{secrets.token_hex(4)}"
    with open(path, "wb") as f:
        f.write(b"\0" * 4096)
    try:
        harness.start(harness.root())
        assert not os.path.exists(path)
    finally:
        if os.path.exists(path):
            os.unlink(path)
