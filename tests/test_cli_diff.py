"""`snapd diff` by part: weights, optimizer, RNG, cursor; the exit code follows the
weights and optimizer unless --strict.

Two runs of a script that never seeds ``random`` or ``np.random`` are built in this
process: each starts the way a new process does (both streams seeded from the OS at
import), so they differ only in seeds nothing drew from.
"""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from torch.utils.data import DataLoader, TensorDataset

from snapd.cli import main
from snapd.commands.diffparts import NEVER_DRAWN, seeded_start
from snapd_client import Client
from snapd_client.rng import _encode_numpy, _encode_python

from helpers import read_manifest, write_manifest_raw


def as_a_new_process() -> None:
    """The python and numpy streams as a fresh interpreter has them: seeded from the OS."""
    random.seed(os.urandom(32))
    np.random.seed(np.frombuffer(os.urandom(32), dtype=np.uint32))


def train(root: str, run: str, lr: float = 0.1, draw_python: bool = False) -> None:
    as_a_new_process()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    loader = DataLoader(TensorDataset(torch.randn(12, 4)), batch_size=2, shuffle=True)
    client = Client(root, run, daemon=False)
    client.track(model=model, optimizer=opt)
    batches = client.batches(loader)
    for step in range(1, 5):
        (x,) = next(batches)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        client.log(step)
    if draw_python:
        random.random()   # a stream the run did draw from
    client.snapshot(4).wait()
    client.close()


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("diff"))
    train(base, "a")
    train(base, "b")
    train(base, "lr", lr=0.2)
    train(base, "drew", draw_python=True)
    return base


def diff(root: str, *args: str):
    return CliRunner().invoke(main, ["diff", *args, "--root", root], catch_exceptions=False)


def test_runs_that_never_seed_python_or_numpy_are_equal_by_weights_and_optimizer(root):
    result = diff(root, "a", "b")
    assert result.exit_code == 0, result.output
    assert "weights: equal (model)" in result.output
    assert "optimizer: equal (optimizer)" in result.output
    assert "rng: seeded differently, never drawn from: numpy, python" in result.output
    assert "epoch_rng.numpy, epoch_rng.python" in result.output
    assert "EQUAL weights and optimizer" in result.output

    out = json.loads(diff(root, "a", "b", "--json").output)
    verdicts = {part: r["verdict"] for part, r in out["parts"].items()}
    assert verdicts == {"weights": "equal", "optimizer": "equal", "rng": NEVER_DRAWN,
                        "cursor": NEVER_DRAWN}
    assert out["parts"]["rng"]["streams"] == {"numpy": NEVER_DRAWN, "python": NEVER_DRAWN,
                                              "torch": "equal"}
    assert out["exit_code"] == 0 and out["equal"] is False


def test_strict_fails_on_any_difference(root):
    assert diff(root, "a", "b", "--strict").exit_code == 1
    assert diff(root, "a", "a", "--strict").exit_code == 0


def test_a_weight_difference_exits_1(root):
    result = diff(root, "a", "lr")
    assert result.exit_code == 1, result.output
    assert "weights: different (model)" in result.output
    assert "optimizer: different (optimizer)" in result.output
    assert result.output.rstrip().endswith("DIFFERENT")


def test_a_stream_drawn_from_is_a_difference_but_not_a_failure(root):
    result = diff(root, "a", "drew")
    assert result.exit_code == 0, result.output
    assert "rng: different: python; seeded differently, never drawn from: numpy" \
        in result.output
    assert diff(root, "a", "drew", "--strict").exit_code == 1


def test_the_differing_cursor_field_is_named(root, tmp_path):
    import shutil
    copy = str(tmp_path / "root")
    shutil.copytree(root, copy)
    snap = os.path.join(copy, "b", "snapshots", "00000004")
    manifest = read_manifest(snap)
    manifest["cursor"]["index"] += 1
    write_manifest_raw(snap, manifest)
    result = diff(copy, "a", "b")
    assert result.exit_code == 0, result.output
    assert "cursor: different: index (4 -> 5); seeded differently, never drawn from: " \
           "epoch_rng.numpy, epoch_rng.python" in result.output
    fields = json.loads(diff(copy, "a", "b", "--json").output)["parts"]["cursor"]["fields"]
    assert fields["index"] == {"verdict": "different", "a": 4, "b": 5}


def test_seeded_start_is_read_from_the_encoding():
    for seed in (lambda: random.seed(7), lambda: random.seed(os.urandom(8))):
        seed()
        assert seeded_start("python", _encode_python(random.getstate()))
        random.random()
        assert not seeded_start("python", _encode_python(random.getstate()))
    random.seed(7)
    random.gauss(0, 1)   # leaves a cached gaussian: drawn from
    assert not seeded_start("python", _encode_python(random.getstate()))
    at_import = np.random.RandomState().get_state()   # seeded from the OS (position 623)
    for seed in (lambda: np.random.seed(12345), lambda: np.random.seed([1, 2]),
                 lambda: np.random.set_state(at_import)):
        seed()
        assert seeded_start("numpy", _encode_numpy(np.random.get_state()))
        np.random.rand(2)
        assert not seeded_start("numpy", _encode_numpy(np.random.get_state()))
    assert not seeded_start("torch", torch.get_rng_state().numpy().tobytes())
    assert not seeded_start("python", b"short")


def test_runs_of_one_name_under_two_roots_are_named_by_their_paths(root, tmp_path):
    other = str(tmp_path / "other")
    train(other, "a", lr=0.2)
    here = os.path.join(root, "a", "snapshots", "00000004")
    there = os.path.join(other, "a", "snapshots", "00000004")
    result = diff(root, here, there)
    assert result.exit_code == 1, result.output
    assert result.output.startswith(f"A = {here} (step 4)\nB = {there} (step 4)\n")

    out = json.loads(diff(root, here, there, "--json").output)
    assert (out["a"], out["b"]) == (here, there)
    assert out["paths"] == [here, there]


def test_sides_told_apart_by_run_keep_their_short_labels(root, tmp_path):
    other = str(tmp_path / "other")
    train(other, "b")
    there = os.path.join(other, "b", "snapshots", "00000004")
    result = diff(root, "a", there)
    assert result.output.startswith("A = a/00000004 (step 4)\nB = b/00000004 (step 4)\n")
    out = json.loads(diff(root, "a", there, "--json").output)
    assert (out["a"], out["b"]) == ("a/00000004", "b/00000004")
    assert out["paths"] == [os.path.join(root, "a", "snapshots", "00000004"), there]
