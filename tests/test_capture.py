"""The frozen capture, the plan built complete from it, and the handle built complete.

The daemon's side of the hand-off is a stand-in connection: what the client stages,
describes and submits is read from it; no daemon is started.
"""

from __future__ import annotations

import dataclasses
import logging
import threading

import pytest
import torch

from snapd import protocol as proto
from snapd.options import Options
from snapd.plan import ObjectPlan, SnapshotPlan, TensorSource, from_descriptor
from snapd.store import RunStore, SnapshotId
from snapd_client import Client
from snapd_client.capture import Capture, tensor_bytes
from snapd_client.handle import SnapshotHandle
from snapd_client.handoff import Handoff


def tracked(client: Client):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()   # the moments exist
    client.track(model=model, optimizer=opt)
    return model, opt


@pytest.fixture
def client(tmp_path):
    c = Client(str(tmp_path), "r", "v1", daemon=False)
    yield c
    c.close()


def test_a_capture_is_complete_at_construction(client):
    model, opt = tracked(client)
    cap = client.capture(7, metric=2)
    assert (cap.run, cap.step, cap.rank, cap.data_version) == ("r", 7, 0, "v1")
    assert cap.metric == 2.0 and isinstance(cap.metric, float)
    assert cap.sid == SnapshotId(0, 7) and cap.cursor is None
    assert set(cap.rng) == set(client.rng.capture())
    assert [o.name for o in cap.objects] == ["model", "optimizer"]
    # Every tensor leaf of each state_dict, the live tensor itself (not a copy).
    model_leaves = dict(zip(cap.objects[0].paths, cap.objects[0].tensors))
    for key, t in model.state_dict().items():
        assert model_leaves[f".{key}"].data_ptr() == t.data_ptr()
    assert len(cap.tensors) == len(model_leaves) + len(cap.objects[1].tensors)
    assert len(cap.deferrable) == len(cap.tensors)
    assert any(path.startswith(".state.") for path in cap.objects[1].paths)


