"""A resume's phases in the log, ``snapd status`` and ``snapd watch`` (started, ready
to train, optimizer state complete), the "set_aside" record that stops status from
counting a snapshot found damaged after restore(overlap=True) returned, and the one
exchange of ranks before the first update (overlaprestore.RankJoin, over a fake
collective; the real 2-rank job is tests/integration/test_overlap_ranks.py), and a
reshard with overlap (the real one: tests/integration/test_multirank.py)."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch

from helpers import (assert_equal, flip_byte, private_copy, read_manifest,
                     small_model_and_opt, text_of)
from snapd import liveview as view
from snapd import statelog
from snapd.commands import status
from snapd.errors import CorruptSnapshot
from snapd.progress import read_progress
from snapd.store import RunStore
from snapd_client import Client
from snapd_client.distrestore import _read_candidate, deferred_read
from snapd_client.overlaprestore import RankJoin, StepStateArrival
from snapd_client.restore import load_for_resume
from snapd_client.rng import RngStreams


def make(root: str):
    model, opt = small_model_and_opt()
    client = Client(root, "r", daemon=False)
    client.track(model=model, optimizer=opt)
    return model, opt, client


def step(model, opt) -> None:
    opt.zero_grad()
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> str:
    """A run with snapshots at steps 3 and 6."""
    root = str(tmp_path_factory.mktemp("phases"))
    model, opt, client = make(root)
    for n in range(1, 7):
        step(model, opt)
        client.log(n, loss=1.0)
        if n % 3 == 0:
            client.snapshot(n)
    client.close()
    return root


@pytest.fixture
def root(trained, tmp_path) -> str:
    return private_copy(trained, tmp_path)


def records(root: str, kind: str) -> list:
    found = [r for r in statelog.newest_first(os.path.join(root, "r"), 0)
             if r.get("kind") == kind]
    return found[::-1]


def status_text(root: str) -> str:
    return text_of(status.render(status.collect(root)), 200)


def watch_text(root: str) -> str:
    return text_of(view.render(view.collect(root, None), 200), 200)


def test_a_resume_with_overlap_logs_each_phase_and_status_and_watch_show_them(root):
    model, opt, client = make(root)
    assert client.restore(overlap=True) == 6
    pending = read_progress(RunStore(root, "r")).resume_phases
    assert pending["overlap"] is True and pending["state"] == "pending"
    assert pending["optimizer_state"] is None
    assert "optimizer state pending" in status_text(root)
    step(model, opt)
    client.log(7, loss=1.0)
    client.snapshot(7)   # its commit record carries the resume, with "restored"
    client.close()

    resume, = [r for r in records(root, "resume") if r.get("overlap")]
    restored, = records(root, "restored")
    assert resume["called"] <= resume["time"] <= restored["time"]
    assert restored["objects"] == ["optimizer"] and restored["snapshot"] == "00000006"
    assert restored["step"] == 6 and restored["waited_s"] >= 0
    progress = read_progress(RunStore(root, "r"))
    assert progress.last_resume["restored"] == restored["time"]   # from the commit record
    phases = progress.resume_phases
    assert phases == {"overlap": True, "started": resume["called"], "ready": resume["time"],
                      "optimizer_state": restored["time"], "state": "complete",
                      "ready_s": resume["time"] - resume["called"],
                      "complete_s": restored["time"] - resume["called"]}
    row, = status.collect(root)
    assert row["resume_phases"] == phases
    said = f"ready {phases['ready_s']:.2f}s, optimizer state {phases['complete_s']:.2f}s"
    assert f"from 00000006 (resume; {said})" in status_text(root)
    assert f"r r0: resumed from 00000006 (resume, 0 to recompute; {said})" in watch_text(root)


def test_a_resume_without_overlap_is_ready_with_its_optimizer_state(root):
    model, opt, client = make(root)
    assert client.restore() == 6
    client.close()
    resume = records(root, "resume")[-1]
    assert "overlap" not in resume and not records(root, "restored")
    phases = read_progress(RunStore(root, "r")).resume_phases
    assert phases["overlap"] is False and phases["state"] == "complete"
    assert phases["optimizer_state"] == phases["ready"] == resume["time"]
    text = status_text(root)
    assert f"ready {phases['ready_s']:.2f}s)" in text and "optimizer state" not in text


def damage_optimizer(root: str, snapshot: str) -> str:
    path = os.path.join(root, "r", "snapshots", snapshot)
    entry = read_manifest(path)["objects"]["optimizer"]
    flip_byte(os.path.join(path, entry["file"]), entry["tensors"][0]["chunks"][0][0])
    return os.path.join(path, entry["file"])


def test_a_set_aside_snapshot_no_longer_counts_in_status(root):
    damage_optimizer(root, "00000006")
    model, opt, client = make(root)
    assert client.restore(overlap=True) == 6
    with pytest.raises(CorruptSnapshot):
        step(model, opt)
    client.close()

    aside, = records(root, "set_aside")
    assert aside["snapshot"] == "00000006" and aside["by"] == 0
    assert aside["said"].startswith("00000006 is set aside as ")
    progress = read_progress(RunStore(root, "r"))
    # The log's last commit record names 00000006; the set-aside record outweighs it.
    assert progress.set_aside == ["00000006"] and progress.committed.name == "00000003"
    assert progress.at_risk == 3 and progress.resume_phases["state"] == "failed"
    row, = status.collect(root)
    assert row["committed"] == "00000003" and row["committed_step"] == 3
    assert "optimizer state FAILED (set aside)" in status_text(root)
    assert "FAILED (set aside)" in watch_text(root)


def test_a_snapshot_committed_again_under_that_name_counts_again(root):
    damage_optimizer(root, "00000006")
    model, opt, client = make(root)
    client.restore(overlap=True)
    with pytest.raises(CorruptSnapshot):
        step(model, opt)
    client.close()
    model, opt, client = make(root)
    assert client.restore() == 3
    for n in range(4, 7):
        step(model, opt)
        client.log(n, loss=1.0)
    client.snapshot(6)   # the same name, committed after the set-aside record
    client.close()
    progress = read_progress(RunStore(root, "r"))
    assert progress.set_aside == [] and progress.committed.name == "00000006"


# --- the ranks' one exchange before the first update ------------------------------------

class FakeRanks:
    """Rank 0 of 2; rank 1 answers ``theirs``. Counts the exchanges."""

    rank, world_size = 0, 2

    def __init__(self, theirs: dict) -> None:
        self.theirs, self.calls = theirs, []

    def broadcast_bytes(self, data, src=0):   # not used by the join
        raise AssertionError("the join only all-gathers")

    def allgather_bytes(self, data: bytes):
        self.calls.append(json.loads(data))
        return [data, json.dumps(self.theirs).encode()]


def arrival(root: str, ranks: FakeRanks, logged: list):
    model, opt = small_model_and_opt()
    tracked = {"model": model, "optimizer": opt}
    loaded = load_for_resume(RunStore(root, "r"), tracked, RngStreams(), data_version=None,
                             need_cursor=False, defer=["optimizer"])
    model.load_state_dict(loaded.states["model"])

    class Journal:
        def restored(self, **fields):
            logged.append(("restored", fields))

        def set_aside(self, **fields):
            logged.append(("set_aside", fields))

    marks: list = []

    def mark(sid):
        marks.append(sid.name)
        return f"marked {sid.name}"

    made = StepStateArrival(loaded, tracked, mark, join=RankJoin(ranks), journal=Journal())
    made.marks = marks
    return model, opt, made


def test_another_ranks_damage_stops_this_ranks_first_step_with_no_update(root):
    other = os.path.join(root, "r", "snapshots", "00000006", "rank-00001", "optimizer.x")
    ranks = FakeRanks({"ok": False, "corrupt": True, "message": f"{other}: chunk 0 "
                       "checksum mismatch", "path": other, "field": "objects.optimizer"})
    logged: list = []
    model, opt, _ = arrival(root, ranks, logged)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    for _ in range(2):   # sticky: one exchange, every later step raises the same
        with pytest.raises(CorruptSnapshot) as caught:
            step(model, opt)
        assert caught.value.path == other and caught.value.field == "objects.optimizer"
        assert str(caught.value) == (
            "restore(overlap=True): the optimizer state of snapshot 00000006 failed on "
            f"another rank (rank 1: {other}: chunk 0 checksum mismatch). No update was "
            "applied on any rank: optimizer.step() refuses to run on partly restored "
            "state. Rank 1 sets 00000006 aside, so the next start of every rank resumes "
            "from an older snapshot. Restart the job")
    assert ranks.calls == [{"ok": True}]
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    assert logged == [("set_aside", {"snapshot": "00000006", "by": 1, "said": (
        "Rank 1 sets 00000006 aside, so the next start of every rank resumes from an "
        "older snapshot")})]


def test_on_many_ranks_the_damage_is_set_aside_after_the_exchange(root):
    """Not while the other ranks may still read the snapshot's files it moves."""
    damage_optimizer(root, "00000006")
    ranks = FakeRanks({"ok": True})
    logged: list = []
    model, opt, made = arrival(root, ranks, logged)
    made._thread.join()   # the read has failed; nothing is set aside yet
    assert made.marks == []
    with pytest.raises(CorruptSnapshot) as caught:
        step(model, opt)
    assert made.marks == ["00000006"] and len(ranks.calls) == 1
    assert ranks.calls[0]["corrupt"] is True and ranks.calls[0]["ok"] is False
    assert "No update was applied on any rank" in str(caught.value)
    assert "marked 00000006" in str(caught.value) and logged == []


