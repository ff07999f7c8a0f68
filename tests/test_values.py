"""Loop values, tensors and globals tracked directly (snapd_client/values.py), through
a Client writing in-process: restored where the script reads them, checked before
anything is touched."""

from __future__ import annotations

import pytest
import torch

from snapd.errors import IncompatibleState, InvalidOption
from snapd.reader import SnapshotReader
from snapd.store import RunStore
from snapd_client import Client
from snapd_client.restore import restore_order
from snapd_client.values import Names, TrackedTensor, Values


def client(root):
    return Client(str(root), "run", daemon=False)


def snapshot_and_close(ckpt, step=3):
    ckpt.snapshot(step).wait()
    ckpt.close()


def test_a_tensor_is_restored_in_place(tmp_path):
    t = torch.arange(4.0, requires_grad=True)
    snapshot_and_close(client(tmp_path).track(t=t))
    same, ptr = t, t.data_ptr()
    with torch.no_grad():
        t.zero_()
    assert client(tmp_path).track(t=t).restore() == 3
    assert same is t and t.data_ptr() == ptr and t.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_a_tensor_of_another_shape_is_refused_before_anything_is_restored(tmp_path):
    model = torch.nn.Linear(2, 2)
    snapshot_and_close(client(tmp_path).track(model=model, t=torch.zeros(3)))
    before = [p.clone() for p in model.parameters()]
    with torch.no_grad():
        model.weight.add_(1)
    changed = [p.clone() for p in model.parameters()]
    with pytest.raises(IncompatibleState) as e:
        client(tmp_path).track(model=model, t=torch.zeros(4)).restore()
    assert e.value.field == "objects.t"
    assert "float32[3]" in str(e.value) and "float32[4]" in str(e.value)
    assert all(torch.equal(p, c) for p, c in zip(model.parameters(), changed))
    assert not all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_a_list_is_restored_in_place(tmp_path):
    history = [1.5, "a", None]
    snapshot_and_close(client(tmp_path).track(history=history))
    kept = history
    history.clear()
    client(tmp_path).track(history=history).restore()
    assert kept is history and history == [1.5, "a", None]


def test_a_number_is_refused_with_the_two_homes(tmp_path):
    with pytest.raises(TypeError) as e:
        client(tmp_path).track(best_val_loss=1e9)
    assert "ckpt.values(best_val_loss=...)" in str(e.value)
    assert "track_globals('best_val_loss')" in str(e.value)


def test_values_are_restored_including_tensors_and_later_keys(tmp_path):
    ckpt = client(tmp_path)
    loop = ckpt.values(best_val_loss=1e9, lr=0.1, hidden=None)
    loop.lr /= 4
    loop.hidden = (torch.ones(2), torch.zeros(2))  # None when tracked, a tensor now
    loop.added_later = [1, 2]
    snapshot_and_close(ckpt)
    ckpt = client(tmp_path)
    loop = ckpt.values(best_val_loss=1e9, lr=0.1, hidden=None)
    assert ckpt.restore() == 3
    assert loop.lr == 0.025 and loop.best_val_loss == 1e9 and loop.added_later == [1, 2]
    assert isinstance(loop.hidden, tuple) and torch.equal(loop.hidden[0], torch.ones(2))


def test_values_refuse_reserved_names():
    loop = Values(lr=1)
    with pytest.raises(AttributeError):
        loop.state_dict = 3
    with pytest.raises(AttributeError):
        loop._private = 3
    with pytest.raises(AttributeError, match="no loop value 'missing'"):
        loop.missing


def run_module(code, ns):
    exec(compile(code, "<script>", "exec"), ns)  # ns is the script's module globals


def test_globals_that_do_not_exist_yet_are_fine(tmp_path):
    model = torch.nn.Linear(2, 1)
    script = {"ckpt": client(tmp_path), "model": model, "iter_num": 0}
    # X does not exist when tracked; later it does; Y never does
    ns = {"torch": torch, **script}
    run_module("ckpt.track_globals('model', 'X', 'Y', 'iter_num')\n"
               "X, iter_num = torch.ones(3), 7\n", ns)
    assert isinstance(ns["ckpt"]._tracked["model"], torch.nn.Linear)  # an object: by itself
    snapshot_and_close(ns["ckpt"])
    fresh = {"ckpt": client(tmp_path), "model": model, "Y": "made before restore"}
    run_module("ckpt.track_globals('model', 'X', 'Y', 'iter_num')\nckpt.restore()\n", fresh)
    assert torch.equal(fresh["X"], torch.ones(3)) and fresh["iter_num"] == 7
    assert "Y" not in fresh  # absent at snapshot time: absent after restore


def test_attributes_of_an_object_are_tracked_by_name(tmp_path):
    class Trainer:
        def __init__(self):
            self.top_score, self.iter_num = 0, 0

    trainer = Trainer()
    ckpt = client(tmp_path).track_attrs(trainer, "top_score", "iter_num")
    assert isinstance(ckpt._tracked["trainer"], Names)
    trainer.top_score, trainer.iter_num = 42, 9
    snapshot_and_close(ckpt)
    trainer = Trainer()
    client(tmp_path).track_attrs(trainer, "top_score", "iter_num").restore()
    assert (trainer.top_score, trainer.iter_num) == (42, 9)


def test_values_and_globals_are_restored_last():
    tracked = {"values": Values(), "t": TrackedTensor(torch.zeros(1)),
               "model": torch.nn.Linear(1, 1), "globals": Names({}),
               "opt": torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1)}
    assert restore_order(tracked) == ["model", "opt", "t", "values", "globals"]


def test_a_metric_given_as_a_loss_tensor_is_kept_as_a_number(tmp_path):
    """nanoGPT passes losses['val'], a 0-d tensor: it is the snapshot's metric, and
    BEST follows it; a tensor of many numbers is refused naming the field."""
    ckpt = client(tmp_path).track(w=torch.zeros(3))
    ckpt.snapshot(1, metric=torch.tensor(0.75)).wait()
    ckpt.snapshot(2, metric=torch.tensor(0.25)).wait()
    with pytest.raises(InvalidOption, match="metric") as refused:
        ckpt.snapshot(3, metric=torch.ones(2))
    assert refused.value.field == "metric"
    ckpt.close()
    best = RunStore(str(tmp_path), "run").read_pointer("BEST")
    assert best is not None and best.step == 2
    manifest = SnapshotReader(RunStore(str(tmp_path), "run").snapshot_path(best)).manifest
    assert manifest["metric"] == 0.25
