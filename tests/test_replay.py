"""The replay check after a resume: what it names as the cause of a difference, how far
it checks (the furthest step the run reached, across a second kill), and
``verify_steps``: when the newest snapshot has nothing after it, resuming from the one
before so that steps are recomputed and checked. In-process clients (daemon=False):
the same log, restore and check as through the daemon, without a process."""

from __future__ import annotations

import itertools
import logging

import pytest
import torch

from snapd.errors import InvalidOption, ReplayDivergence
from snapd.logwriter import LogWriter
from snapd.options import Options
from snapd.progress import read_progress
from snapd.store import RunStore, SnapshotId
from snapd_client import Client
from snapd_client.journal import compare
from snapd_client.restore import verify_pick

RNG = {"python": 1, "numpy": 2, "torch": 3}


def step_record(step, loss=1.0):
    return {"kind": "step", "step": step, "time": 1000.0 + step, "cursor": None,
            "rng": dict(RNG), "scalars": {"loss": loss}}


# --- what a difference is blamed on ----------------------------------------------------

def test_a_scalar_difference_names_untracked_state_before_nondeterminism():
    old = step_record(7, loss=0.5)
    cause, detail = compare(old, step_record(7, loss=0.25))
    assert cause == "scalar:loss"  # the cause values stay as they were
    assert "untracked state" in detail and "prefetched batch" in detail
    for way in ("ckpt.values(", "ckpt.track_globals(", "ckpt.track(name=tensor)"):
        assert way in detail
    assert detail.index("untracked state") < detail.index("nondeterminism")


# --- a tiny training loop, in process ----------------------------------------------

class Loop:
    """A linear model trained on fixed data; ``carry`` is a value the loop keeps
    across steps (a hidden state), tracked or not."""

    def __init__(self, root, *, track_carry=True, number=None, **options):
        # number(update) is the step number logged and snapshotted after that update
        self.number = number or (lambda update: update)
        torch.manual_seed(0)
        self.model = torch.nn.Linear(3, 1)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05)
        self.carry = torch.zeros(())
        self.client = Client(root, "r", daemon=False, **options)
        self.client.track(model=self.model, optimizer=self.opt)
        if track_carry:
            self.client.track(carry=self)
        restored = self.client.restore()
        self.step = next(u for u in itertools.count() if self.number(u) >= restored)

    def state_dict(self):
        return {"carry": self.carry}

    def load_state_dict(self, state):
        self.carry = state["carry"].clone()

    def train(self, upto, snapshot_at=()):
        x = torch.linspace(0, 1, 12).reshape(4, 3)
        while self.step < upto:
            loss = ((self.model(x).squeeze() + self.carry - 1.0) ** 2).mean()
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            self.carry = 0.5 * self.carry + loss.detach()
            self.step += 1
            self.client.log(self.number(self.step), loss=loss.item())
            if self.step in snapshot_at:
                self.client.snapshot(self.number(self.step)).wait()
        return self

    def stop(self):
        """The process ends here as a kill would leave the run: the log holds every
        step logged, the snapshots every commit (close() only seals the log)."""
        self.client.close()


@pytest.fixture
def resume_lines(caplog):
    caplog.set_level(logging.INFO, logger="snapd_client.client")
    return lambda: [r.getMessage() for r in caplog.records if "resuming" in r.getMessage()]


# --- how far the check goes: the furthest step, across a second kill ------------------

def test_a_second_kill_during_the_recompute_keeps_the_furthest_step(tmp_path,
                                                                     resume_lines):
    root = str(tmp_path)
    Loop(root).train(9, snapshot_at=(5,)).stop()          # reached 9, killed
    second = Loop(root)
    assert second.step == 5
    second.train(7).stop()                                 # recomputing 6, 7: killed again
    assert read_progress(RunStore(root, "r")).reached == 7
    third = Loop(root)
    assert third.client.recovery.furthest == 9
    assert resume_lines()[-1].endswith(
        "resuming from step 5 (disk); training had reached 9; 4 logged steps will be "
        "recomputed and checked")
    third.train(9)
    verdict = third.client.journal.verdict
    assert verdict["verdict"] == "match" and verdict["to"] == 9 and verdict["checked"] == 4
    third.stop()