def test_every_rank_whole_applies_the_state_after_one_exchange(root):
    ranks = FakeRanks({"ok": True})
    logged: list = []
    model, opt, made = arrival(root, ranks, logged)
    step(model, opt)
    step(model, opt)
    assert made.complete and ranks.calls == [{"ok": True}]
    assert all(int(s["step"]) == 8 for s in opt.state.values())   # step 6's, plus two
    assert [kind for kind, _ in logged] == ["restored"]
    assert logged[0][1]["objects"] == ["optimizer"]


def test_a_reshard_with_overlap_leaves_the_moments_to_the_background_read(root):
    """The run's snapshots are of one rank; restored on 2 ranks (rank 1 here), with
    overlap: restore reads the param_groups only, and the background read is what a
    reshard without overlap reads."""
    model, opt = small_model_and_opt()
    client = SimpleNamespace(store=RunStore(root, "r"), rank=1, rng=RngStreams(),
                             _tracked={"model": model, "optimizer": opt},
                             data_version=None, _stream=None, _keys=None)
    loaded, parts = _read_candidate(client, "00000006", set(), 2, {"optimizer"})
    assert (loaded.mode, loaded.old_world_size, loaded.deferred) == \
        ("reshard", 1, ("optimizer",))
    assert loaded.states["optimizer"]["state"] == {} and "model" in loaded.states
    later = deferred_read(parts, 1, client._tracked, loaded.deferred)()
    whole, _ = _read_candidate(client, "00000006", set(), 2, set())
    assert whole.deferred == ()
    assert_equal(later["optimizer"], whole.states["optimizer"], "optimizer")
