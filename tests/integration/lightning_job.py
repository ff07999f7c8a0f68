"""A stock Lightning fit (a module with dropout, AdamW with a per-step schedule, a
shuffled DataLoader, gradient accumulation 2, bf16-mixed on the CPU, a validation
loader at each epoch's end) run by the
Lightning tests and by scripts/bench_lightning_resume.py.

``python lightning_job.py '<json>'``, the JSON holding ``root``, ``run``, ``workers``
and ``resume``: "snapd" (the stock script plus snapd's two lines, marked
``# snapd``), "lightning" (Lightning's own: ``ModelCheckpoint(save_last=True,
every_n_train_steps=every)`` and ``fit(ckpt_path="last")``) or "none". Optional:
``every`` (default 3), optimizer steps between snapshots; ``kills``, a list of
``[hook, batch]``: the process SIGKILLs itself at that hook ("start": before the
batch's forward; "end": after the batch, after the snapshot callback) of that batch
(counted over the whole fit from 0), once (a marker file in the folder ``marks``
says it happened), so the same command run again goes on; ``out``: an .npz to
write the final weights to; ``devices`` (default 1): with 2, DDP on two CPU
processes over gloo (``strategy="ddp_fork"``: the ranks are forked from this
process, already warm, where ``"ddp"`` would start a cold interpreter for the
second; the training path is the same), the job in a process group of its own so
that a kill takes every rank, as a lost node does.

Variants of the stock fit, each a key of the JSON: ``manual`` (true: the module
steps its optimizer and scheduler itself, ``automatic_optimization = False``, every
second batch and at an epoch's last one, as the automatic fit's accumulation does);
``val_check_interval`` (validation inside the epoch as well as at its end);
``val_shuffle`` (a shuffled validation loader); ``stateful`` (true: the training loader is a
torchdata ``StatefulDataLoader``). ``resume`` may also be "both": snapd's callback
beside Lightning's own ``ModelCheckpoint`` and ``fit(ckpt_path="last")``, Lightning
saving every ``lightning_every`` steps (default 2).

It prints ``weights <sha256>`` and ``optimizer <sha256>`` at the end: the final
module parameters, and the optimizer's and scheduler's states, bit for bit.
"""

import hashlib
import json
import os
import signal
import sys

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from snapd_client.lightning import SnapdCallback  # snapd

EPOCHS = 3
SAMPLES = 120      # 15 batches of 8: an epoch ends inside an accumulation window
UPDATES = 8        # per epoch: 7 whole windows of 2 batches and one of 1


class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.3),
                                 nn.Linear(64, 64), nn.ReLU(), nn.Dropout(0.3),
                                 nn.Linear(64, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(x), y))

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.05)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3,
                                                    total_steps=EPOCHS * UPDATES)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class ManualClassifier(Classifier):
    """The same fit under manual optimization: two batches' gradients summed, then one
    step of the optimizer and of the scheduler, and at an epoch's last batch."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.manual_backward(loss / 2)
        if batch_idx % 2 == 1 or batch_idx + 1 == self.trainer.num_training_batches:
            opt, sched = self.optimizers(), self.lr_schedulers()
            opt.step()
            opt.zero_grad()
            sched.step()
        return loss


class KillAt(Callback):
    """Test only: SIGKILL this process at the given hooks of the given batches."""

    def __init__(self, kills, marks, group) -> None:
        self.kills, self.marks = [tuple(k) for k in kills], marks
        self.group = group   # the job's own process group: every rank dies

    def _maybe_kill(self, trainer, hook, batch_idx) -> None:
        n = trainer.num_training_batches
        at = trainer.current_epoch * n + batch_idx
        if (hook, at) in self.kills:
            marker = os.path.join(self.marks, f"killed-{hook}-{at}")
            if not os.path.exists(marker):
                open(marker, "w").close()
                if self.group:
                    os.killpg(os.getpgrp(), signal.SIGKILL)
                os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._maybe_kill(trainer, "start", batch_idx)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._maybe_kill(trainer, "end", batch_idx)


class Report(Callback):
    """Test only: each rank prints its final state's digests at the fit's end (in the
    rank's own process: with ``ddp_fork`` the launching one holds no optimizer)."""

    def __init__(self, out) -> None:
        self.out = out

    def on_fit_end(self, trainer, pl_module):
        opt, sched = trainer.optimizers[0], trainer.lr_scheduler_configs[0].scheduler
        moments = [v for s in opt.state_dict()["state"].values() for v in s.values()]
        print("weights", digest(pl_module.parameters()), flush=True)
        print("optimizer", digest(moments), sched.last_epoch, trainer.global_step,
              flush=True)
        if self.out and trainer.global_rank == 0:
            np.savez(self.out, *[p.detach().float().numpy() for p in pl_module.parameters()])


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    cfg = json.loads(sys.argv[1])
    devices = cfg.get("devices", 1)
    if devices > 1:   # the job's own group: the ranks are forked from this process
        os.setpgid(0, 0)
    pl.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, 16, generator=g)
    y = (x[:, :4].argmax(1) + torch.randint(0, 2, (SAMPLES,), generator=g)) % 4
    loader_type = StatefulDataLoader if cfg.get("stateful") else DataLoader
    loader = loader_type(TensorDataset(x, y), batch_size=8, shuffle=True,
                         num_workers=cfg["workers"])
    model = ManualClassifier() if cfg.get("manual") else Classifier()
    every = cfg.get("every", 3)
    callbacks, ckpt_path = [Report(cfg.get("out"))], None
    if cfg["resume"] in ("snapd", "both"):
        callbacks.append(SnapdCallback(cfg["root"], run=cfg["run"], every=every))  # snapd
    if cfg["resume"] in ("lightning", "both"):
        folder = os.path.join(cfg["root"], cfg["run"] + "-lightning")
        saves = every if cfg["resume"] == "lightning" else cfg.get("lightning_every", 2)
        callbacks.append(ModelCheckpoint(dirpath=folder, save_last=True, save_top_k=0,
                                         every_n_train_steps=saves))
        ckpt_path = "last"
    if cfg.get("kills"):
        callbacks.append(KillAt(cfg["kills"], cfg["marks"], group=devices > 1))
    trainer = pl.Trainer(max_epochs=EPOCHS,
                         accumulate_grad_batches=1 if cfg.get("manual") else 2,
                         precision="bf16-mixed", accelerator="cpu", devices=devices,
                         val_check_interval=cfg.get("val_check_interval"),
                         strategy="ddp_fork" if devices > 1 else "auto",
                         logger=False, enable_progress_bar=False,
                         enable_model_summary=False,
                         enable_checkpointing=cfg["resume"] in ("lightning", "both"),
                         callbacks=callbacks)
    val = DataLoader(TensorDataset(x[:32], y[:32]), batch_size=8,   # each epoch's end
                     shuffle=cfg.get("val_shuffle", False))
    trainer.fit(model, loader, val, ckpt_path=ckpt_path)


if __name__ == "__main__":
    main()
