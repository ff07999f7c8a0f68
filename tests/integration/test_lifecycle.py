"""The daemon's lifecycle against real processes: a daemon a client started exits by
itself once idle (no trainer connected, nothing in flight, the linger passed), and not
before; ``snapd stop ROOT`` drains and waits for the exit; ``snapd watch`` started
before its root exists waits for it.
"""

from __future__ import annotations

import fcntl
import glob
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch

from harness import Peer, close_as_if_killed, sample_states, submit
from helpers import stop_daemons_under, wait_for, wait_until
from snapd import protocol as p
from snapd.names import ROOT_LOCK_NAME, SOCKET_NAME
from snapd.store import RunStore, SnapshotId
from snapd_client import Client

pytestmark = pytest.mark.integration

LINGER = 1.0   # idle_exit_seconds in these tests (600 by default)
UID = os.getuid()


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _stays_up(pid: int, seconds: float) -> bool:
    """The process is still running after ``seconds`` (polled: it may exit any time)."""
    return not wait_for(lambda: _gone(pid), timeout=seconds, interval=0.05)


def _lock_free(root: str) -> bool:
    fd = os.open(os.path.join(root, ROOT_LOCK_NAME), os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def _assert_released(root: str) -> None:
    """What a clean stop leaves: no socket, the lock free."""
    assert not os.path.exists(os.path.join(root, SOCKET_NAME))
    assert _lock_free(root)


def _hot_copies(run: str) -> list:
    return glob.glob(f"/dev/shm/snapd-hot-{UID}-{run}-*")


def _snapd(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "snapd", *args], capture_output=True,
                          text=True, timeout=180, **kwargs)


@pytest.fixture
def idle_linger(monkeypatch):
    """Daemons started by a Client in this test exit after LINGER idle seconds."""
    monkeypatch.setenv("SNAPD_IDLE_EXIT_SECONDS", str(LINGER))


GATED = os.path.join(os.path.dirname(__file__), "gated_daemon.py")


class Served:
    """A foreground daemon of ROOT and its log file: ``snapd serve --root ROOT ARGS``,
    or (``gate``) the gated daemon, whose writes wait until ``open_gate()``."""

    def __init__(self, root: str, log: str, env: dict, args, gate: str = "") -> None:
        self.log, self.gate = log, gate
        argv = [GATED, root, gate, *args] if gate else ["-m", "snapd", "serve",
                                                         "--root", root, *args]
        with open(log, "ab") as f:
            self.proc = subprocess.Popen([sys.executable, *argv], stdout=f, stderr=f,
                                         env=env, start_new_session=True)
        wait_until(lambda: os.path.exists(os.path.join(root, SOCKET_NAME)), 60,
                   "the daemon's socket")

    def text(self) -> str:
        with open(self.log, errors="replace") as f:
            return f.read()

    def wait_writing(self) -> None:
        """Until a write is in flight (it waits at the gate)."""
        wait_until(lambda: os.path.exists(self.gate + ".waiting"), 60, "a write to start")

    def open_gate(self) -> None:
        open(self.gate, "w").close()


@pytest.fixture
def serve(tmp_path, daemon_env):
    """serve(root, *args) -> a Served daemon; serve(root, *args, gated=True) -> one whose
    writes wait for its gate. Killed after the test if still running."""
    started = []

    def start(root: str, *args: str, gated: bool = False) -> Served:
        n = len(started)
        started.append(Served(root, str(tmp_path / f"serve-{n}.log"), daemon_env, args,
                              gate=str(tmp_path / f"gate-{n}") if gated else ""))
        return started[-1]

    yield start
    for served in started:
        if served.gate:
            served.open_gate()
        if served.proc.poll() is None:
            served.proc.kill()
        served.proc.wait(10)


# --- exit when idle ---------------------------------------------------------------------