def test_furthest_follows_the_resume_record_and_a_warm_start_resets_it(tmp_path):
    store = RunStore(str(tmp_path), "r")
    store.ensure()
    with LogWriter(store.path, 0, flush_interval=None) as w:
        for step in range(1, 10):
            w.append(step_record(step))
        w.append({"kind": "resume", "mode": "resume", "step": 5, "reached": 9})
        w.append(step_record(6))
        w.append({"kind": "snapshot", "event": "committed", "step": 6, "name": "00000006",
                  "last_resume": {"kind": "resume", "mode": "resume", "step": 5,
                                  "reached": 9}})
        w.append(step_record(7))
    progress = read_progress(store)
    assert (progress.reached, progress.furthest) == (7, 9)
    with LogWriter(store.path, 0, flush_interval=None) as w:
        w.append({"kind": "resume", "mode": "warm_start", "step": 0})
        w.append(step_record(1))
    progress = read_progress(store)
    assert (progress.reached, progress.furthest) == (1, 1)


# --- a resume with nothing to recompute, and verify_steps ---------------------------

def test_a_resume_right_after_a_snapshot_states_facts_without_a_fix(tmp_path,
                                                                     resume_lines):
    """Killed right after snapshot 8 committed (or a finished run started again):
    nothing is wrong, so the line says what happened and asks nothing of the user."""
    Loop(str(tmp_path)).train(8, snapshot_at=(4, 8)).stop()
    loop = Loop(str(tmp_path))
    assert loop.step == 8 and loop.client.journal.verdict is None
    assert resume_lines() == [
        "run r: resuming from step 8 (disk); training had reached 8; nothing to recompute"]
    assert loop.client.journal.last_resume["recompute"] == 0
    loop.stop()


def test_a_loop_that_logs_no_step_is_told_nothing_is_checked(tmp_path, resume_lines):
    client = Client(str(tmp_path), "r", daemon=False)
    model = torch.nn.Linear(3, 1)
    client.track(model=model)
    assert client.restore() == 0
    client.snapshot(30).wait()
    client.close()
    again = Client(str(tmp_path), "r", daemon=False)
    again.track(model=model)
    assert again.restore() == 30
    assert resume_lines() == [
        "run r: resuming from step 30 (disk); the log holds no step record (log() is "
        "never called, or the log was lost), so nothing is checked"]
    again.close()


def test_steps_the_log_no_longer_holds_are_said_plainly(tmp_path, resume_lines):
    """The resume record says the run had reached 9; no step record after 5 is left."""
    root = str(tmp_path)
    Loop(root).train(5, snapshot_at=(5,)).stop()
    with LogWriter(RunStore(root, "r").path, 0, flush_interval=None) as w:
        w.append({"kind": "resume", "mode": "resume", "step": 5, "reached": 9})
    loop = Loop(root)
    assert resume_lines() == [
        "run r: resuming from step 5 (disk); training had reached 9; the log holds no "
        "step after 5 to check the recomputed ones against"]
    assert loop.client.journal.last_resume["recompute"] == 0
    loop.stop()


def test_with_the_replay_check_off_the_steps_are_recomputed_unchecked(tmp_path,
                                                                       resume_lines):
    root = str(tmp_path)
    Loop(root).train(9, snapshot_at=(5,)).stop()
    loop = Loop(root, replay_check="off")
    assert resume_lines() == [
        "run r: resuming from step 5 (disk); training had reached 9; 4 logged steps will "
        "be recomputed"]
    assert loop.client.journal.last_resume["recompute"] == 4
    loop.train(9)
    assert loop.client.journal.verdict is None
    loop.stop()


def test_a_log_behind_the_snapshot_is_said_plainly(tmp_path, resume_lines):
    """A loop that logs every few steps: the last logged step lies before the snapshot."""
    client = Client(str(tmp_path), "r", daemon=False)
    client.track(model=torch.nn.Linear(3, 1))
    assert client.restore() == 0
    client.log(3, loss=1.0)
    client.snapshot(5).wait()
    client.close()
    again = Client(str(tmp_path), "r", daemon=False)
    again.track(model=torch.nn.Linear(3, 1))
    assert again.restore() == 5
    assert resume_lines() == [
        "run r: resuming from step 5 (disk); the log's last step is 3, before this "
        "snapshot, so nothing is checked"]
    again.close()


