"""restore(overlap=True) with the real daemon: a trainer killed after its snapshots
resumes, its optimizer state arriving from the daemon's copy in memory while the
first forward and backward run, and ends bit for bit where the uninterrupted run
ends. (From the files: tests/test_restore_overlap.py.)"""

from __future__ import annotations

import logging
import os

import pytest
import torch

from snapd_client import Client

from harness import close_as_if_killed
from helpers import flip_byte, read_manifest

pytestmark = pytest.mark.integration


def make_model(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 8))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def train_step(model, opt) -> None:
    model(torch.randn(16, 32)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def damage_optimizer_file(root: str, run: str, snapshot: str) -> tuple:
    """Flip one byte inside the optimizer's first tensor: (file, offset)."""
    path = os.path.join(root, run, "snapshots", snapshot)
    entry = read_manifest(path)["objects"]["optimizer"]
    where = (os.path.join(path, entry["file"]), entry["tensors"][0]["chunks"][0][0])
    flip_byte(*where)
    return where


def uninterrupted(steps: int) -> dict:
    model, opt = make_model()
    for _ in range(steps):
        train_step(model, opt)
    return model.state_dict()


def test_a_killed_trainer_resumes_with_overlap_from_the_daemons_copy_exactly(env, caplog):
    caplog.set_level(logging.INFO, logger="snapd_client.client")
    model, opt = make_model()
    client = Client(env.root, env.run, mode="overlap")
    client.track(model=model, optimizer=opt)
    for step in range(1, 5):
        train_step(model, opt)
        if step % 2 == 0:
            client.snapshot(step).wait()
    env.daemon(client)
    close_as_if_killed(client)   # the daemon keeps its copy for a restart
    moments = {(i, k): v.clone() for i, st in opt.state_dict()["state"].items()
               for k, v in st.items()}

    # The daemon's copy serves the background read too: with the optimizer's file
    # damaged on disk, the state still arrives whole, from memory.
    damaged = damage_optimizer_file(env.root, env.run, "00000004")
    look_model, look_opt = make_model(7)
    looker = Client(env.root, env.run, read_only=True)
    looker.track(model=look_model, optimizer=look_opt)
    assert looker.restore(overlap=True) == 4 and looker.restored_from == "hot"
    assert "restored step 4 (hot; the state of optimizer arrives before the first " \
           "step)" in caplog.text
    looker.capture(4)   # waits for the optimizer state, as a snapshot would
    assert not looker.optimizer_state_pending
    assert all(torch.equal(moments[(i, k)], v)
               for i, st in look_opt.state_dict()["state"].items() for k, v in st.items())
    assert len(look_opt.state) == len(opt.state)
    close_as_if_killed(looker)   # a clean close would let the daemon drop its copy
    flip_byte(*damaged)   # undone: the files are whole again

    model, opt = make_model(seed=5)   # another start: the restore must replace it all
    again = Client(env.root, env.run, mode="overlap")
    again.track(model=model, optimizer=opt)
    # The copy is released right after restore() applied the rest: the background
    # read keeps its segment open until it ends (or, failing that, reads the files).
    assert again.restore(overlap=True) == 4 and again.restored_from == "hot"
    for step in (5, 6):
        train_step(model, opt)   # the first waits for the moments, then updates
        assert not again.optimizer_state_pending
        again.snapshot(step).wait()
    again.close()
    expected = uninterrupted(6)
    assert all(torch.equal(expected[k], v) for k, v in model.state_dict().items())
