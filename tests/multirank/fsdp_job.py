"""An FSDP2 training job (``fully_shard`` on a CPU device mesh, gloo) for the
multi-rank tests, started by torchrun at any world size:
``python -m torch.distributed.run --standalone --nproc-per-node N fsdp_job.py JSON``.

A stack of small blocks, each sharded, and Adam: the model's and the optimizer's
state are DTensors, one shard per rank. The job restores what the run has (at this
world size or another), writes the FULL tensors it restored to ``restored.npz``
(each DTensor's ``full_tensor()``; rank 0 writes), trains to ``steps`` with a snapshot
every ``snapshot_every`` steps, and writes the full tensors it ends with to
``final.npz``. Each rank writes ``rank-<R>.json``: world size, first and last step,
its losses. Settings (JSON): root, run, out, ``steps``, ``snapshot_every``, ``width``,
``blocks``, ``batch_size``; ``"snapd": false`` trains and dumps without snapd (a
check of the job itself: FSDP2 runs on CPU with gloo); ``overlap``: restore with
overlap (the optimizer's moments read in the background); ``daemon``: false writes
in the job; ``first_step_only``: after the restore, one forward and backward and the
first ``opt.step()``, which may raise: ``rank-<R>.json`` gets ``refused`` (the
error's type, message and path, or type "none") and ``unchanged`` (no weight moved).
``phases``: a list of settings (each over the rest) run in turn in the same
processes, each with a new model, optimizer and client: one launch serves several
cases (a launch is most of a case's time).
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from dump import as_array, config, leave_job, optimizer_arrays

DEFAULTS = {"steps": 4, "snapshot_every": 4, "width": 48, "blocks": 3, "batch_size": 8,
            "data_version": "noise-v1", "snapd": True, "overlap": False, "daemon": True,
            "first_step_only": False, "phases": [{}]}


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, width: int, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build(cfg, world: int):
    torch.manual_seed(0)
    model = Net(cfg["width"], cfg["blocks"])
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, opt


def full(t):
    """The whole tensor of a DTensor (a collective), or the tensor itself."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def full_state(model, opt) -> dict:
    """Every model and optimizer tensor, whole; every rank calls it (collectives)."""
    state = {f"param/{k}": as_array(full(v)) for k, v in sorted(model.state_dict().items())}
    state.update(optimizer_arrays(opt.state_dict()["state"], full))
    return state


def dump_full(model, opt, path: str, rank: int, step: int) -> None:
    state = full_state(model, opt)
    if rank == 0:
        np.savez(path, step=np.asarray(step), **state)


def forward_backward(model, opt, cfg, gen) -> float:
    x = torch.randn(cfg["batch_size"], cfg["width"], generator=gen)
    loss = F.mse_loss(model(x), x.sum(dim=1, keepdim=True).tanh())
    opt.zero_grad(set_to_none=True)
    loss.backward()
    return loss.item()


def train_step(model, opt, cfg, gen) -> float:
    loss = forward_backward(model, opt, cfg, gen)
    opt.step()
    return loss


def first_step(model, opt, cfg, gen) -> dict:
    """The first update after the restore: its error, and whether any weight moved."""
    from snapd.errors import SnapdError
    forward_backward(model, opt, cfg, gen)
    before = {k: v.to_local().clone() for k, v in model.state_dict().items()}
    try:
        opt.step()
    except SnapdError as e:
        refused = {"type": type(e).__name__, "message": str(e), "path": e.path or ""}
    else:
        refused = {"type": "none", "message": "", "path": ""}
    return {"refused": refused, "unchanged": all(
        torch.equal(before[k], v.to_local()) for k, v in model.state_dict().items())}


def main() -> None:
    cfg = config(DEFAULTS)
    dist.init_process_group("gloo")
    for phase in cfg["phases"]:
        run({**cfg, **phase})
    leave_job()


def run(cfg) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = build(cfg, world)
    gen = torch.Generator().manual_seed(1000 + rank)   # this rank's data stream
    ckpt, step = None, 0
    if cfg["snapd"]:
        from snapd_client import Client
        ckpt = Client(cfg["root"], cfg["run"], cfg["data_version"], daemon=cfg["daemon"])
        ckpt.track(model=model, optimizer=opt, data=gen)
        step = ckpt.restore(overlap=cfg["overlap"])
    first = step
    dump_full(model, opt, os.path.join(cfg["out"], "restored.npz"), rank, step)
    if cfg["first_step_only"]:
        with open(os.path.join(cfg["out"], f"rank-{rank}.json"), "w") as f:
            json.dump({"world_size": world, "first_step": first,
                       **first_step(model, opt, cfg, gen)}, f)
        ckpt.close()
        return
    losses = []
    while step < cfg["steps"]:
        losses.append(train_step(model, opt, cfg, gen))
        step += 1
        if ckpt is not None:
            ckpt.log(step, loss=losses[-1])
            if step % cfg["snapshot_every"] == 0:
                ckpt.snapshot(step)
    if ckpt is not None:
        ckpt.close()
    dump_full(model, opt, os.path.join(cfg["out"], "final.npz"), rank, step)
    with open(os.path.join(cfg["out"], f"rank-{rank}.json"), "w") as f:
        json.dump({"world_size": world, "first_step": first, "step": step,
                   "losses": losses}, f)


if __name__ == "__main__":
    main()