def epoch_batch(update):
    """Step numbers as a script that numbers them ``epoch * 1000 + batch`` (ten
    batches an epoch) logs them: update 20 is 2009, update 25 is 3004."""
    return 0 if update == 0 else 1000 * ((update - 1) // 10 + 1) + (update - 1) % 10


def test_steps_numbered_by_epoch_and_batch_recompute_the_logged_steps(tmp_path,
                                                                      resume_lines):
    root = str(tmp_path)
    Loop(root, number=epoch_batch).train(25, snapshot_at=(20,)).stop()   # killed at 3004
    loop = Loop(root, number=epoch_batch)
    assert (loop.step, epoch_batch(loop.step)) == (20, 2009)
    assert resume_lines() == [
        "run r: resuming from step 2009 (disk); training had reached 3004; 5 logged "
        "steps will be recomputed and checked"]   # not 3004 - 2009 = 995
    assert loop.client.journal.last_resume["recompute"] == 5
    assert read_progress(RunStore(root, "r")).last_resume["recompute"] == 5
    loop.train(25)
    verdict = loop.client.journal.verdict
    assert (verdict["verdict"], verdict["from"], verdict["to"], verdict["checked"]) == \
        ("match", 2009, 3004, 5)
    assert "missing" not in verdict
    loop.stop()


def test_verify_steps_resumes_before_the_newest_snapshot_and_checks(tmp_path,
                                                                   resume_lines):
    root = str(tmp_path)
    Loop(root, keep_last=2).train(10, snapshot_at=(4, 8, 10)).stop()
    assert [s.step for s in RunStore(root, "r").committed()] == [8, 10]
    loop = Loop(root, verify_steps=3, keep_last=2)
    assert loop.step == 8 and loop.client.restored.passed_over == "00000010"
    (line,) = resume_lines()
    assert "training had reached 10; 2 logged steps will be recomputed and checked" in line
    assert "verify_steps=3: resumed before the newest snapshot, 00000010" in line
    loop.train(12, snapshot_at=(10, 12))
    verdict = loop.client.journal.verdict
    assert verdict["verdict"] == "match" and (verdict["from"], verdict["to"]) == (8, 10)
    assert verdict["checked"] == 2
    loop.stop()


def test_verify_steps_catches_a_value_left_untracked(tmp_path):
    Loop(str(tmp_path), track_carry=False).train(8, snapshot_at=(4, 8)).stop()
    loop = Loop(str(tmp_path), track_carry=False, verify_steps=4)
    assert loop.step == 4
    with pytest.raises(ReplayDivergence, match="untracked state") as e:
        loop.train(8)
    assert e.value.step == 5 and e.value.cause == "scalar:loss"  # the first recomputed
    loop.stop()


def test_verify_steps_too_small_for_the_snapshot_interval_says_so(tmp_path, resume_lines):
    Loop(str(tmp_path)).train(8, snapshot_at=(4, 8)).stop()
    loop = Loop(str(tmp_path), verify_steps=3)
    assert loop.step == 8
    assert resume_lines() == [
        "run r: resuming from step 8 (disk); training had reached 8; nothing to "
        "recompute, so nothing is checked: no snapshot of the run lies at most 3 steps "
        "before it (verify_steps=3). Fix: snapshots at most 3 steps apart with "
        "keep_last of 2 or more, or a larger verify_steps"]
    loop.stop()


def sids(*steps, lineage=0):
    return [SnapshotId(lineage, s) for s in steps]


@pytest.mark.parametrize("order,reached,k,pick", [
    (sids(10, 8, 4), 10, 3, 8),        # the newest older one within k
    (sids(10, 8, 4), 10, 6, 8),        # newest first, not the furthest back
    (sids(10, 8, 4), 10, 1, None),     # 8 is 2 steps back: more than k
    (sids(10, 8, 4), 10, 0, None),     # off
    (sids(10, 8, 4), 12, 5, None),     # steps after 10 are logged: a normal resume
    (sids(10, 8, 4), None, 5, None),   # no log: nothing to check against
    (sids(10, 8), 7, 5, None),         # the log ends before 8: nothing to check from 8
    (sids(10, 8, 4), 7, 6, 4),         # ... but from 4 (6 steps back, within k)
    (sids(10), 10, 5, None),           # nothing older
])
def test_verify_pick(order, reached, k, pick):
    got = verify_pick(order, reached, k)
    assert (got.step if got else None) == pick


def test_verify_pick_stays_in_the_newest_snapshots_lineage():
    order = [SnapshotId(1, 10), SnapshotId(0, 9), SnapshotId(1, 4)]
    assert verify_pick(order, 10, 7) == SnapshotId(1, 4)


def test_verify_steps_option():
    assert Options().verify_steps == 0
    assert Options.resolve(environ={"SNAPD_VERIFY_STEPS": "5"}).verify_steps == 5
    with pytest.raises(InvalidOption, match="verify_steps=-1"):
        Options(verify_steps=-1)
    with pytest.raises(InvalidOption, match="keep_last=2 or more") as e:
        Options(verify_steps=4, keep_last=1)
    assert e.value.field == "verify_steps"
    Options(verify_steps=4, keep_last=2)
