"""What a resume says, through the real daemon: where the tensors came from, and when a
restore that could have read the daemon's hot copy read the files, why, in the resume
line and in the daemon's log (``<root>/.snapd.log``).

The trainers are Clients in this process (a "kill" is a hang-up without ``bye``:
harness.close_as_if_killed); real scripts SIGKILLed and resumed hot are
test_real_scripts.py's.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

from snapd import protocol as p
from snapd_client import Client
from snapd_client.connection import LOG_NAME

from harness import Peer, close_as_if_killed, stop
from helpers import flip_byte

pytestmark = pytest.mark.integration


@pytest.fixture
def resume_lines(caplog):
    caplog.set_level(logging.INFO, logger="snapd_client.client")
    return lambda: [r.getMessage() for r in caplog.records if "resuming" in r.getMessage()]


def make_model(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 4)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def train(client: Client, model, opt, steps, snapshot_at=()) -> None:
    for step in steps:
        loss = model(torch.ones(2, 8)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        client.log(step, loss=loss.item())
        if step in snapshot_at:
            client.snapshot(step).wait()


def trained(env, upto: int, snapshot_at, close=close_as_if_killed, **options) -> int:
    """A trainer that logged steps 1..upto and snapshotted ``snapshot_at`` through the
    daemon, then ended with ``close``; the daemon's pid."""
    model, opt = make_model()
    client = Client(env.root, env.run, **options)
    client.track(model=model, optimizer=opt)
    assert client.restore() == 0
    train(client, model, opt, range(1, upto + 1), snapshot_at)
    pid = env.daemon(client).pid
    close(client)
    return pid


def restarted(env, **options) -> Client:
    model, opt = make_model(seed=1)
    client = Client(env.root, env.run, **options)
    client.track(model=model, optimizer=opt)
    client.restore()
    return client


def daemon_log(env) -> str:
    with open(os.path.join(env.root, LOG_NAME)) as f:
        return f.read()


def test_a_kill_right_after_a_snapshot_resumes_hot_with_nothing_to_recompute(
        env, resume_lines):
    trained(env, 3, snapshot_at=(3,))
    again = restarted(env)
    assert resume_lines() == [f"run {env.run}: resuming from step 3 (hot); training had "
                              "reached 3; nothing to recompute"]
    assert again.not_hot is None and again.journal.last_resume["recompute"] == 0
    again.close()


def test_a_finished_run_started_again_says_its_hot_copy_was_released(env, resume_lines):
    trained(env, 3, snapshot_at=(2, 3), close=Client.close)
    again = restarted(env)
    why = "the hot copy of 00000003 was released: its client closed cleanly"
    assert resume_lines() == [f"run {env.run}: resuming from step 3 (disk; not hot: "
                              f"{why}); training had reached 3; nothing to recompute"]
    assert again.journal.last_resume["not_hot"] == why
    again.close()
    assert f"run '{env.run}' rank 0: no hot copy to restore from: {why}\n" in \
        daemon_log(env)


def test_steps_the_log_holds_are_what_a_resume_recomputes(env, resume_lines):
    """Steps numbered epoch * 1000 + batch: 2009 -> 3004 is five logged steps."""
    numbers = [1000 + b for b in range(10)] + [2000 + b for b in range(10)] + \
        [3000 + b for b in range(5)]
    trained_steps = numbers[:25]
    model, opt = make_model()
    client = Client(env.root, env.run)
    client.track(model=model, optimizer=opt)
    client.restore()
    train(client, model, opt, trained_steps, snapshot_at=(2009,))
    env.daemon(client)
    close_as_if_killed(client)
    again = restarted(env)
    assert resume_lines() == [f"run {env.run}: resuming from step 2009 (hot); training "
                              "had reached 3004; 5 logged steps will be recomputed and "
                              "checked"]
    assert again.journal.last_resume["recompute"] == 5
    again.close()


def test_a_copy_of_another_step_than_the_restore_chose_is_not_read(env, resume_lines):
    """verify_steps=2 resumes from step 2, before the newest, which the daemon holds."""
    trained(env, 4, snapshot_at=(2, 4), keep_last=2)
    again = restarted(env, verify_steps=2, keep_last=2)
    assert resume_lines() == [f"run {env.run}: resuming from step 2 (disk; not hot: the "
                              "daemon holds step 4, the restore chose step 2); training "
                              "had reached 4; 2 logged steps will be recomputed and "
                              "checked (verify_steps=2: resumed before the newest "
                              "snapshot, 00000004, to check them)"]
    again.close()


def test_a_hot_copy_that_fails_its_checksum_is_named(env, resume_lines):
    trained(env, 2, snapshot_at=(2,))
    with Peer(env.root, hello=True) as peer:
        reply = peer.request(p.HotGet(env.run, 0))
    weight = next(t for o in reply["plan"]["objects"] if o["name"] == "model"
                  for t in o["tensors"] if t["path"] == ".weight")
    flip_byte(f"/dev/shm/{reply['shm']}", weight["offset"])
    again = restarted(env)
    assert resume_lines() == [f"run {env.run}: resuming from step 2 (disk; not hot: a "
                              "tensor of model in the hot copy did not match its "
                              "checksum); training had reached 2; nothing to recompute"]
    again.close()


def test_a_daemon_started_after_the_snapshots_says_it_holds_none(env, resume_lines):
    stop(trained(env, 2, snapshot_at=(2,)))
    again = restarted(env)   # track()'s warm-up starts a new daemon
    (line,) = resume_lines()
    assert line.startswith(f"run {env.run}: resuming from step 2 (disk; not hot: the "
                           "daemon serving the root (pid ")
    assert line.endswith(") has committed no snapshot of this run and rank; 00000002 was "
                         "written before it started); training had reached 2; nothing "
                         "to recompute")
    again.close()
    assert "has committed no snapshot of this run and rank; 00000002 was written " \
           "before it started\n" in daemon_log(env)


def test_a_read_only_restore_with_no_daemon_says_so(env, caplog):
    stop(trained(env, 2, snapshot_at=(2,)))
    caplog.set_level(logging.INFO, logger="snapd_client.client")
    model, opt = make_model(seed=1)
    reader = Client(env.root, env.run, read_only=True)
    reader.track(model=model, optimizer=opt)
    assert reader.restore() == 2
    assert f"run {env.run}: restored step 2 (disk; not hot: no daemon is serving the " \
           "root), read-only: nothing is written to the run" in caplog.text
    reader.close()
