"""A DDP training job (gloo, CPU) for the multi-rank tests, started by torchrun:
``python -m torch.distributed.run --standalone --nproc-per-node N ddp_job.py JSON``.

A small MLP with dropout, a map-style dataset read through a shuffled
``DistributedSampler``, per-rank noise drawn from the global torch, python and numpy
generators, AdamW and a StepLR schedule: every RNG stream and the data order matter.
With ``"snapd": true`` it adds exactly the README's calls (Client after
init_process_group, track, batches, restore, log, snapshot, close); without, it walks
the epochs itself (``set_epoch``, ``iter(loader)``), as a plain DDP script does.

Settings (JSON, all optional but root/run/out): ``steps``, ``snapshot_every``,
``batch_size`` (per rank), ``samples`` (dataset size), ``hidden``; ``pause_at``: after
step k (its log and snapshot), write ``paused-<rank>`` in out and wait forever, for
the test to SIGKILL the job; ``skip_part_at``: rank 1 does not take the snapshot of
step k (a rank that never submits its part); ``roots``: node-local roots, the ranks
split evenly over them in order (rank R uses roots[R * len(roots) // world]), each
with its daemon, as on nodes of their own; ``dump_at``: after step k (its log and
snapshot) each rank writes ``rank-<R>.at-<k>.npz``, its tracked state as a snapshot
would hold it (dump.py, ``tracked_arrays``); ``auto``: the cadence's options
(``every="auto"``, e.g. ``{"max_loss": 1.0}``), with ``snapshot(step)`` called at every
step; ``step_sleep``: seconds each step also takes; ``slow_handover``: ``[rank,
seconds]``, that rank's snapshots stall that much longer (each rank's own cadence
would then aim elsewhere). At the end each rank writes
``rank-<R>.npz`` (dump.py's keys) and ``rank-<R>.close.json`` (what close() raised,
and how long it took); every step appends a line to ``rank-<R>.steps.jsonl``.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from dump import (Progress, as_array, config, leave_job, optimizer_arrays, rng_arrays,
                  tracked_arrays, write_marker)

DEFAULTS = {"steps": 30, "snapshot_every": 8, "batch_size": 4, "samples": 96,
            "hidden": 64, "dim": 16, "snapd": True, "pause_at": None,
            "skip_part_at": None, "dump_at": None, "data_version": "points-v1",
            "auto": None, "step_sleep": 0.0, "slow_handover": None}


class Points(Dataset):
    """Fixed random points and targets; an item carries its own index, so the job
    knows which samples each step consumed."""

    def __init__(self, n: int, dim: int) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, dim, generator=g)
        self.y = torch.randn(n, 4, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return i, self.x[i], self.y[i]


def build(cfg, rank: int, world: int):
    torch.manual_seed(0)   # the same initial weights everywhere (DDP broadcasts anyway)
    model = nn.Sequential(nn.Linear(cfg["dim"], cfg["hidden"]), nn.ReLU(), nn.Dropout(0.2),
                          nn.Linear(cfg["hidden"], cfg["hidden"]), nn.ReLU(),
                          nn.Linear(cfg["hidden"], 4))
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.9)
    data = Points(cfg["samples"], cfg["dim"])
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True,
                                 seed=7, drop_last=True)
    loader = DataLoader(data, batch_size=cfg["batch_size"], sampler=sampler, drop_last=True)
    # Each rank's own streams: dropout, noise and the loader's base seed differ by rank.
    torch.manual_seed(100 + rank)
    random.seed(200 + rank)
    np.random.seed(300 + rank)
    return ddp, opt, sched, loader, sampler


def plain_batches(loader, sampler):
    """What a DDP script without snapd does: set_epoch, then one pass, forever."""
    for epoch in itertools.count():
        sampler.set_epoch(epoch)
        yield from loader


def train_step(ddp, opt, sched, batch) -> float:
    _idx, x, y = batch
    scale = 0.05 * (1.0 + random.random())                 # python stream
    x = x + scale * torch.randn(x.shape)                   # torch stream, per rank
    x = x * float(np.random.uniform(0.9, 1.1))             # numpy stream
    loss = F.mse_loss(ddp(x), y)                           # dropout: torch stream
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    sched.step()
    return loss.item()


def final_state(cfg, ddp, opt, first_step, step, samples, losses):
    state = {f"param/{n}": as_array(p) for n, p in ddp.module.named_parameters()}
    state.update(optimizer_arrays(opt.state_dict()["state"]))
    state.update(rng_arrays())
    state.update({"step": np.asarray(step), "first_step": np.asarray(first_step),
                  "samples": np.asarray(samples, dtype=np.int64),
                  "losses": np.asarray(losses, dtype=np.float64),
                  "lr": np.asarray(opt.param_groups[0]["lr"])})
    return state


def slow_handover(ckpt, seconds: float) -> None:
    """This rank's snapshots stall ``seconds`` longer (inside the timed hand-over)."""
    hand_over = ckpt._hand_over

    def slower(*args, **kwargs):
        time.sleep(seconds)
        return hand_over(*args, **kwargs)
    ckpt._hand_over = slower


