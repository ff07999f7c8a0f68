"""A training script for the exactness tests, run as its own process.

    python tests/trainer.py '{"root": ..., "run": ..., "model": "momentum", ...}'

It seeds everything, builds the model, optimizer, scheduler and loader, restores,
trains to ``stop`` (or ``steps``), snapshots at ``snapshot_at`` steps, and writes a
JSON trace. ``dump_at``: after that step, the tracked state's tensors go to ``dump`` (an
.npz, no pickle: a side channel to compare a reproduced state with); ``perturb_from``:
from that step the loss is scaled by 1.001 (a script changed since the run);
``nan_at``: at that step the weights turn NaN before the forward (a bad batch's work),
so every loss from there on is NaN; ``gate_at``: after that step (and its snapshot)
the trainer writes ``<gate>.reached`` and waits until the file ``gate`` exists, so that
a test can act while the run is live. The (with ``sigkill``, only the trace, and then it SIGKILLs itself at ``stop``): per step the loss and a digest of the batch, then digests of the final
state. Two runs are the same run iff their traces are equal.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import sys
import time

import numpy as np
import torch
import xxhash
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from snapd_client import Client


def digest_tensors(*tensors) -> str:
    h = xxhash.xxh3_64()
    for t in tensors:
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def optimizer_tensors(opt):
    return [v for s in opt.state_dict()["state"].values() for v in s.values()
            if isinstance(v, torch.Tensor)]


def dump_state(path, **objects) -> None:
    """Every tensor leaf of each object's state dict, as snapd flattens it, keyed
    ``name/i``: what a snapshot taken now would hold, bit for bit."""
    from snapd_client.state import flatten
    arrays = {f"{name}/{i}": t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
              for name, obj in objects.items()
              for i, t in enumerate(flatten(obj.state_dict(), name).tensors)}
    np.savez(path, **arrays)


def build_momentum(cfg):
    """One weight, SGD with momentum, an LR that depends on the step, noisy inputs."""
    model = nn.Linear(1, 1, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.3 * s))
    xs = torch.arange(12, dtype=torch.float32).unsqueeze(1) / 12
    data = TensorDataset(xs, 3 * xs)
    return model, opt, sched, data, 3, 1


def build_transformer(cfg):
    """A small transformer with dropout, AdamW and warmup+cosine."""
    gen = torch.Generator().manual_seed(99)
    x = torch.randint(0, 32, (40, 12), generator=gen)
    data = TensorDataset(x, x.sum(1) % 4)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(32, 32)
            self.layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.2, batch_first=True)
            self.head = nn.Linear(32, 4)

        def forward(self, inp):
            return self.head(self.layer(self.embed(inp)).mean(1))

    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    warm = lambda s: min(1.0, (s + 1) / 3) * 0.5 * (1 + np.cos(np.pi * s / 12))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warm)
    return model, opt, sched, data, 8, 2


def loss_of(cfg, model, batch):
    x, y = batch
    if cfg["model"] == "momentum":
        noise = 0.01 * (torch.randn_like(x) + float(np.random.randn()) + random.gauss(0, 1))
        return nn.functional.mse_loss(model(x + noise), y)
    x = (x + torch.randint(0, 2, x.shape) + int(np.random.randint(0, 2))
         + random.randint(0, 1)) % 32
    return nn.functional.cross_entropy(model(x), y)


def main(cfg) -> None:
    torch.manual_seed(0), np.random.seed(0), random.seed(0)
    torch.set_num_threads(1)
    builder = build_momentum if cfg["model"] == "momentum" else build_transformer
    model, opt, sched, data, batch_size, accumulate = builder(cfg)
    gen = torch.Generator().manual_seed(5) if cfg.get("loader_generator") else None
    workers = cfg.get("workers", 0)
    loader = DataLoader(data, batch_size=batch_size, shuffle=True, num_workers=workers,
                        generator=gen, persistent_workers=workers > 0)
    client = Client(cfg["root"], cfg["run"], data_version="test-data",
                    replay_check="warn", **cfg.get("options", {}))
    client.track(model=model, optimizer=opt, scheduler=sched)
    batches = client.batches(loader)
    step = client.restore(_omit=cfg.get("omit", ()))
    trace = []
    stop = cfg.get("stop", cfg["steps"])
    while step < stop:
        if step + 1 == cfg.get("nan_at"):
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(float("nan"))
        for _ in range(accumulate):
            batch = next(batches)
            loss = loss_of(cfg, model, batch) / accumulate
            if step + 1 >= cfg.get("perturb_from", float("inf")):
                loss = loss * 1.001
            loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        step += 1
        trace.append([step, repr(loss.item()), digest_tensors(*batch)])
        client.log(step, loss=loss.item())
        if step == cfg.get("dump_at"):
            dump_state(cfg["dump"], model=model, optimizer=opt, scheduler=sched)
        if step in cfg.get("snapshot_at", ()):
            client.snapshot(step).wait()
        if step == cfg.get("gate_at"):
            open(cfg["gate"] + ".reached", "w").close()
            while not os.path.exists(cfg["gate"]):   # the test opens the gate
                time.sleep(0.01)   # no event to wait on across processes: poll the gate file
    if cfg.get("sigkill"):   # dies as a killed node does: the trace first, then SIGKILL
        with open(cfg["out"], "w") as f:
            json.dump({"trace": trace}, f)
        os.kill(os.getpid(), signal.SIGKILL)
    if stop < cfg["steps"] and client._handoff is not None and client._handoff.conn:
        # It dies: the connection drops without bye, so the daemon keeps the hot copy.
        client._handoff.conn._sock.shutdown(socket.SHUT_RDWR)
    client.close()
    final = {"weights": digest_tensors(*model.state_dict().values()),
             "optimizer": digest_tensors(*optimizer_tensors(opt)),
             "lr": repr(sched.get_last_lr()[0]),
             "cursor": [batches.epoch, batches.index],
             "rng": repr((random.random(), float(np.random.rand()), float(torch.rand(())),
                          None if gen is None else float(torch.rand((), generator=gen))))}
    with open(cfg["out"], "w") as f:
        json.dump({"trace": trace, "final": final, "replay": client.journal.verdict,
                   "restored_from": client.restored_from}, f)
    # Leave as a crash would: no interpreter teardown, workers killed with us.
    os._exit(0)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