def test_client_started_daemon_exits_once_idle_and_not_before(env, idle_linger):
    model = torch.nn.Linear(16, 16)
    client = Client(env.root, env.run)
    client.track(model=model)
    client.snapshot(1).wait()
    daemon = env.daemon(client)
    assert _stays_up(daemon.pid, 3 * LINGER), "exited with a trainer connected"
    close_as_if_killed(client)   # a crashed trainer: its hot copy is kept for a restart
    assert _hot_copies(env.run)
    # A trainer restarting within the linger finds the same daemon and keeps it.
    with Peer(env.root, hello=True, run=env.run) as peer:
        assert peer.request(p.Ping())["pid"] == daemon.pid
        assert _stays_up(daemon.pid, 3 * LINGER), "exited with a trainer connected"
    left = time.monotonic()
    wait_until(lambda: _gone(daemon.pid), 60, "the idle daemon to exit")
    assert time.monotonic() - left >= LINGER, "exited before the linger passed"
    _assert_released(env.root)
    assert _hot_copies(env.run) == []
    with open(os.path.join(env.root, ".snapd.log")) as f:
        assert "idle_exit_seconds" in f.read()
    # The next client simply starts a new daemon.
    client = Client(env.root, env.run)
    client.track(model=model)
    assert client.restore() == 1
    client.snapshot(2).wait()
    assert env.daemon(client).pid != daemon.pid
    client.close()


def test_idle_exit_waits_for_a_snapshot_in_flight(harness, serve):
    root, run = harness.root(), harness.run
    daemon = serve(root, str(LINGER), gated=True)   # exits after LINGER idle seconds
    arena = harness.arena(1 << 20)
    with Peer(root, hello=True, run=run) as peer:
        arena.attach(peer, run)
        submit(peer, arena, run, 1, sample_states())
        daemon.wait_writing()
    # No client from here on, and the write is held at the gate: the daemon stays.
    assert _stays_up(daemon.proc.pid, 3 * LINGER), "exited with a write in flight"
    daemon.open_gate()
    assert daemon.proc.wait(60) == 0
    assert RunStore(root, run).read_pointer("LATEST") == SnapshotId(0, 1)
    log = daemon.text()   # idle only once the write was done
    assert log.index("committed run") < log.index("idle_exit_seconds")
    _assert_released(root)


# --- snapd stop ---------------------------------------------------------------------

