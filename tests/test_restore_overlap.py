"""restore(overlap=True), in one process: the optimizer's per-parameter state arrives
in the background and is applied before the first update. In-process clients
(daemon=False); the background read is held by substituting a gated one."""

from __future__ import annotations

import glob
import os
import shutil
import threading

import pytest
import torch

from helpers import OverlapJob, flip_byte, private_copy, read_manifest, small_model_and_opt
from snapd.errors import CorruptSnapshot, IncompatibleState, InvalidOption
from snapd.store import RunStore
from snapd_client import Client
from snapd_client import overlaprestore
from snapd_client.restore import FallbackWarning, read_step_state


Job = OverlapJob


def same(a: dict, b: dict) -> bool:
    return a["weights"].keys() == b["weights"].keys() and all(
        torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"]) \
        and a["moments"].keys() == b["moments"].keys() and all(
        torch.equal(a["moments"][k], b["moments"][k]) for k in a["moments"]) \
        and a["lr"] == b["lr"] and torch.equal(a["rng"], b["rng"])


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> str:
    """A run with snapshots at steps 3 and 6."""
    root = str(tmp_path_factory.mktemp("overlap"))
    torch.manual_seed(1)
    job = Job(root)
    job.train(1, 6, every=3)
    job.client.close()
    return root


@pytest.fixture
def root(trained, tmp_path) -> str:
    return private_copy(trained, tmp_path)


def resumed_outcome(root: str, overlap: bool) -> dict:
    torch.manual_seed(99)   # the restore must put every stream back
    job = Job(root)
    assert job.client.restore(overlap=overlap) == 6
    job.train(7, 9)
    job.client.close()
    return job.outcome()


def test_a_resume_with_overlap_is_bit_for_bit_the_resume_without(trained, tmp_path):
    plain, overlapped = str(tmp_path / "plain"), str(tmp_path / "overlapped")
    shutil.copytree(trained, plain)
    shutil.copytree(trained, overlapped)
    assert same(resumed_outcome(overlapped, True), resumed_outcome(plain, False))


def gate(monkeypatch):
    """Hold the background read until the test releases it; (entered, release)."""
    entered, release = threading.Event(), threading.Event()

    def gated(reader, names, tracked, source):
        entered.set()
        assert release.wait(60), "the test never released the read"
        return read_step_state(reader, names, tracked, source)

    monkeypatch.setattr(overlaprestore, "READ", gated)
    return entered, release


def test_restore_returns_before_the_optimizer_state_is_read(root, monkeypatch):
    entered, release = gate(monkeypatch)
    job = Job(root)
    assert job.client.restore(overlap=True) == 6   # returned with the read held
    assert entered.wait(60)
    assert job.client.optimizer_state_pending and not job.opt.state
    # what the next forward and backward read is all there, and the param_groups:
    assert job.opt.param_groups[0]["lr"] == job.sched.get_last_lr()[0] == 0.05 * 0.5 ** 3
    job.forward_backward()
    job.opt.param_groups[0]["lr"] = 0.01   # set after restore(): kept
    release.set()
    job.opt.step()   # waited for the state, applied it, then updated
    assert not job.client.optimizer_state_pending
    assert job.opt.param_groups[0]["lr"] == 0.01
    assert all(int(s["step"]) == 7 for s in job.opt.state.values())
    # The hook cannot remove itself while torch calls it: it stays, a no-op, until
    # the client next captures or closes.
    assert len(job.opt._optimizer_step_pre_hooks) == 1
    job.client.close()
    assert job.opt._optimizer_step_pre_hooks == {}


def test_a_step_pre_hook_of_the_trainers_own_runs_beside_snapds(root):
    # A hook registered after restore() comes after snapd's in torch's loop over
    # them: snapd's must not change that dict while torch walks it.
    job = Job(root)
    job.client.restore(overlap=True)
    seen = []
    job.opt.register_step_pre_hook(lambda opt, args, kwargs: seen.append(
        {int(s["step"]) for s in opt.state.values()}))
    job.forward_backward()
    job.opt.step()
    job.forward_backward()
    job.opt.step()
    assert seen == [{6}, {7}]   # snapd's hook ran first and applied the state
    job.client.snapshot(8)
    assert len(job.opt._optimizer_step_pre_hooks) == 1   # the trainer's alone
    job.client.close()


