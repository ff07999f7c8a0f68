"""every="auto" under real SIGKILLs: a trainer that calls snapshot(step) at every step,
killed twice at random instants, restarted each time, never loses more than
max_loss seconds of training (plus one step: the cadence counts in steps), and ends
bit for bit equal to a run never interrupted.

The loss of each kill is read from the log alone: the time of the newest step record
before the kill, against the time the interrupted run logged the step the resume
starts from. The killed runs aim at a step they never reach; the last run trains to
a little past the furthest step reached, and the uninterrupted run, in this process
meanwhile, to the same step. Each trainer is started while the one before trains
and let go once it is killed (cadence_job.py): a restart costs no imports. Two kills,
not three: each life trains seconds, and the file's budget is about 20 s."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

from cadence_job import train
from harness import DaemonProc
from helpers import wait_until

from snapd import statelog

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cadence_job.py")
MAX_LOSS = 2.0
STEP_S = 0.05        # each step's simulated compute: 40 steps per interval
KILLS = 2
NEVER = 10 ** 9      # a step count the killed runs never reach
# The cadence of the killed runs. Their stall (a few ms) stays far under the overhead
# budget's floor even on a loaded machine, so max_loss sets the interval.
AUTO = {"every": "auto", "max_loss": MAX_LOSS, "overhead": 0.05}


def start(tmp_path, name: str, **cfg) -> subprocess.Popen:
    """The trainer as its own process, held until ``release``; output to a file (a
    pipe would block it)."""
    cfg = {"out": str(tmp_path / f"{name}.json"), "step_s": STEP_S, **cfg}
    env = {k: v for k, v in os.environ.items() if k != "SNAPD_DAEMON"}
    with open(tmp_path / f"{name}.log", "w") as f:
        proc = subprocess.Popen([sys.executable, JOB, json.dumps(cfg)], stdout=f,
                                stderr=subprocess.STDOUT, stdin=subprocess.PIPE, env=env)
    proc.name = name
    return proc


def release(proc: subprocess.Popen, **late) -> float:
    """Let a held trainer go, with ``late`` settings; when."""
    proc.stdin.write(json.dumps(late).encode() + b"\n")
    proc.stdin.close()
    return time.time()


def finish(tmp_path, proc: subprocess.Popen) -> dict:
    assert proc.wait(timeout=120) == 0, \
        (tmp_path / f"{proc.name}.log").read_text()[-3000:]
    return json.loads((tmp_path / f"{proc.name}.json").read_text())


def records(run_dir: str) -> list:
    return list(statelog.read_records(run_dir, 0))


def newest(run_dir: str, kind: str, **match) -> dict:
    found = statelog.last_record(run_dir, 0, lambda r: r.get("kind") == kind and all(
        r.get(k) == v for k, v in match.items()))
    return found or {}


def alive_and(tmp_path, proc: subprocess.Popen, cond) -> bool:
    assert proc.poll() is None, f"{proc.name} exited ({proc.returncode}):\n" \
        f"{(tmp_path / f'{proc.name}.log').read_text()[-3000:]}"
    return cond()


def kill_at_random(tmp_path, run_dir: str, proc: subprocess.Popen,
                   released: float) -> dict:
    """Let a released trainer commit a snapshot, then train a random 2.5 to 4 s more
    (past its second snapshot, max_loss's interval later, and up to the third); SIGKILL
    it. Its last step record, and its step time."""
    wait_until(lambda: alive_and(tmp_path, proc, lambda: newest(
        run_dir, "snapshot", event="committed").get("time", 0) > released),
        60, f"{proc.name}'s first commit")
    until = time.time() + random.uniform(2.5, 4.0)
    wait_until(lambda: alive_and(tmp_path, proc, lambda: newest(run_dir, "step").get(
        "time", 0) >= until), 60, f"{proc.name} to train on")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return {**newest(run_dir, "step"), "step_s": step_time(run_dir)}


def loss_of(run_dir: str, last: dict) -> float:
    """Seconds of training lost to the kill after ``last`` (the last step logged): to
    the step the newest resume started from, as the killed run logged it."""
    resumed = statelog.find_step(run_dir, 0, newest(run_dir, "resume")["step"])
    return last["time"] - resumed["time"]


def step_time(run_dir: str) -> float:
    """The median time between successive step records of the run's newest life."""
    times = [r["time"] for r in records(run_dir) if statelog.is_step(r)][-200:]
    return statistics.median(b - a for a, b in zip(times, times[1:]))


@contextlib.contextmanager
def as_its_own_process():
    """The uninterrupted run, in this process: it seeds the global RNG streams and
    trains on one thread as the trainer process does; both are put back after."""
    streams = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        random.setstate(streams[0]), np.random.set_state(streams[1])
        torch.set_rng_state(streams[2]), torch.set_num_threads(threads)


def test_killed_twice_it_loses_at_most_max_loss_and_ends_exact(tmp_path, env,
                                                              daemon_env):
    run_dir = os.path.join(env.root, env.run)
    daemon = DaemonProc(env.root, str(tmp_path / "daemon.log"), daemon_env)
    names = [f"life{n}" for n in range(KILLS)] + ["final"]
    trainers = [start(tmp_path, name, root=env.root, run=env.run, steps=NEVER,
                      options=AUTO) for name in names[:2]]
    env.pids.update(t.pid for t in trainers)   # their staging arenas: cleaned up after
    try:
        daemon.wait_ready()
        lost, last = [], None   # lost: (seconds lost, one step of the killed life)
        for life in range(KILLS):
            released = release(trainers[life])
            if life + 2 < len(names):   # the next one but one imports meanwhile
                trainers.append(start(tmp_path, names[life + 2], root=env.root,
                                      run=env.run, steps=NEVER, options=AUTO))
                env.pids.add(trainers[-1].pid)
            killed = kill_at_random(tmp_path, run_dir, trainers[life], released)
            if last is not None:   # this life resumed after the previous kill
                lost.append((loss_of(run_dir, last), last["step_s"]))
            last = killed
        # The last life, and meanwhile in this process the run never interrupted, to the
        # same step.
        steps = last["step"] + 30
        release(trainers[-1], steps=steps)
        with as_its_own_process():
            uninterrupted = train({"root": str(tmp_path / "whole"), "run": env.run,
                                   "steps": steps, "step_s": 0.0,
                                   "options": {"every": NEVER, "daemon": False}})
        assert finish(tmp_path, trainers[-1]) == uninterrupted
    finally:   # a held trainer let go by the end of this process would train on
        for trainer in trainers:
            trainer.kill()
            trainer.wait()
    lost.append((loss_of(run_dir, last), last["step_s"]))
    assert len(lost) == KILLS
    for seconds, one_step in lost:
        assert 0 <= seconds <= MAX_LOSS + one_step, lost
    # Until the run has been interrupted twice, M is a day and max_loss sets each
    # interval after a life's first (and its probe, when the first is durable before
    # max_loss calls for the next); the last life learned M from the two resumes
    # (seconds apart: Young/Daly's interval is then the shorter).
    cadence = [r for r in records(run_dir) if r.get("kind") == "cadence"]
    before = {r["bound"] for r in cadence if r["mtbf_from"] == "default"}
    assert {"first", "max_loss"} <= before <= {"first", "probe", "max_loss"}, cadence
    assert cadence[-1]["mtbf_from"] == "history"