def close(ckpt) -> dict:
    """close(), and what it raised and how long it took, for the test to assert on."""
    closing = {"error": None, "message": "", "seconds": 0.0}
    if ckpt is not None:
        started = time.monotonic()
        try:
            ckpt.close()
        except Exception as e:
            closing.update(error=type(e).__name__, message=str(e))
        closing["seconds"] = time.monotonic() - started
    return closing


def main() -> None:
    cfg = config(DEFAULTS)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = cfg["out"]
    ddp, opt, sched, loader, sampler = build(cfg, rank, world)
    ckpt = None
    if cfg["snapd"]:
        from snapd_client import Client
        roots = cfg.get("roots") or [cfg["root"]]
        auto = {"every": "auto", **cfg["auto"]} if cfg["auto"] else {}
        ckpt = Client(roots[rank * len(roots) // world], cfg["run"], cfg["data_version"],
                      **auto)
        if cfg["slow_handover"] and cfg["slow_handover"][0] == rank:
            slow_handover(ckpt, cfg["slow_handover"][1])
        ckpt.track(model=ddp, optimizer=opt, scheduler=sched)
        batches = ckpt.batches(loader)
        step = ckpt.restore()
    else:
        batches, step = plain_batches(loader, sampler), 0
    first_step, samples, losses = step, [], []
    progress = Progress(os.path.join(out, f"rank-{rank}.steps.jsonl"))
    while step < cfg["steps"]:
        batch = next(batches)
        loss = train_step(ddp, opt, sched, batch)
        time.sleep(cfg["step_sleep"])
        step += 1
        idx = batch[0].tolist()
        samples += idx
        losses.append(loss)
        progress.step(step, loss, idx)
        if ckpt is not None:
            ckpt.log(step, loss=loss, samples=idx)
            skip = step == cfg["skip_part_at"] and rank == 1
            if (cfg["auto"] or step % cfg["snapshot_every"] == 0) and not skip:
                ckpt.snapshot(step)
        if ckpt is not None and step == cfg["dump_at"]:
            np.savez(os.path.join(out, f"rank-{rank}.at-{step}.npz"),
                     **tracked_arrays(ckpt.rng.capture(), model=ddp, optimizer=opt,
                                      scheduler=sched))
        if step == cfg["pause_at"]:
            write_marker(out, f"paused-{rank}")
            while True:
                signal.pause()   # until the test's SIGKILL
    closing = close(ckpt)
    np.savez(os.path.join(out, f"rank-{rank}.npz"),
             **final_state(cfg, ddp, opt, first_step, step, samples, losses))
    with open(os.path.join(out, f"rank-{rank}.close.json"), "w") as f:
        json.dump(closing, f)
    leave_job()


if __name__ == "__main__":
    main()
