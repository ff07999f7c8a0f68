"""Fine-tuning exports: ``snapd export --only-trainable`` (the tensors not marked
frozen, the base model's reference in the metadata, no local path anywhere), and the
output check ``snapd diff --outputs`` / ``snapd_client.compare_outputs``."""

from __future__ import annotations

import json
import os
import socket
import struct

import pytest
import torch
from click.testing import CliRunner

from snapd.cli import main
from snapd_client import Client, compare_outputs

import lora_head as lora
from helpers import read_manifest, write_manifest_raw

RUN = "ft"


def cli(*args: str):
    return CliRunner().invoke(main, list(args), env={"COLUMNS": "200"},
                              catch_exceptions=False)


def frozen_paths(model: torch.nn.Module) -> set:
    return {f".{k}" for k in model.state_dict()} - {f".{k}" for k in lora.trainable_keys(model)}


def mark_frozen(snapshot_dir: str, model: torch.nn.Module) -> None:
    """Give the model's frozen entries ``"frozen": true`` (docs/format.md) where the
    writer did not, so that these tests read the key whoever wrote it."""
    manifest = read_manifest(snapshot_dir)
    for entry in manifest["objects"]["model"]["tensors"]:
        if entry["path"] in frozen_paths(model):
            entry.setdefault("frozen", True)
    write_manifest_raw(snapshot_dir, manifest)


def train(root: str, base=("tiny-base", "rev-1"), data_version="v1") -> torch.nn.Module:
    model = lora.build()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
    client = Client(root, RUN, data_version=data_version, daemon=False)
    client.track(model=model, optimizer=opt, base=base)
    lora.train_steps(model, opt, 3)
    client.snapshot(3).wait()
    client.close()
    mark_frozen(snapshot_dir(root), model)
    return model


def snapshot_dir(root: str) -> str:
    snaps = os.path.join(root, RUN, "snapshots")
    return os.path.join(snaps, sorted(os.listdir(snaps))[-1])


@pytest.fixture
def root(tmp_path):
    path = str(tmp_path / "ckpt")
    os.mkdir(path)
    return path


def header_bytes(path: str) -> bytes:
    """A safetensors file's JSON header (keys, dtypes, offsets, metadata)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return f.read(n)


def assert_no_place(data: bytes, *places: str) -> None:
    """None of ``places``, nor their last component (a pickled path is stored by its
    parts), nor the host name, occurs in ``data``."""
    host = socket.gethostname()
    for place in [*places, *map(os.path.basename, places), host if len(host) >= 3 else None]:
        if place:
            assert place.encode() not in data, place


# --- export --only-trainable -----------------------------------------------------------

def test_only_trainable_writes_exactly_the_tensors_not_frozen(root, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file
    model = train(root)
    out = str(tmp_path / "adapter.safetensors")
    result = cli("export", RUN, "--root", root, "--only-trainable", "-o", out)
    assert result.exit_code == 0, result.output
    loaded = load_file(out)
    assert set(loaded) == lora.trainable_keys(model)
    for key, value in loaded.items():
        assert torch.equal(value, model.state_dict()[key]), key
    digest = read_manifest(snapshot_dir(root))["base"]["digest"]
    with safe_open(out, "pt") as f:
        meta = f.metadata()
    assert meta["snapd.base_name"] == "tiny-base" and meta["snapd.base_revision"] == "rev-1"
    assert meta["snapd.base_digest"] == digest and meta["snapd.only_trainable"] == "true"
    assert "tiny-base@rev-1" in result.output and "strict=False" in result.output


def test_a_full_export_keeps_every_tensor_and_names_the_base_too(root, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file
    model = train(root)
    out = str(tmp_path / "full.safetensors")
    assert cli("export", RUN, "--root", root, "-o", out).exit_code == 0
    assert set(load_file(out)) == set(model.state_dict())
    with safe_open(out, "pt") as f:
        meta = f.metadata()
    assert meta["snapd.only_trainable"] == "false" and meta["snapd.base_revision"] == "rev-1"
    assert meta["snapd.parent"] == ""


@pytest.mark.parametrize("flags", [(), ("--only-trainable",)])
def test_no_export_names_a_place_of_the_training_machine(root, tmp_path, flags):
    data = str(tmp_path / "data" / "train.bin")          # a data file as data_version
    train(root, base=("/models/tiny", "rev-1"), data_version=data)
    out = str(tmp_path / "x.safetensors")
    result = cli("export", RUN, "--root", root, "-o", out, *flags)
    assert result.exit_code == 0, result.output
    assert "left out of the metadata: snapd.data_version" in result.output
    assert "left out of the metadata: snapd.base_name" in result.output
    assert_no_place(header_bytes(out), root, str(tmp_path), data, "/models/tiny")


def test_dcp_export_names_no_place_either(root, tmp_path):
    """DCP's .metadata records the directory it was written to unless told not to."""
    train(root)
    out = str(tmp_path / "dcp")
    assert cli("export", RUN, "--root", root, "--format", "dcp", "-o", out).exit_code == 0
    for name in os.listdir(out):
        with open(os.path.join(out, name), "rb") as f:
            assert_no_place(f.read(), root, str(tmp_path))


