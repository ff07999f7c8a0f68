"""The base model's reference: Base validation, snapd's digest of the frozen tensors,
every snapshot carrying it, and restore and warm_start refusing another base."""

from __future__ import annotations

import os

import pytest
import torch

from snapd import format as fmt
from snapd.errors import IncompatibleState
from snapd_client import Base, Client
from snapd_client.basemodel import base_digest, frozen_leaves

import lora_head as lora
from helpers import read_manifest

RUN = "ft"


# --- Base ----------------------------------------------------------------------------

@pytest.mark.parametrize("given", [Base("llama", "8cde5ca"),
                                   {"name": "llama", "revision": "8cde5ca"},
                                   ("llama", "8cde5ca")])
def test_base_is_given_three_ways(given):
    assert Base.of(given) == Base("llama", "8cde5ca")


@pytest.mark.parametrize("name, revision, field", [
    ("", "r1", "name"), ("m", "", "revision"), (None, "r1", "name"), ("m", 3, "revision"),
    ("x" * 1025, "r1", "name"), ("m", "r" * 1025, "revision")])
def test_base_refuses_a_bad_field_naming_it(name, revision, field):
    with pytest.raises(ValueError, match=f"base {field}="):
        Base(name, revision)
    with pytest.raises(ValueError, match=f"base {field}="):
        Base.of({"name": name, "revision": revision})


@pytest.mark.parametrize("given", ["llama", ("a", "b", "c"), {"name": "a", "revision": "b",
                                                             "digest": "00"}])
def test_base_refuses_other_shapes(given):
    with pytest.raises(ValueError, match="base="):
        Base.of(given)


# --- the digest ----------------------------------------------------------------------

def test_digest_is_stable_and_32_hex_digits():
    a, b = lora.build(), lora.build()
    da = base_digest(frozen_leaves({"model": a}))
    assert da == base_digest(frozen_leaves({"model": b}))
    assert len(da) == 32 and all(c in "0123456789abcdef" for c in da)
    # renaming the tracked object keeps it: the base is the weights
    assert base_digest(frozen_leaves({"net": b})) == da


def test_digest_covers_the_frozen_tensors_only():
    model = lora.build()
    frozen = {path for path, _ in frozen_leaves({"model": model})}
    assert frozen == {f".{k}" for k in model.state_dict()} - \
        {f".{k}" for k in lora.trainable_keys(model)}
    before = base_digest(frozen_leaves({"model": model}))
    with torch.no_grad():
        model.head.weight.add_(1.0)          # trainable: not the base
    assert base_digest(frozen_leaves({"model": model})) == before


def test_digest_sees_one_changed_element():
    model = lora.build()
    before = base_digest(frozen_leaves({"model": model}))
    with torch.no_grad():
        model.blocks[1].base.weight[3, 5] += 1e-6
    assert base_digest(frozen_leaves({"model": model})) != before


def test_digest_sees_dtype_and_shape_not_only_bytes():
    t = torch.zeros(4, dtype=torch.float32)
    assert base_digest([(".w", t)]) != base_digest([(".w", t.view(torch.int32))])
    assert base_digest([(".w", t)]) != base_digest([(".w", t.view(2, 2))])
    assert base_digest([(".w", t)]) != base_digest([(".v", t)])


def test_a_parameter_an_optimizer_steps_is_not_base():
    model = lora.build()
    model.blocks[0].base.weight.requires_grad_(False)
    opt = torch.optim.SGD([model.blocks[0].base.weight], lr=0.1)
    paths = {p for p, _ in frozen_leaves({"model": model, "opt": opt})}
    assert ".blocks.0.base.weight" not in paths and ".blocks.0.base.bias" in paths


# --- every snapshot carries it; restore compares ---------------------------------------

def _client(root, model, opt, base, **kw):
    client = Client(str(root), RUN, daemon=False, **kw)
    client.track(model=model, optimizer=opt, base=base)
    return client


def _trained(root, base=("tiny", "r1"), steps=2):
    model = lora.build()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
    client = _client(root, model, opt, base)
    lora.train_steps(model, opt, steps)
    client.snapshot(steps).wait()
    client.close()
    return model


