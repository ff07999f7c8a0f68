"""How long daemons live, and the commands that see and stop all of them, against
real processes: a daemon that keeps nothing exits after the short
``idle_bare_exit_seconds`` while one holding a crashed trainer's hot copy stays;
``snapd stop --all`` stops every daemon and nothing else; ``snapd status --daemons``
lists the live ones.

``snapd stop --all`` is always run here with ``--under`` this test's directory: the
machine running the tests may have other daemons of the same user (other test runs,
a developer's own) that a test must not stop.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest
import torch

from harness import Env, Peer, close_as_if_killed
from helpers import exited, wait_exited, wait_until
from snapd import protocol as p
from snapd.daemons import find_daemons
from snapd.names import SOCKET_NAME
from snapd_client import Client

pytestmark = pytest.mark.integration

BARE = 1.0      # idle_bare_exit_seconds in these tests (60 by default)
LINGER = 8.0    # hot_linger_seconds: long enough to see the holder stay past BARE,
#                 on a loaded machine too


def _snapd(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "snapd", *args], capture_output=True,
                          text=True, timeout=180)


def _status(root: str) -> dict:
    with Peer(root) as peer:
        reply = peer.request(p.Status())
    assert reply["op"] == "status_reply", reply
    return reply["status"]


def _log(root: str) -> str:
    with open(os.path.join(root, ".snapd.log"), errors="replace") as f:
        return f.read()


@pytest.fixture
def base():
    """A short directory (Unix socket paths are limited) holding this test's roots."""
    path = tempfile.mkdtemp(prefix="sdl-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def decoys():
    """decoys(argv) -> a process that only looks like something (it waits for its
    stdin to close); killed after the test."""
    started = []

    def start(*argv: str) -> subprocess.Popen:
        started.append(subprocess.Popen(
            [sys.executable, "-c", "import sys; sys.stdin.read()", *argv],
            stdin=subprocess.PIPE, start_new_session=True))
        return started[-1]

    yield start
    for proc in started:
        proc.kill()
        proc.wait(10)


def _trained_client(root: str, run: str) -> Client:
    client = Client(root, run)
    client.track(model=torch.nn.Linear(32, 32))
    client.snapshot(1).wait()
    return client


# --- snapd stop --all ------------------------------------------------------------------

def test_stop_all_stops_every_daemon_one_line_each_and_nothing_else(harness, base, decoys):
    roots = [os.path.join(base, name) for name in ("a", "b", "c", "gone", "never")]
    for root in roots:
        os.mkdir(root)
    a, b, c, gone, never = roots
    daemons = {root: harness.start(root) for root in (a, b, c)}
    # A root whose daemon was SIGKILLed: its lock file still names the dead pid.
    dead = harness.start(gone)
    dead.kill(signal.SIGKILL)
    dead.proc.wait(30)
    left_behind = sorted(os.listdir(gone))
    # Processes whose command lines read like daemons' but serve nothing: one names a
    # live daemon's root, one a root nobody serves.
    lookalikes = [decoys("-m", "snapd", "serve", "--root", a),
                  decoys("-m", "snapd", "serve", "--root", never)]

    done = _snapd("stop", "--all", "--under", base)

    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines == [f"stopped {root} (pid {daemons[root].proc.pid}): drained 0 "
                     "accepted snapshot(s)" for root in (a, b, c)], done.stdout
    for daemon in daemons.values():
        assert daemon.proc.wait(30) == 0   # a clean, drained exit
        assert not os.path.exists(os.path.join(daemon.root, SOCKET_NAME))
    assert [d.poll() for d in lookalikes] == [None, None], "a lookalike was stopped"
    assert sorted(os.listdir(gone)) == left_behind   # the dead daemon's root untouched
    again = _snapd("stop", "--all", "--under", base)
    assert again.returncode == 0, again.stderr
    assert again.stdout == f"no snapd daemon of this user is running under {base}; " \
        "nothing to stop\n"


def test_stop_all_refuses_a_root_and_under_goes_with_all(base):
    done = _snapd("stop", "--all", base)
    assert done.returncode == 2
    assert f"--all stops the daemon of every root: leave out ROOT ({base})" in done.stderr
    alone = _snapd("stop", "--under", base, base)
    assert alone.returncode == 2
    assert "--under DIR goes with --all" in alone.stderr


def test_daemons_of_another_user_are_never_found(harness, base):
    root = os.path.join(base, "mine")
    os.mkdir(root)
    daemon = harness.start(root)
    mine = [d for d in find_daemons() if d.root == root]
    assert [(d.pid, d.root) for d in mine] == [(daemon.proc.pid, root)]
    assert mine[0].rss > 0
    other = os.getuid() + 1
    assert [d for d in find_daemons(uid=other) if d.root == root] == []


# --- the shorter idle exit of a daemon that keeps nothing ------------------------------

def test_bare_daemon_exits_soon_while_one_holding_a_hot_copy_stays(env, monkeypatch):
    monkeypatch.setenv("SNAPD_IDLE_BARE_EXIT_SECONDS", str(BARE))
    monkeypatch.setenv("SNAPD_HOT_LINGER_SECONDS", str(LINGER))
    crashed_env = Env()
    try:
        crashed = _trained_client(crashed_env.root, crashed_env.run)
        holder = crashed_env.daemon(crashed)
        clean = _trained_client(env.root, env.run)
        bare = env.daemon(clean)
        close_as_if_killed(crashed)   # its hot copy is kept for a restart
        clean.close()                 # nothing kept: no restart will want it

        assert not wait_exited([bare], 60), "the daemon that keeps nothing stayed"
        assert "(idle_bare_exit_seconds): stopping" in _log(env.root)
        # The holder has been idle for several bare intervals, and stays: it keeps
        # today's rule, idle_exit_seconds (600 s).
        wait_until(lambda: _status(crashed_env.root)["idle_seconds"] > 3 * BARE, 60,
                   "the hot copy's holder to be idle for 3 bare intervals")
        status = _status(crashed_env.root)
        assert not exited(holder)
        assert status["hot_bytes"] > 0 and status["idle_limit_seconds"] == 600
        # Once hot_linger_seconds released the copy, it keeps nothing, and leaves.
        assert not wait_exited([holder], 60 + LINGER), "the holder never left"
        log = _log(crashed_env.root)
        assert log.index("(hot_linger_seconds)") < log.index("(idle_bare_exit_seconds)")
    finally:
        crashed_env.cleanup()


def test_a_daemon_started_by_hand_never_exits_on_idle(harness, base):
    root = os.path.join(base, "by-hand")
    os.mkdir(root)
    daemon = harness.start(root, extra_env={"SNAPD_IDLE_BARE_EXIT_SECONDS": str(BARE)})
    wait_until(lambda: _status(root)["idle_seconds"] > 3 * BARE, 60,
               "the daemon to be idle for 3 bare intervals")
    assert daemon.proc.poll() is None
    assert _status(root)["idle_limit_seconds"] == 0


# --- snapd status --daemons -----------------------------------------------------------

def test_status_lists_live_daemons_with_idle_time_and_memory(harness, base, env):
    by_hand = os.path.join(base, "by-hand")
    os.mkdir(by_hand)
    served = harness.start(by_hand)
    crashed = _trained_client(env.root, env.run)
    started = env.daemon(crashed)
    close_as_if_killed(crashed)
    gone = os.path.join(base, "gone")
    os.mkdir(gone)
    dead = harness.start(gone)
    dead.kill(signal.SIGKILL)
    dead.proc.wait(30)
    wait_until(lambda: _status(env.root)["idle_seconds"] > 0, 60, "an idle daemon")

    listed = _snapd("status", "--daemons", "--json")

    assert listed.returncode == 0, listed.stderr
    rows = {r["root"]: r for r in json.loads(listed.stdout)["daemons"]}
    assert gone not in rows
    hand, client = rows[by_hand], rows[env.root]
    assert (hand["pid"], client["pid"]) == (served.proc.pid, started.pid)
    assert hand["answering"] and hand["idle_limit_seconds"] == 0 and hand["rss"] > 0
    assert hand["clients"] == 0 and hand["hot_bytes"] == 0
    assert client["idle_limit_seconds"] == 600 and client["hot_bytes"] > 0
    assert client["idle_seconds"] > 0 and client["rss"] > 0
    table = _snapd("status", "--daemons")
    assert table.returncode == 0, table.stderr
    line = next(line for line in table.stdout.splitlines() if env.root in line)
    assert str(started.pid) in line and "after 10.0m idle" in line
    line = next(line for line in table.stdout.splitlines() if by_hand in line)
    assert str(served.proc.pid) in line and "never (idle exit off)" in line
    assert "resident (snapd stop --all stops them)" in table.stdout