def test_a_capture_is_frozen(client):
    tracked(client)
    cap = client.capture(1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cap.step = 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        cap.objects[0].deferrable = (True,)
    with pytest.raises(TypeError):
        cap.lineage["id"] = 9
    with pytest.raises(TypeError):
        cap.rng["torch"] = b""
    assert all(isinstance(x, tuple) for x in (cap.objects, cap.tensors, cap.objects[0].paths,
                                               cap.objects[0].tensors))
    # The client's own state moves on; the capture does not.
    client.lineage["id"] = 5
    assert cap.lineage["id"] == 0 and cap.sid.lineage == 0


@pytest.mark.parametrize("mode", ["wait", "overlap"])
def test_overlap_mode_defers_only_what_optimizer_step_changes(tmp_path, mode, monkeypatch):
    # No daemon: track()'s warm-up would start one (an integration test's business).
    monkeypatch.setattr("snapd_client.handoff.Handoff.warm_up", lambda self, need: None)
    c = Client(str(tmp_path), "r", daemon=True, mode=mode)
    try:
        model, _ = tracked(c)
        cap = c.capture(1)
        deferred = {f"{o.name}{path}" for o in cap.objects
                    for path, d in zip(o.paths, o.deferrable) if d}
    finally:
        c.close()
    if mode == "wait":
        assert deferred == set()
        return
    params = {f"model.{n}" for n, _ in model.named_parameters()}
    assert params <= deferred   # weights and biases, the BatchNorm's affine pair
    assert not any(".running_" in d or "num_batches" in d for d in deferred)  # buffers
    assert {d for d in deferred if d.startswith("optimizer")} == {
        f"optimizer{path}" for path in cap.objects[1].paths if path.startswith(".state.")}


def test_the_plan_is_built_complete_and_frozen(client):
    tracked(client)
    cap = client.capture(3, metric=1.5)
    plan = cap.plan_in_memory()
    assert (plan.run, plan.step, plan.metric, plan.sid) == ("r", 3, 1.5, cap.sid)
    assert plan.lineage == dict(cap.lineage) and plan.rng == dict(cap.rng)
    for obj, cobj in zip(plan.objects, cap.objects):
        assert [t.path for t in obj.tensors] == list(cobj.paths)
        for t, live in zip(obj.tensors, cobj.tensors):
            assert bytes(t.data) == bytes(tensor_bytes(live))
            assert t.dtype == str(live.dtype).removeprefix("torch.")
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.objects[0].tensors = []
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.step = 4


def test_a_plan_knows_its_size_after_its_buffers_are_released():
    """The writer's buffers are views of memory it does not own; once released, the
    plan (the daemon's status reads it) still says how many bytes it holds."""
    view = memoryview(bytearray(48))
    plan = SnapshotPlan("r", 1, {"id": 0}, [ObjectPlan("w", "T", b"\x90",
                        [TensorSource(".x", "float32", [12], view)])], {})
    view.release()
    assert plan.nbytes == 48 and plan.objects[0].tensors[0].nbytes == 48


def test_the_in_process_handle_is_built_complete(client):
    tracked(client)
    rng = client.rng.capture()
    handle = client.snapshot(4)
    assert handle.wait().sid == SnapshotId(0, 4)
    assert handle.sid == SnapshotId(0, 4) and handle.rng == rng and handle.cursor is None
    assert handle.result.bytes_written > 0
    assert not hasattr(handle, "plan_state") and not hasattr(handle, "mark_reported")


def test_a_handle_takes_what_it_needs_at_construction():
    waited = []

    def waiter(event: threading.Event) -> None:
        waited.append(event)
        handle.set_error(OSError("disk gone"))

    handle = SnapshotHandle(9, sid=SnapshotId(1, 9), rng={"torch": b"s"},
                            cursor={"epoch": 2}, waiter=waiter, stall_seconds=0.5)
    assert (handle.sid, handle.rng, handle.cursor, handle.stall_seconds) == (
        SnapshotId(1, 9), {"torch": b"s"}, {"epoch": 2}, 0.5)
    with pytest.raises(Exception, match="disk gone"):
        handle.wait()
    assert len(waited) == 1


class StandInConnection:
    """What Handoff needs of a daemon connection; records what it is sent."""

    lost = None
    daemon_pid = 4242

    def __init__(self) -> None:
        self.sent: list = []
        self.waits: list = []
        self.during_wait = lambda: None   # what the daemon sends while one waits

    def request(self, message):
        assert isinstance(message, proto.Attach)
        return proto.Ok()

    def send_request(self, message, on_reply) -> None:
        self.sent.append(message)

    def wait_for(self, event, what) -> None:
        self.waits.append(what)
        self.during_wait()

    def check(self, what, since=0.0) -> None:
        pass

    def close(self) -> None:
        pass


def plan_contents(plan: SnapshotPlan) -> dict:
    """Every field of a plan, each tensor's bytes included, in comparable values."""
    def tensor(t):
        return {f.name: bytes(t.data) if f.name == "data" else getattr(t, f.name)
                for f in dataclasses.fields(t)}
    fields = {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)}
    fields["objects"] = [{f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
                         | {"tensors": [tensor(t) for t in obj.tensors]}
                         for obj in plan.objects]
    return fields


@pytest.mark.parametrize("mode", ["wait", "overlap"])
def test_the_hand_off_stages_describes_and_submits_the_capture(client, tmp_path, mode):
    model, _ = tracked(client)
    cap = client.capture(6, metric=0.25)
    handoff = Handoff(RunStore(str(tmp_path), "r"), 0, Options(mode=mode))
    handoff.conn = conn = StandInConnection()
    try:
        handle = handoff.snapshot(cap)
        handoff.drain()   # the submit is the stager thread's
        assert (handle.sid, handle.rng, handle.cursor) == (cap.sid, dict(cap.rng), None)
        [submit] = conn.sent
        assert (submit.run, submit.step, submit.slot) == ("r", 6, 0)
        desc = submit.plan
        assert (desc["step"], desc["metric"], desc["rng"]) == (6, 0.25, dict(cap.rng))
        # The daemon's plan, rebuilt from the descriptor over the slot, is the capture's.
        slot = memoryview(handoff.arena.view(0, 0, handoff.arena.slot_bytes).numpy())
        assert plan_contents(from_descriptor(desc, slot)) == \
            plan_contents(cap.plan_in_memory())
        for obj, cobj in zip(desc["objects"], cap.objects):
            for t, live in zip(obj["tensors"], cobj.tensors):
                staged = handoff.arena.view(0, t["offset"], t["nbytes"]).numpy().tobytes()
                assert staged == bytes(tensor_bytes(live)), t["path"]
        conn.during_wait = lambda: handoff._on_event(
            proto.Committed("r", 0, 6, 0, cap.sid.name, 123, 0.5))
        assert handle.wait().bytes_written == 123
        assert conn.waits == ["the commit of step 6"]   # the waiter watches the daemon
        assert handoff._inflight == {}   # the event freed the slot
    finally:
        handoff.close()


def test_the_restore_lines_go_through_logging(client, capsys):
    tracked(client)
    client.snapshot(1).wait()
    client.restore("warm_start")
    assert "snapd: run r: warm start (lineage 1) from 00000001" in capsys.readouterr().err
    logger = logging.getLogger("snapd_client")
    level = logger.level
    logger.setLevel(logging.WARNING)   # an application silencing the resume lines
    try:
        client.restore("warm_start")
    finally:
        logger.setLevel(level)
    assert "warm start" not in capsys.readouterr().err


def test_a_capture_can_be_built_directly():
    cap = Capture(run="r", step=2, rank=1, lineage={"id": 3}, data_version=None,
                  metric=None, rng={}, cursor={"epoch": 1}, objects=[])
    assert cap.sid == SnapshotId(3, 2) and cap.tensors == () and cap.objects == ()
    assert cap.record_state() == ({}, {"epoch": 1})
