"""Losing the node (issue 16): a trainer with the remote tier on is SIGKILLed, its
daemon too, and its node's root deleted; the job restarted on a new root resumes from
the remote, bit for bit the uninterrupted run, and the replay check (on the replicated
log) matches the steps it recomputes. The trainers are children forked by the warm
parents (warm.py, the ``warm`` fixture): the resume by another parent than the runs
it is compared with."""

from __future__ import annotations

import json
import os
import shutil
import signal

from helpers import stop_daemons_under, wait_until
from snapd.remote.layout import RemoteRoot
from snapd.store import SnapshotId

TRAINER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "trainer.py")
STEPS, CUT, DIED = 12, 5, 9   # snapshot at CUT, the first process is killed after DIED


def start_trainer(parent, base, name, **cfg):
    """The trainer as a child of ``parent``, in this process's environment now."""
    out = os.path.join(base, f"{name}.json")
    cfg = {"out": out, "steps": STEPS, "model": "momentum", "workers": 0,
           "loader_generator": True, **cfg}
    stdout, stderr = (os.path.join(base, f"{name}.{s}") for s in ("stdout", "stderr"))
    proc = parent.start(TRAINER, [json.dumps(cfg)], None, stdout, stderr)
    return proc, out, cfg.get("sigkill"), stderr


def finish_trainer(started):
    proc, out, sigkill, stderr_file = started
    try:
        proc.wait(timeout=300)
    finally:
        proc.kill()
        proc.wait()
    with open(stderr_file) as f:
        stderr = f.read()
    killed = sigkill and proc.returncode == -signal.SIGKILL
    assert proc.returncode == 0 or killed, stderr[-3000:]
    with open(out) as f:
        return json.load(f), stderr


def run_trainer(parent, base, name, **cfg):
    return finish_trainer(start_trainer(parent, base, name, **cfg))


def remote_log_caught_up(remote, root, run):
    """Every local log segment has its replica, at its size."""
    local = os.path.join(root, run, "log")
    for dirpath, _, names in os.walk(local):
        for n in names:
            rel = os.path.relpath(os.path.join(dirpath, n), local)
            try:
                size = remote.fs.size(f"{remote.log_path(run)}/{rel}")
            except FileNotFoundError:
                return False
            if size != os.path.getsize(os.path.join(dirpath, n)):
                return False
    return True


def test_a_job_that_lost_its_node_resumes_from_the_remote(tmp_path, s3_env, monkeypatch,
                                                         warm):
    monkeypatch.setenv("SNAPD_REMOTE_LOG_INTERVAL", "0.2")
    base = str(tmp_path)
    url = s3_env.url()
    remote = RemoteRoot(url)
    options = {"daemon": True, "remote": url}
    node_a = os.path.join("/tmp", f"snapd-a-{os.getpid()}-{tmp_path.name[-8:]}")
    node_b = os.path.join("/tmp", f"snapd-b-{os.getpid()}-{tmp_path.name[-8:]}")
    try:
        # the uninterrupted run (no daemon, a root of its own) beside the first one
        whole = start_trainer(warm["first"], base, "whole", root=os.path.join(base, "plain"),
                              run="r", options={"daemon": False})
        first = start_trainer(warm["first"], base, "first", root=node_a, run="r",
                              stop=DIED, snapshot_at=[CUT], sigkill=True, options=options)
        (whole, _), (first, _) = finish_trainer(whole), finish_trainer(first)
        wait_until(lambda: SnapshotId(0, CUT) in remote.commits("r"), 60,
                   "the remote commit of the snapshot at CUT")
        wait_until(lambda: remote_log_caught_up(remote, node_a, "r"), 60,
                   "the replicated state log")
        stop_daemons_under(node_a)
        shutil.rmtree(node_a)   # the node is gone, with its disk
        second, stderr = run_trainer(warm["resumed"], base, "second", root=node_b, run="r",
                                     options=options)
    finally:
        for node in (node_a, node_b):
            stop_daemons_under(node)
            shutil.rmtree(node, ignore_errors=True)
    assert first["trace"] == whole["trace"][:DIED]
    assert second["restored_from"] == "remote"
    assert f"resuming from step {CUT} (remote)" in stderr
    assert second["trace"] == whole["trace"][CUT:], "the resumed steps differ"
    assert second["final"] == whole["final"]
    replay = second["replay"]
    assert replay["verdict"] == "match" and replay["checked"] == DIED - CUT, replay
