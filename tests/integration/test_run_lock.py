"""One writer per run and rank, read-only restore beside a live run, and restore after
a kill that left a snapshot being written: real trainer processes, the real daemon.

The three tests that need a live run (a trainer holding it, waiting on stdin) get
theirs from one module fixture, which starts the three side by side (a root each)
and waits until every one is ready: a trainer is slow to start (torch, the daemon).
The trainers that read no stdin are children forked by the warm parents (warm.py, the
``warm`` fixture), which have imported torch already: a restart by another parent
than the run it restarts.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading

import psutil
import pytest
import torch

from snapd import statelog
from snapd.errors import DaemonUnavailable
from snapd.reader import SnapshotReader
from snapd.progress import read_progress
from snapd.store import RunStore
from snapd_client import Client, SnapshotWarning

from harness import Env
from helpers import wait_until

pytestmark = pytest.mark.integration

HEADER = textwrap.dedent("""\
    import json, os, signal, sys
    import torch
    from snapd_client import Client

    class Blob:
        def __init__(self, n, seed):
            self.x = torch.randn(n, generator=torch.Generator().manual_seed(seed))
        def state_dict(self):
            return {"x": self.x}
        def load_state_dict(self, state):
            self.x = state["x"].clone()

    root, run, out = sys.argv[1:4]
    def report(**fields):
        with open(out, "w") as f:
            json.dump(fields, f)
""")

# Holds the run: snapshots 1, logs 1..3, says so, waits for a line on stdin, then
# snapshots 3 and closes.
LIVE_TRAINER = HEADER + textwrap.dedent("""\
    client = Client(root, run)
    client.track(blob=Blob(1024, 1))
    for step in (1, 2, 3):
        client.log(step, loss=float(step))
        if step == 1:
            client.snapshot(1).wait()
    print("ready", flush=True)
    sys.stdin.readline()
    client.snapshot(3).wait()
    client.close()
""")

SECOND_TRAINER = HEADER + textwrap.dedent("""\
    from snapd_client import RunInUse
    try:
        Client(root, run)
    except RunInUse as e:
        report(kind="RunInUse", message=str(e), path=e.path, holder=e.holder)
    else:
        report(kind=None)
""")

EVALUATOR = HEADER + textwrap.dedent("""\
    client = Client(root, run, read_only=True)
    blob = Blob(1024, 99)
    client.track(blob=blob)
    step = client.restore()
    try:
        client.log(step + 1, loss=0.0)
        refused = None
    except RuntimeError as e:
        refused = str(e)
    client.close()
    report(step=step, x=blob.x.tolist()[:4], refused=refused)
""")

# Snapshot 1 (small), then a slow one (zstd 19 on incompressible data), SIGKILL as
# soon as the daemon has accepted it.
KILLED_TRAINER = HEADER + textwrap.dedent("""\
    from snapd import protocol as proto
    from snapd_client.connection import DaemonConnection
    client = Client(root, run, compression=19)
    blob = Blob(1024, 1)
    client.track(blob=blob)
    client.snapshot(1).wait()
    blob.x = Blob(int(sys.argv[4]), 2).x
    client.log(2, loss=2.0)
    client.snapshot(2)
    probe = DaemonConnection(root, run, 0, 30.0, spawn=False)
    while not any(w["run"] == run and w["step"] == 2
                  for w in probe.request(proto.Status()).status["in_flight"]):
        pass
    report(x=blob.x[:4].tolist())
    os.kill(os.getpid(), signal.SIGKILL)
