"""Two real trainer processes of a script that never seeds python or numpy, writing
through the real daemon: `snapd diff` says weights and optimizer equal, the python
and numpy streams seeded differently and never drawn from, and exits 0.

The two trainers run side by side (two runs of one root: they share only the daemon);
the diffs, which only read what they wrote, run in this process."""

from __future__ import annotations

import json
import subprocess
import sys

from click.testing import CliRunner

from helpers import stop_daemons_under
from snapd.cli import main

SCRIPT = """
import sys, torch
from torch.utils.data import DataLoader, TensorDataset
from snapd_client import Client
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(TensorDataset(torch.randn(12, 4)), batch_size=2, shuffle=True)
c = Client(sys.argv[1], sys.argv[2])
c.track(model=model, optimizer=opt)
batches = c.batches(loader)
for step in range(1, 5):
    (x,) = next(batches)
    model(x).pow(2).mean().backward(); opt.step(); opt.zero_grad()
    c.log(step)
c.snapshot(4).wait()
c.close()
"""


def test_two_processes_that_never_seed_python_or_numpy_diff_equal(tmp_path):
    root = str(tmp_path / "root")
    try:
        trainers = [subprocess.Popen([sys.executable, "-c", SCRIPT, root, run])
                    for run in ("a", "b")]
        assert [finish(p) for p in trainers] == [0, 0]
    finally:
        stop_daemons_under(str(tmp_path))
    diff = ["diff", "a", "b", "--root", root]
    result, strict = [CliRunner().invoke(main, diff + [flag], catch_exceptions=False)
                      for flag in ("--json", "--strict")]
    assert result.exit_code == 0, result.output
    parts = json.loads(result.output)["parts"]
    assert {p: r["verdict"] for p, r in parts.items()} == {
        "weights": "equal", "optimizer": "equal", "rng": "never-drawn",
        "cursor": "never-drawn"}
    assert strict.exit_code == 1 and "never drawn from: numpy, python" in strict.output


def finish(proc: subprocess.Popen) -> int:
    """Its exit status; killed first if it runs past two minutes."""
    try:
        return proc.wait(timeout=120)
    finally:
        proc.kill()
        proc.wait()
