"""`snapd status` and `snapd batch` answer from logs and manifests alone."""

from __future__ import annotations

import json
import os

import torch
from click.testing import CliRunner
from torch.utils.data import DataLoader, TensorDataset

from snapd.cli import main
from snapd_client import Client


def train(root, run="r", steps=7, snapshot_every=3, start_client=None):
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.arange(10.0).view(5, 2)), batch_size=2,
                        shuffle=True, generator=torch.Generator().manual_seed(1))
    client = start_client or Client(root, run, daemon=False)
    client.track(model=model, optimizer=opt)
    batches = client.batches(loader)
    step = client.restore()
    while step < steps:
        (x,) = next(batches)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        step += 1
        client.log(step, loss=loss.item(), samples=[step * 10, step * 10 + 1])
        if step % snapshot_every == 0:
            client.snapshot(step).wait()
    client.close()


def invoke(*args):
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return result


def test_status_json_reports_progress_risk_and_resume(root):
    train(root)
    train(root, steps=9)  # resumes from step 6, recomputes step 7, goes on to 9
    result = invoke("status", root, "--json")
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.output)["runs"]
    assert row["run"] == "r" and row["reached"] == 9
    assert row["latest"] == "00000009" and row["committed_step"] == 9
    assert row["at_risk"] == 0
    assert row["last_resume"]["step"] == 6 and row["last_resume"]["reached"] == 7
    assert row["last_replay"]["verdict"] == "match" and row["last_replay"]["checked"] == 1


def test_status_table_and_missing_root(root, tmp_path):
    train(root)
    table = invoke("status", root)
    assert table.exit_code == 0 and "00000006" in table.output
    missing = invoke("status", str(tmp_path / "nope"))
    assert missing.exit_code == 2 and "no such directory" in missing.output


def test_batch_names_the_positions_and_samples_a_step_consumed(root):
    train(root)
    result = invoke("batch", "r", "4", "--root", root, "--json")
    assert result.exit_code == 0, result.output
    info = json.loads(result.output)
    # 3 batches per epoch: step 4 is epoch 1's first batch
    assert info["cursor_before"] == [0, 3] and info["cursor_after"] == [1, 1]
    assert info["samples"] == [40, 41]
    text = invoke("batch", "r", "2", "--root", root)
    assert "epoch 0 batch 1" in text.output and "[20, 21]" in text.output


def test_batch_of_an_unlogged_step_or_run_is_an_error(root):
    train(root)
    assert invoke("batch", "r", "99", "--root", root).exit_code == 1
    missing_run = invoke("batch", "nope", "1", "--root", root)
    assert missing_run.exit_code == 2 and "no run 'nope'" in missing_run.output


def test_status_reads_no_tensor_file(root, monkeypatch):
    train(root)
    opened = []
    real_open = os.open

    def spy(path, *args, **kwargs):
        opened.append(str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", spy)
    assert invoke("status", root, "--json").exit_code == 0
    assert not [p for p in opened if p.endswith(".tensors")]