def test_only_trainable_without_a_base_works_and_says_so(root, tmp_path):
    from safetensors import safe_open
    model = train(root, base=None)
    out = str(tmp_path / "a.safetensors")
    result = cli("export", RUN, "--root", root, "--only-trainable", "-o", out)
    assert result.exit_code == 0, result.output
    assert "base: none recorded" in result.output
    with safe_open(out, "pt") as f:
        assert set(f.keys()) == lora.trainable_keys(model)
        assert f.metadata()["snapd.base_digest"] == ""


def test_only_trainable_is_refused_with_dcp(root, tmp_path):
    train(root)
    result = cli("export", RUN, "--root", root, "--only-trainable", "--format", "dcp",
                 "-o", str(tmp_path / "d"))
    assert result.exit_code == 2 and "safetensors" in result.output


# --- the output check -------------------------------------------------------------------

def outputs_cli(a: str, b: str, root: str, *extra: str):
    return cli("diff", "--outputs", a, b, "--root", root, "--model", "lora_head:build", *extra)


def test_a_snapshot_and_its_exports_give_the_same_outputs(root, tmp_path):
    train(root)
    full, adapter = str(tmp_path / "full.safetensors"), str(tmp_path / "ad.safetensors")
    assert cli("export", RUN, "--root", root, "-o", full).exit_code == 0
    assert cli("export", RUN, "--root", root, "--only-trainable", "-o", adapter).exit_code == 0
    for other in (full, adapter):
        result = outputs_cli(RUN, other, root, "--inputs", "lora_head:inputs", "--json")
        assert result.exit_code == 0, result.output
        out = json.loads(result.output)
        assert out["max_abs"] <= 1e-6 and out["verdict"] == "noise"
    result = outputs_cli(RUN, adapter, root, "--input-shape", "5,16")
    assert result.exit_code == 0, result.output
    assert "numerical noise" in result.output and "strict=False" in result.output


def test_changed_weights_are_reported_wrong_and_exit_1(root, tmp_path):
    from safetensors.torch import load_file, save_file
    train(root)
    full, bad = str(tmp_path / "full.safetensors"), str(tmp_path / "bad.safetensors")
    assert cli("export", RUN, "--root", root, "-o", full).exit_code == 0
    state = load_file(full)
    state["head.bias"] = state["head.bias"] + 0.5
    save_file(state, bad)
    result = outputs_cli(RUN, bad, root, "--input-shape", "4,16", "--json")
    assert result.exit_code == 1
    out = json.loads(result.output)
    assert out["max_abs"] == pytest.approx(0.5, abs=1e-5) and out["verdict"] == "wrong"
    text = outputs_cli(RUN, bad, root, "--input-shape", "4,16").output
    assert "above 0.01, something is wrong" in text
    assert outputs_cli(RUN, bad, root, "--input-shape", "4,16",
                       "--tolerance", "1").exit_code == 0


def test_the_output_check_needs_the_model_and_one_kind_of_inputs(root):
    train(root)
    assert cli("diff", "--outputs", RUN, RUN, "--root", root,
               "--input-shape", "4,16").exit_code == 2
    assert outputs_cli(RUN, RUN, root).exit_code == 2
    assert outputs_cli(RUN, RUN, root, "--input-shape", "4,x").exit_code == 2
    result = cli("diff", "--outputs", RUN, RUN, "--root", root, "--model", "nosuch:build",
                 "--input-shape", "4,16")
    assert result.exit_code == 2 and "cannot import 'nosuch'" in result.output


def test_compare_outputs_in_python(root, tmp_path):
    model = train(root)
    same = compare_outputs(lora.build, snapshot_dir(root), model.state_dict(), lora.inputs())
    assert same["max_abs"] == 0.0 and same["verdict"] == "noise"
    moved = {k: v + 1e-3 if k == "head.bias" else v for k, v in model.state_dict().items()}
    look = compare_outputs(lora.build, model.state_dict(), moved, lora.inputs())
    assert look["verdict"] == "look" and "look at it" in look["message"]