def _snapshot_dir(root):
    snaps = os.path.join(str(root), RUN, "snapshots")
    return os.path.join(snaps, sorted(os.listdir(snaps))[-1])


def test_the_manifest_carries_name_revision_and_digest(tmp_path):
    _trained(tmp_path)
    base = read_manifest(_snapshot_dir(tmp_path))["base"]
    want = base_digest(frozen_leaves({"model": lora.build()}))
    assert base == {"name": "tiny", "revision": "r1", "digest": want}


def test_client_argument_is_the_same_as_track(tmp_path):
    model = lora.build()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    client = Client(str(tmp_path), RUN, daemon=False, base=Base("tiny", "r1"))
    client.track(model=model, optimizer=opt)
    client.snapshot(0).wait()
    client.close()
    assert read_manifest(_snapshot_dir(tmp_path))["base"]["revision"] == "r1"


def test_resume_over_the_same_base_is_exact(tmp_path):
    trained = _trained(tmp_path)
    model = lora.build()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
    client = _client(tmp_path, model, opt, ("tiny", "r1"))
    assert client.restore() == 2
    for key, value in trained.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    client.close()


def _other_base():
    model = lora.build()
    with torch.no_grad():
        model.blocks[0].base.weight[0, 0] += 0.5
    return model


def test_resume_refuses_another_base_naming_both_revisions(tmp_path):
    _trained(tmp_path)
    model = _other_base()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
    client = _client(tmp_path, model, opt, ("tiny", "r2"))
    head = model.head.weight.detach().clone()
    with pytest.raises(IncompatibleState) as e:
        client.restore()
    msg = str(e.value)
    assert e.value.field == "base"
    assert e.value.path == os.path.join(_snapshot_dir(tmp_path), fmt.MANIFEST_NAME)
    assert "tiny@r1" in msg and "tiny@r2" in msg
    assert read_manifest(_snapshot_dir(tmp_path))["base"]["digest"] in msg
    assert "load the base revision 'r1'" in msg
    assert torch.equal(model.head.weight, head)   # nothing was touched
    client.close()


def test_warm_start_refuses_another_base_too(tmp_path):
    _trained(tmp_path)
    model = _other_base()
    client = Client(str(tmp_path), RUN, daemon=False)
    client.track(model=model, base=("tiny", "r2"))
    with pytest.raises(IncompatibleState, match="tiny@r1.*tiny@r2") as e:
        client.restore(mode="warm_start")
    assert e.value.field == "base"
    client.close()


def test_the_same_weights_under_another_revision_string_resume(tmp_path):
    """The digest is the identity: a renamed revision of the same bytes fits."""
    _trained(tmp_path)
    model = lora.build()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
    client = _client(tmp_path, model, opt, ("tiny", "tag-v1"))
    assert client.restore() == 2
    client.close()


def test_without_a_base_on_either_side_restore_works_as_before(tmp_path):
    _trained(tmp_path)                              # the snapshot names a base
    model = _other_base()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
    client = Client(str(tmp_path), RUN, daemon=False)   # this client does not
    client.track(model=model, optimizer=opt)
    assert client.restore() == 2
    client.close()


def test_a_snapshot_without_a_base_restores_into_a_client_with_one(tmp_path):
    _trained(tmp_path, base=None)
    assert read_manifest(_snapshot_dir(tmp_path))["base"] is None
    model = _other_base()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
    client = _client(tmp_path, model, opt, ("tiny", "r2"))
    assert client.restore() == 2
    # the snapshot's frozen weights were loaded: later snapshots digest those
    client.snapshot(3).wait()
    client.close()
    assert read_manifest(_snapshot_dir(tmp_path))["base"]["digest"] == \
        base_digest(frozen_leaves({"model": lora.build()}))


def test_track_refuses_a_bad_base_before_tracking(tmp_path):
    client = Client(str(tmp_path), RUN, daemon=False)
    with pytest.raises(ValueError, match="base revision="):
        client.track(model=lora.build(), base=("tiny", ""))
    client.close()