def test_a_snapshot_before_the_first_step_waits_for_the_optimizer_state(root):
    job = Job(root)
    job.client.restore(overlap=True)
    job.client.snapshot(7)
    job.client.close()
    saved = read_manifest(os.path.join(root, "r", "snapshots", "00000007"))
    before = read_manifest(os.path.join(root, "r", "snapshots", "00000006"))
    assert [t["path"] for t in saved["objects"]["optimizer"]["tensors"]] == \
        [t["path"] for t in before["objects"]["optimizer"]["tensors"]]


def damage_optimizer_file(root: str, snapshot: str) -> str:
    """Flip one byte inside the optimizer's first tensor; the file's path."""
    path = os.path.join(root, "r", "snapshots", snapshot)
    entry = read_manifest(path)["objects"]["optimizer"]
    full = os.path.join(path, entry["file"])
    flip_byte(full, entry["tensors"][0]["chunks"][0][0])
    return full


def test_a_damaged_optimizer_file_stops_the_first_step_and_the_next_start_falls_back(root):
    damaged = damage_optimizer_file(root, "00000006")
    job = Job(root)
    assert job.client.restore(overlap=True) == 6   # weights verified; moments not yet
    weights = {k: v.clone() for k, v in job.model.state_dict().items()}
    job.forward_backward()
    for _ in range(2):   # every step refuses, not only the first
        with pytest.raises(CorruptSnapshot) as caught:
            job.opt.step()
        assert caught.value.path == damaged
        message = str(caught.value)
        assert message.startswith(f"{damaged}: ")
        assert "No update was applied" in message and "Restart the process" in message
        assert "00000006 is set aside as" in message
    assert all(torch.equal(weights[k], v) for k, v in job.model.state_dict().items())
    job.client.close()

    store = RunStore(root, "r")
    assert [sid.name for sid in store.committed()] == ["00000003"]
    assert len(glob.glob(os.path.join(store.snapshots_path, ".damaged-00000006-*"))) == 1
    assert store.read_pointer("LATEST") is None   # it named the damaged snapshot

    again = Job(root)
    assert again.client.restore(overlap=True) == 3
    again.step()   # the older snapshot's state arrives whole
    again.client.close()


def test_damaged_weights_fall_back_before_restore_returns_and_the_state_follows_them(root):
    path = os.path.join(root, "r", "snapshots", "00000006")
    entry = read_manifest(path)["objects"]["model"]
    flip_byte(os.path.join(path, entry["file"]), entry["tensors"][0]["chunks"][0][0])
    job = Job(root)
    with pytest.warns(FallbackWarning, match="00000006"):
        assert job.client.restore(overlap=True) == 3
    assert job.client.restored.reader.path.endswith("00000003")
    job.step()
    assert all(int(s["step"]) == 4 for s in job.opt.state.values())   # step 3's, plus one
    job.client.close()


def test_a_read_only_client_sets_nothing_aside(root):
    damaged = damage_optimizer_file(root, "00000006")
    model, opt = small_model_and_opt()
    looker = Client(root, "r", read_only=True, daemon=False)
    looker.track(model=model, optimizer=opt,
                 scheduler=torch.optim.lr_scheduler.StepLR(opt, step_size=2))
    assert looker.restore(overlap=True) == 6
    with pytest.raises(CorruptSnapshot) as caught:
        looker.capture(7)   # a capture reads the optimizers: it meets the failure first
    assert caught.value.path == damaged
    assert "00000006 is left as it is (read-only client). Restart the process" \
        in str(caught.value)
    looker.close()
    assert [sid.name for sid in RunStore(root, "r").committed()] == ["00000003", "00000006"]


