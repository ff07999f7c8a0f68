"""Fine-tuning: a frozen base costs nothing after the first snapshot (the in-process
writer here; tests/integration/test_finetune_daemon.py goes through the daemon)."""

from __future__ import annotations

import os

import pytest
import torch

from snapd.commit import CommitService
from snapd_client import SnapshotWarning
from snapd.reader import SnapshotReader
from snapd_client import Client

import lora

D = 512
RANK = 8


def client(root, model, opt, **options) -> Client:
    ckpt = Client(str(root), "ft", daemon=False, **options)
    ckpt.track(model=model, optimizer=opt)
    return ckpt


def entries(path: str):
    return {t["path"]: t for t in SnapshotReader(path).objects["model"]["tensors"]}


def run(root, steps, **options):
    model, opt = lora.build(D, rank=RANK)
    ckpt = client(root, model, opt, **options)
    ckpt.restore()
    handles = []
    for step in range(1, steps + 1):
        lora.train_step(model, opt, step, D)
        handles.append(ckpt.snapshot(step))
    ckpt.close()
    return model, opt, handles


def test_after_the_first_snapshot_only_the_trainable_state_is_copied_and_written(tmp_path):
    model, opt, handles = run(tmp_path, 5)
    trainable, base = lora.trainable_bytes(model, opt), lora.base_bytes(model)
    assert base > 5 * trainable
    assert handles[0].staged_bytes >= base + trainable
    assert handles[0].result.bytes_written >= base
    for h in handles[1:]:
        assert h.staged_bytes <= 2 * trainable, h.step
        assert h.result.bytes_written <= 2 * trainable, h.step
    last = entries(handles[-1].result.path)
    assert last[".0.base.weight"].get("src") is not None and last[".0.base.weight"]["frozen"]
    assert "src" not in last[".0.a"] and "frozen" not in last[".0.a"]


def test_share_unchanged_off_copies_everything(tmp_path):
    model, opt, handles = run(tmp_path, 2, share_unchanged=False)
    assert handles[1].staged_bytes >= lora.base_bytes(model)


def test_resume_from_a_shared_snapshot_is_bit_for_bit(tmp_path):
    reference, ref_opt, _ = run(tmp_path / "a", 6)
    run(tmp_path / "b", 3)
    model, opt = lora.build(D, rank=RANK, seed=1)          # other initial weights: all must load
    ckpt = client(tmp_path / "b", model, opt)
    assert ckpt.restore() == 3
    for step in range(4, 7):
        lora.train_step(model, opt, step, D)
        ckpt.snapshot(step)
    ckpt.close()
    for (name, a), b in zip(reference.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), name
    for a, b in zip(ref_opt.state.values(), opt.state.values()):
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_layer_unfrozen_mid_run_is_copied_again(tmp_path):
    model, opt = lora.build(D, rank=RANK)
    ckpt = client(tmp_path, model, opt)
    ckpt.restore()
    for step in (1, 2):
        lora.train_step(model, opt, step, D)
        ckpt.snapshot(step)
    weight = model[0].base.weight
    weight.requires_grad_(True)
    opt.add_param_group({"params": [weight]})
    for step in (3, 4):
        lora.train_step(model, opt, step, D)
        handle = ckpt.snapshot(step)
        assert handle.staged_bytes >= weight.numel() * 4
        entry = entries(handle.result.path)[".0.base.weight"]
        assert "src" not in entry and "frozen" not in entry
    ckpt.close()
    restored, _ = lora.build(D, rank=RANK, seed=1)
    restored[0].base.weight.requires_grad_(True)
    ro = torch.optim.AdamW([p for p in restored.parameters() if p.requires_grad], lr=1e-2)
    back = client(tmp_path, restored, ro)
    back.restore(mode="warm_start")
    assert torch.equal(restored[0].base.weight, weight)
    back.close()


def test_a_frozen_tensor_changed_behind_snapds_back_is_written(tmp_path):
    model, opt = lora.build(D, rank=RANK)
    ckpt = client(tmp_path, model, opt)
    ckpt.restore()
    lora.train_step(model, opt, 1, D)
    ckpt.snapshot(1)
    frozen = model[2].base.weight
    frozen.data.add_(1.0)   # .data: its own version counter; the fingerprint sees it
    with torch.no_grad():
        model[4].base.bias.add_(1.0)   # through the tensor: its version counter moves
    handle = ckpt.snapshot(1 + 1)
    ckpt.close()
    found = entries(handle.result.path)
    assert "src" not in found[".2.base.weight"] and "src" not in found[".4.base.bias"]
    assert found[".0.base.weight"].get("src") is not None
    reader = SnapshotReader(handle.result.path)
    values = dict(zip([t["path"] for t in reader.objects["model"]["tensors"]],
                      reader.load_object("model")))
    assert torch.equal(values[".2.base.weight"], frozen)
    assert torch.equal(values[".4.base.bias"], model[4].base.bias)


def test_a_failed_home_is_not_referred_to(tmp_path, monkeypatch):
    model, opt = lora.build(D, rank=RANK)
    ckpt = client(tmp_path, model, opt)
    ckpt.restore()
    lora.train_step(model, opt, 1, D)
    real = CommitService.commit

    def failing_once(self, store, plan, *args, **kwargs):
        if plan.step == 1:
            raise OSError(28, "No space left on device")
        return real(self, store, plan, *args, **kwargs)

    monkeypatch.setattr(CommitService, "commit", failing_once)
    with pytest.warns(SnapshotWarning):
        assert ckpt.snapshot(1).failed
        handle = ckpt.snapshot(2)
    assert handle.staged_bytes >= lora.base_bytes(model)   # step 1 is no home
    assert os.path.exists(handle.result.path)
    ckpt.close()
