"""A trainer for tests/integration/test_cadence_kill.py, run as its own process:

    python tests/integration/cadence_job.py '{"root": ..., "run": ..., "steps": ...}'

It calls ``snapshot(step)`` at every step and leaves the choice to ``every``
(``options``: "auto" in the runs that are killed). Each step's compute is simulated:
a small model's update, then ``step_s`` seconds asleep, so that the cadence meets a
steady step time on a machine shared with other tests. At ``steps`` it closes the
client and writes ``out``: digests of the final weights, optimizer state, cursor and
RNG streams. Two runs are the same run iff those are equal. ``train`` is the loop
alone: the test runs the uninterrupted run with it, in its own process.

It imports torch, then waits for one line on stdin (JSON: settings to add) before it
opens the client: the test starts the next trainer while this one trains, and lets
it go once this one is killed, so that a restart costs what it would on a node whose
software is in the page cache, not seconds of imports on a loaded test machine.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

import numpy as np
import torch
import xxhash
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from snapd_client import Client


def digest(*tensors: torch.Tensor) -> str:
    h = xxhash.xxh3_64()
    for t in tensors:
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def train(cfg) -> dict:
    """One life of the run, to ``cfg["steps"]``; digests of the state it ends with."""
    torch.manual_seed(0), np.random.seed(0), random.seed(0)
    model = nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    gen = torch.Generator().manual_seed(7)
    xs = torch.randn(64, 8, generator=gen)
    loader = DataLoader(TensorDataset(xs, xs.flip(1)), batch_size=4, shuffle=True,
                        generator=torch.Generator().manual_seed(3))
    client = Client(cfg["root"], cfg["run"], data_version="cadence",
                    replay_check="raise", **cfg["options"])
    client.track(model=model, optimizer=opt)
    batches = client.batches(loader)
    step = client.restore()
    while step < cfg["steps"]:
        x, y = next(batches)
        noise = 0.01 * (torch.randn_like(x) + float(np.random.randn()) + random.gauss(0, 1))
        loss = nn.functional.mse_loss(model(x + noise), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        time.sleep(cfg["step_s"])   # the rest of a real step's compute
        step += 1
        client.log(step, loss=loss.item())
        client.snapshot(step)
    client.close()
    return {"weights": digest(*model.state_dict().values()),
            "optimizer": digest(*[v for s in opt.state_dict()["state"].values()
                                  for v in s.values() if isinstance(v, torch.Tensor)]),
            "cursor": [batches.epoch, batches.index],
            "rng": repr((random.random(), float(np.random.rand()),
                         float(torch.rand(()))))}


def main(cfg) -> None:
    # Held until the test says go, with the settings known only then (the step the
    # last run ends at): a restarted trainer with torch imported already.
    cfg.update(json.loads(sys.stdin.readline() or "{}"))
    state = train(cfg)
    with open(cfg["out"], "w") as f:
        json.dump(state, f)
    os._exit(0)   # as a crash would leave: no interpreter teardown


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(json.loads(sys.argv[1]))