def test_stop_drains_the_snapshot_in_flight_then_the_daemon_exits(harness, serve):
    root, run = harness.root(), harness.run
    daemon = serve(root, gated=True)   # by hand: it never exits on idle
    arena = harness.arena(1 << 20)
    store = RunStore(root, run)
    with Peer(root, hello=True, run=run) as peer:
        arena.attach(peer, run)
        submit(peer, arena, run, 1, sample_states())
        daemon.wait_writing()
        stop = subprocess.Popen([sys.executable, "-m", "snapd", "stop", root],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_until(lambda: "asked the daemon to stop" in daemon.text(), 60, "the stop")
        daemon.open_gate()
        event = peer.event()   # the drain still tells the connected trainer
        assert event["op"] == "committed" and event["step"] == 1, event
    out, err = stop.communicate(timeout=180)
    assert stop.returncode == 0, err
    assert f"stopping the daemon (pid {daemon.proc.pid}) serving {root}: finishing 1 " \
        "accepted snapshot(s)" in out
    assert f"stopped (pid {daemon.proc.pid})" in out
    assert daemon.proc.wait(10) == 0
    assert store.read_pointer("LATEST") == SnapshotId(0, 1)
    _assert_released(root)


def _draining(harness, serve) -> tuple:
    """(root, run, daemon): a gated daemon that was sent SIGTERM with one write held
    at its gate: it accepts no one and holds the root's lock until the gate opens."""
    root, run = harness.root(), harness.run
    daemon = serve(root, gated=True)
    arena = harness.arena(1 << 20)
    with Peer(root, hello=True, run=run) as peer:
        arena.attach(peer, run)
        submit(peer, arena, run, 1, sample_states())
        daemon.wait_writing()
    daemon.proc.send_signal(signal.SIGTERM)   # drains: no longer accepts, lock held
    wait_until(lambda: "stopping: finishing 1" in daemon.text(), 60, "the drain")
    return root, run, daemon


def test_stop_waits_for_a_daemon_already_stopping(harness, serve):
    root, run, daemon = _draining(harness, serve)
    stop = subprocess.Popen([sys.executable, "-m", "snapd", "stop", root],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = _first_line(stop, 60)   # it has met the stopping daemon, and now waits
    daemon.open_gate()
    out, err = stop.communicate(timeout=180)
    assert stop.returncode == 0, err
    assert f"the daemon (pid {daemon.proc.pid}) serving {root} is already stopping" \
        in first and f"stopped (pid {daemon.proc.pid})" in out
    assert RunStore(root, run).read_pointer("LATEST") == SnapshotId(0, 1)
    assert daemon.proc.wait(10) == 0


def test_a_trainer_arriving_while_the_daemon_stops_gets_the_next_one(harness, serve):
    """The old daemon holds the lock while it drains and accepts no one: the daemon
    the client starts exits 2, and the client tries again until one serves."""
    root, run, daemon = _draining(harness, serve)
    # The gate opens once the client has met the stopping daemon (its own daemon was
    # refused the root), so the retry is what gets it served.
    refused = threading.Thread(target=_open_when_refused, args=(root, daemon), daemon=True)
    refused.start()
    client = Client(root, "next")
    try:
        client.track(model=torch.nn.Linear(4, 4))
        client.snapshot(1).wait()
        assert client.daemon_pid != daemon.proc.pid
        assert daemon.proc.poll() == 0   # the new one served only once the old had gone
        client.close()
    finally:
        refused.join(60)
        stop_daemons_under(root)


def _first_line(proc: subprocess.Popen, timeout: float) -> str:
    """The first line ``proc`` prints (click.echo flushes each line), within timeout."""
    lines: "queue.Queue[str]" = queue.Queue()
    threading.Thread(target=lambda: lines.put(proc.stdout.readline()), daemon=True).start()
    return lines.get(timeout=timeout)


def _open_when_refused(root: str, daemon: Served) -> None:
    log = os.path.join(root, ".snapd.log")
    wait_for(lambda: os.path.exists(log) and "already serves root" in open(log).read(), 60)
    daemon.open_gate()


def test_stop_without_a_daemon_says_so(harness, serve):
    root = harness.root()
    done = _snapd("stop", root)
    assert done.returncode == 0 and f"no daemon is serving {root}" in done.stdout
    daemon = serve(root)
    daemon.proc.kill()   # dead: its socket file stays behind, nobody listens
    daemon.proc.wait(10)
    assert os.path.exists(os.path.join(root, SOCKET_NAME))
    done = _snapd("stop", root)
    assert done.returncode == 0 and f"no daemon is serving {root}" in done.stdout
    missing = _snapd("stop", os.path.join(root, "nope"))
    assert missing.returncode == 2 and "no such directory" in missing.stderr


# --- snapd watch on a root that is not there yet ---------------------------------------

def _lines(stream, into: queue.Queue) -> None:
    for line in stream:
        into.put(line)


def _next_line_with(lines: queue.Queue, text: str, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError(f"no line with {text!r} within {timeout} s") from None
        if text in line:
            return line


def test_watch_waits_for_a_root_that_does_not_exist_yet(tmp_path):
    root = str(tmp_path / "later")
    watch = subprocess.Popen([sys.executable, "-m", "snapd", "watch", root,
                              "--interval", "0.2"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    out, err = queue.Queue(), queue.Queue()
    for stream, into in ((watch.stdout, out), (watch.stderr, err)):
        threading.Thread(target=_lines, args=(stream, into), daemon=True).start()
    try:
        _next_line_with(err, f"waiting for {root} to appear")
        assert watch.poll() is None
        client = Client(root, "late", daemon=False)   # the trainer creates the root
        client.log(1, loss=0.5)
        client.close()
        assert "loss=0.5" in _next_line_with(out, "run=late rank=0 step=1")
    finally:
        watch.terminate()
        watch.wait(10)