def test_an_optimizer_that_does_not_fit_is_refused_before_restore_returns(root):
    job = Job(root)
    partial = torch.optim.AdamW(list(job.model.parameters())[:2], lr=0.05)
    job.client._tracked["optimizer"] = partial   # the script changed what it optimizes
    with pytest.raises(IncompatibleState) as caught:
        job.client.restore(overlap=True)
    assert caught.value.field == "objects.optimizer.param_groups"
    assert not job.client.optimizer_state_pending
    assert partial._optimizer_step_pre_hooks == {}
    job.client.close()


@pytest.mark.parametrize("mode,overlap,message", [
    ("warm_start", True, "restore(mode='warm_start', overlap=True): a warm start reads "
                         "module weights only, there is nothing to overlap; drop "
                         "overlap=True"),
    ("resume", "yes", "restore(overlap='yes'): True or False"),
])
def test_overlap_values_that_mean_nothing_are_refused(tmp_path, mode, overlap, message):
    client = Client(str(tmp_path), "r", daemon=False)
    with pytest.raises(InvalidOption) as caught:
        client.restore(mode, overlap=overlap)
    assert (caught.value.field, str(caught.value)) == ("overlap", message)
    client.close()


def test_the_first_step_of_either_optimizer_brings_every_optimizers_state(tmp_path):
    def two():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        return model, torch.optim.AdamW(model[0].parameters()), \
            torch.optim.SGD(model[1].parameters(), lr=0.1, momentum=0.9)

    def step(model, opts):
        model(torch.randn(3, 4)).sum().backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()

    root = str(tmp_path)
    model, first, second = two()
    client = Client(root, "r", daemon=False)
    client.track(model=model, first=first, second=second)
    step(model, [first, second])
    client.snapshot(1)
    client.close()
    saved = {"first": first.state_dict()["state"], "second": second.state_dict()["state"]}

    model, first, second = two()
    client = Client(root, "r", daemon=False)
    client.track(model=model, first=first, second=second)
    assert client.restore(overlap=True) == 1
    model(torch.randn(3, 4)).sum().backward()
    second.step()   # the state of both arrives here, then this update runs
    assert not client.optimizer_state_pending
    # the other optimizer's hook is gone; the stepping one's stays (a no-op) until
    # the client captures or closes
    assert first._optimizer_step_pre_hooks == {}
    assert len(second._optimizer_step_pre_hooks) == 1
    assert all(torch.equal(saved["first"][i][k], v)
               for i, s in first.state_dict()["state"].items() for k, v in s.items())
    assert first.state_dict()["state"].keys() == saved["first"].keys()
    client.close()
    assert second._optimizer_step_pre_hooks == {}


def test_a_second_restore_that_fails_leaves_the_first_ones_state_still_arriving(
        root, tmp_path, monkeypatch):
    """restore is all or nothing: a restore that fails while an earlier one's optimizer
    state is still arriving leaves that state to arrive, guarded, not the optimizers
    empty and unguarded (a step would then start the moments from zero)."""
    expected = resumed_outcome(private_copy(root, tmp_path / "plain"), False)
    entered, release = gate(monkeypatch)
    torch.manual_seed(99)
    job = Job(root)
    assert job.client.restore(overlap=True) == 6
    assert entered.wait(60)

    loads = type(job.sched).load_state_dict

    def fails_once(self, state):   # the script's own object fails to load, once
        monkeypatch.setattr(type(job.sched), "load_state_dict", loads)
        raise RuntimeError("this scheduler cannot load a state")

    monkeypatch.setattr(type(job.sched), "load_state_dict", fails_once)
    # The module left out: its weights are not read in place, so that everything the
    # failed restore touched can be put back (restore.apply), as this test needs.
    with pytest.raises(IncompatibleState, match="put back as it was before restore"):
        job.client.restore(_omit=("model",))
    monkeypatch.undo()   # the first read is no longer held
    assert job.client.optimizer_state_pending and not job.opt.state
    assert len(job.opt._optimizer_step_pre_hooks) == 1
    release.set()
    job.train(7, 9)   # the first step waits for the first restore's state and applies it
    job.client.close()
    assert same(job.outcome(), expected)