""")

RESTARTED_TRAINER = HEADER + textwrap.dedent("""\
    client = Client(root, run, compression=19)
    blob = Blob(int(sys.argv[4]), 3)
    client.track(blob=blob)
    step = client.restore()
    x = blob.x[:4].tolist()
    error = None
    try:
        client.snapshot(step).wait()   # the recomputed step saved again
        client.close()
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    report(step=step, x=x, error=error)
""")

SLOW = 8 << 20   # float32 elements: 32 MB, several seconds at zstd level 19


def script(tmp_path, name: str, text: str) -> str:
    path = tmp_path / f"{name}.py"
    path.write_text(text)
    return str(path)


def run_warm(parent, env: Env, path: str, out, *extra: str, timeout: float = 120):
    """``path`` run to its end by a child of ``parent``: (exit status, its stderr)."""
    stderr = f"{out}.stderr"
    proc = parent.start(path, [env.root, env.run, str(out), *extra], None, f"{out}.stdout",
                        stderr)
    try:
        proc.wait(timeout)
    finally:
        proc.kill()
        proc.wait()
    with open(stderr) as f:
        return proc.returncode, f.read()


def run_script(parent, env: Env, path: str, out, *extra: str,
               timeout: float = 120) -> dict:
    returncode, stderr = run_warm(parent, env, path, out, *extra, timeout=timeout)
    assert returncode == 0, stderr
    return json.loads(out.read_text())


def log_bytes(env: Env) -> dict:
    base = RunStore(env.root, env.run).log_path
    found = {}
    for dirpath, _dirs, files in os.walk(base):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as f:
                found[os.path.relpath(os.path.join(dirpath, name), base)] = f.read()
    return found


def log_records(env: Env) -> list:
    """Every record of rank 0 but the writer's own sync marks."""
    return [r for path in statelog.list_segments(RunStore(env.root, env.run).path, 0)
            for r in statelog.scan_segment(path)[0]]


LIVE_TESTS = ("refused", "lock_dies", "evaluator")


@pytest.fixture(scope="module")
def lives(tmp_path_factory):
    """name -> (Env, live trainer): for each of LIVE_TESTS a root and run held by a
    live trainer that has snapshotted 1 and logged 1..3 (LIVE_TRAINER), ready."""
    tmp = tmp_path_factory.mktemp("live")
    path = script(tmp, "live", LIVE_TRAINER)
    # the real daemon: this module fixture runs before the function-scoped one that
    # lifts the unit lane's SNAPD_DAEMON=0 (tests/conftest.py)
    env_vars = {k: v for k, v in os.environ.items() if k != "SNAPD_DAEMON"}
    started = {}
    try:
        for name in LIVE_TESTS:
            env = Env()
            live = subprocess.Popen([sys.executable, path, env.root, env.run,
                                     str(tmp / f"{name}.json")], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, text=True, env=env_vars)
            env.pids.add(live.pid)
            started[name] = (env, live)
        for env, live in started.values():
            assert live.stdout.readline().strip() == "ready"
            env.daemons.add(env.lock_pid())
        yield started
    finally:
        for env, live in started.values():
            live.kill()
            live.wait(30)
        # each daemon drains before it exits: the three stop at once
        stopping = [threading.Thread(target=env.cleanup) for env, _ in started.values()]
        for thread in stopping:
            thread.start()
        for thread in stopping:
            thread.join()


def finish_live(live: subprocess.Popen) -> None:
    live.stdin.write("go\n")
    live.stdin.flush()
    assert live.wait(60) == 0


def assert_log_intact(env: Env, reached: int) -> None:
    plan = read_progress(RunStore(env.root, env.run), 0)
    assert plan.reached == reached
    steps = []
    for path in statelog.list_segments(RunStore(env.root, env.run).path, 0):
        records, scan = statelog.scan_segment(path)
        assert scan.valid_end == scan.size, scan     # no torn or foreign bytes
        steps += [r["step"] for r in records if r["kind"] == "step"]
    assert steps == list(range(1, reached + 1))      # one writer: in order, once each


def test_a_second_trainer_on_a_live_run_is_refused_and_the_first_is_intact(lives, tmp_path,
                                                                          warm):
    env, live = lives["refused"]
    second = run_script(warm["first"], env, script(tmp_path, "second", SECOND_TRAINER),
                        tmp_path / "second.json")
    assert second["kind"] == "RunInUse"
    assert second["holder"] == live.pid
    assert second["path"].endswith(f"{env.run}/.writer-00000.lock")
    assert f"process {live.pid}" in second["message"] and "read_only=True" in second["message"]
    finish_live(live)
    store = RunStore(env.root, env.run)
    assert [s.name for s in store.committed()] == ["00000001", "00000003"]
    for sid in store.committed():
        SnapshotReader(store.snapshot_path(sid)).verify()
    assert_log_intact(env, reached=3)


