"""A stock hand-written Accelerate loop (an MLP with dropout, AdamW with a per-update
warmup-and-decay schedule, a shuffled DataLoader, gradient accumulation 2 through
``accelerator.accumulate``; CPU, one process), run by test_accelerate_resume.py.
snapd adds the plain client's lines, each marked ``# snapd``.

``python accelerate_job.py CONFIG_JSON``; CONFIG: ``out`` (this run's files), ``root``
and ``run`` (snapd's), ``mode`` ("snapd", or "none": the loop without the marked
lines), ``workers``, and the test's ``kills``: points where the process SIGKILLs
itself, each once (a file in ``out`` records it, so that the same command, started
again, goes past it): ``["update", k]`` (update k done and logged, before its
snapshot), ``["micro", k]`` (after the first batch of update k+1's window, its
gradient accumulated), ``["handed", k]`` (right after snapshot k was handed to the
daemon, while it is written). At the end it writes ``final.safetensors`` (weights and
optimizer state) and ``final.json`` (the loss logged at each update, the batches this
process took and the samples it fetched, with 0 workers).
"""

import json
import os
import signal
import sys

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from safetensors.torch import save_file
from torch.utils.data import DataLoader, Dataset

cfg = json.loads(sys.argv[1])
snapd = cfg["mode"] == "snapd"
if snapd:
    from snapd_client import Client  # snapd

EPOCHS, UPDATES, EVERY = 3, 24, 4   # 15 batches an epoch: 7 windows of 2, then one of 1


class Points(Dataset):
    """60 generated samples; counts what it is asked for (with 0 workers)."""

    def __init__(self):
        g = torch.Generator().manual_seed(7)
        self.x, self.y = torch.randn(60, 8, generator=g), torch.randn(60, 1, generator=g)
        self.fetched = 0

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        self.fetched += 1
        return self.x[i], self.y[i]


def kill_once(kind, step):
    if [kind, step] in cfg.get("kills", []):
        mark = os.path.join(cfg["out"], f"killed-{kind}-{step}")
        if not os.path.exists(mark):
            open(mark, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)


torch.set_num_threads(1)   # runs side by side on a small machine: no threads spinning

# --- the stock loop ----------------------------------------------------------------------

set_seed(42)
accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                            torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                            torch.nn.Linear(32, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
scheduler = torch.optim.lr_scheduler.LambdaLR(
    optimizer, lambda u: min(1.0, (u + 1) / 4) * max(0.1, 1 - u / UPDATES))
data = Points()
loader = DataLoader(data, batch_size=4, shuffle=True, num_workers=cfg.get("workers", 0))
model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

step, first_epoch, losses, taken = 0, 0, {}, 0
if snapd:
    ckpt = Client(cfg["root"], run=cfg["run"], every=EVERY)  # snapd
    ckpt.track(model=model, optimizer=optimizer, scheduler=scheduler)  # snapd
    loader = ckpt.batches(loader)  # snapd
    step = ckpt.restore()  # snapd
    first_epoch = loader.epoch  # snapd
for epoch in range(first_epoch, EPOCHS):
    for x, y in loader:
        taken += 1
        with accelerator.accumulate(model):
            loss = F.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if not accelerator.sync_gradients:
            kill_once("micro", step)
            continue
        step += 1
        losses[step] = loss.item()
        if snapd:
            ckpt.log(step, loss=loss.item())  # snapd
            kill_once("update", step)
            ckpt.snapshot(step)  # snapd
            kill_once("handed", step)
if snapd:
    ckpt.close()  # snapd

# --- what the test compares --------------------------------------------------------------

tensors = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
for p, state in optimizer.state_dict()["state"].items():
    for k, v in state.items():
        tensors[f"optimizer.{p}.{k}"] = torch.as_tensor(v).detach().clone()
tensors["scheduler.last_epoch"] = torch.tensor(scheduler.scheduler.last_epoch)
save_file(tensors, os.path.join(cfg["out"], "final.safetensors"))
with open(os.path.join(cfg["out"], "final.json"), "w") as f:
    json.dump({"losses": losses, "taken": taken, "fetched": data.fetched}, f)