def test_the_lock_dies_with_its_holder_so_a_restart_is_never_refused(lives):
    env, live = lives["lock_dies"]
    live.kill()
    live.wait(30)
    with Client(env.root, env.run) as again:   # at once: the kernel dropped the lock
        again.track(blob=torch.nn.Linear(1, 1))
        assert again.read_only is False


def test_a_read_only_evaluator_restores_a_live_run_and_writes_nothing(lives, tmp_path,
                                                                      warm):
    env, live = lives["evaluator"]
    before, records = log_bytes(env), log_records(env)
    seen = run_script(warm["first"], env, script(tmp_path, "eval", EVALUATOR),
                      tmp_path / "eval.json")
    after = log_bytes(env)
    assert after.keys() == before.keys()
    for name, data in before.items():        # only appended to, by the live run's
        assert after[name].startswith(data)  # flush thread (its sync marks)
    assert log_records(env) == records
    assert seen["step"] == 1
    expected = torch.randn(1024, generator=torch.Generator().manual_seed(1))[:4]
    assert seen["x"] == expected.tolist()
    assert "read-only" in seen["refused"]
    finish_live(live)                        # the live run goes on as if alone
    assert_log_intact(env, reached=3)
    assert RunStore(env.root, env.run).read_pointer("LATEST").name == "00000003"


def test_kill_right_after_snapshot_returns_then_restart_resumes_at_that_step(env, tmp_path,
                                                                           warm):
    returncode, stderr = run_warm(warm["first"], env,
                                  script(tmp_path, "killed", KILLED_TRAINER),
                                  tmp_path / "k.json", str(SLOW))
    assert returncode == -signal.SIGKILL, stderr
    env.daemons.add(env.lock_pid())
    store = RunStore(env.root, env.run)
    assert store.read_pointer("LATEST").name == "00000001"   # step 2 still being written
    restarted = run_script(warm["resumed"], env,
                           script(tmp_path, "restart", RESTARTED_TRAINER),
                           tmp_path / "r.json", str(SLOW))
    assert restarted["step"] == 2
    assert restarted["x"] == json.loads((tmp_path / "k.json").read_text())["x"]
    assert restarted["error"] is None        # snapshot(2) again: kept as committed
    assert [s.name for s in store.committed()] == ["00000001", "00000002"]
    assert store.read_pointer("LATEST").name == "00000002"


def test_a_hung_daemon_leaves_the_outcome_unknown_and_latest_tells(env):
    client = Client(env.root, env.run, compression=19, timeout=2.0)
    blob = torch.nn.Linear(1, 1)
    client.track(blob=blob)
    client.snapshot(1).wait()
    daemon = psutil.Process(client.daemon_pid)
    env.daemons.add(daemon.pid)
    blob.weight = torch.nn.Parameter(torch.randn(SLOW // 4, 1))
    handle = client.snapshot(2)
    store = RunStore(env.root, env.run)
    wait_until(lambda: any(store.tmp_dirs()), 30, "the write of step 2 to start")
    daemon.suspend()                       # alive, silent, mid-write
    try:
        with pytest.raises(DaemonUnavailable, match="outcome unknown") as lost:
            handle.wait()
        assert handle.outcome_unknown and "LATEST will tell" in str(lost.value)
    finally:
        daemon.resume()
    # The message was right not to say "failed": the daemon finishes the write.
    wait_until(lambda: store.read_pointer("LATEST").name == "00000002", 60, "LATEST")
    SnapshotReader(store.snapshot_path(store.read_pointer("LATEST"))).verify()
    # close() looks again: the directory says step 2 committed after all.
    with pytest.warns(SnapshotWarning, match="outcome of step\\(s\\) 2 is unknown"):
        summary = client.close()
    assert summary.committed == (1, 2) and summary.failed == ()
