"""The stock training loops scripts/bench_frameworks.py times: one Lightning fit and one
Hugging Face ``Trainer.train()``, each run one of three ways, with the clock that
stamps every step.

Imported by scripts/bench_frameworks.py (in its child processes) and by its test;
not run on its own.

- ``none``: the stock loop, no checkpoint at all;
- ``own``: the framework's own checkpoint every N steps (Lightning
  ``ModelCheckpoint(every_n_train_steps=N)``, the Trainer's ``save_strategy="steps",
  save_steps=N``), as a user turns it on;
- ``snapd``: a snapshot every N steps (``SnapdCallback(root, run, every=N)``,
  ``snapd_client.transformers.Trainer(snapd_options={"every": N})``).

The models are sized to a state (weights + AdamW's two moments) of at least ``size``
bytes: Lightning trains a wide MLP (``Linear(width, width)`` layers, benchlib's
state), the Trainer a GPT-2 built from its config (``n_embd=width``, as many layers
as it takes).

**The clock.** Each step's start is stamped when the framework starts it
(Lightning's ``on_train_batch_start``, the Trainer's ``on_step_begin``): after the
previous step's checkpoint or snapshot has returned. The timed *window* runs from
the start of step N+1 to the start of step kN+1, the last period boundary stamped:
k-1 periods of N steps, each ending with a checkpoint (steps 2N, ..., kN), and the
background write of each snapd snapshot from N to (k-1)N runs beside the next
period's steps. The first checkpoint, whose cost holds a daemon's start, an
arena's first touch or a folder's creation, is before the window.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any, Dict, List

import benchlib

WAYS = ("none", "own", "snapd")
FRAMEWORKS = ("lightning", "transformers")
RUN = "bench"


def window(every: int, steps: int) -> tuple:
    """The first and the last stamped step of the timed window: (N+1, kN+1)."""
    k = (steps - 1) // every
    if k < 2:
        raise ValueError(f"steps={steps}, every={every}: the window needs a "
                         "checkpoint after the first (steps >= 2*every + 1)")
    return every + 1, k * every + 1


class Stamps:
    """Each step's start (``perf_counter``, and the wall clock the state log stamps its
    records with), and at the window's two ends the CPU
    time this process and the run's snapd daemon (when there is one) have used: what
    the daemon's writing takes from a machine's cores while training runs."""

    def __init__(self, root: str, marks: tuple) -> None:
        self.root, self.marks = root, marks
        self.starts: Dict[int, float] = {}
        self.walls: Dict[int, float] = {}
        self.cpu: Dict[int, Dict[str, Any]] = {}

    def start(self, step: int) -> None:
        self.starts[step] = time.perf_counter()
        self.walls[step] = time.time()
        if step in self.marks:
            self.cpu[step] = {"trainer": time.process_time(), "daemon": self._daemon()}

    def _daemon(self) -> Any:
        import psutil
        pid = benchlib.daemon_pid_of(self.root)
        try:
            return sum(psutil.Process(pid).cpu_times()[:2]) if pid else None
        except psutil.Error:
            return None

    def figures(self) -> Dict[str, Any]:
        first, last = self.marks
        steps = sorted(self.starts)
        a, b = self.cpu[first], self.cpu[last]
        return {"window_s": self.starts[last] - self.starts[first],
                "step_s": (self.starts[last] - self.starts[first]) / (last - first),
                # each step's time, from its start to the next one's (its checkpoint in)
                "step_times": [self.starts[j] - self.starts[i]
                               for i, j in zip(steps, steps[1:])],
                "stamped": steps, "step_walls": [self.walls[s] for s in steps],
                "trainer_cpu_s": b["trainer"] - a["trainer"],
                "daemon_cpu_s": None if a["daemon"] is None or b["daemon"] is None
                else b["daemon"] - a["daemon"]}


def snapshot_stalls(root: str) -> List[Dict[str, Any]]:
    """What snapshot() cost the training thread, as the client logged it: the
    ``staged`` event of each snapshot (``stall``: the call's time; ``waited``: the part
    spent waiting for a free staging slot; ``staged_at``: its wall time, at the call's
    end), and ``durable_at``, the wall time its ``committed`` event was logged (None
    for one not committed)."""
    from snapd.statelog import read_records
    records = list(read_records(os.path.join(root, RUN), 0))
    durable = {r["step"]: float(r["time"]) for r in records
               if r.get("kind") == "snapshot" and r.get("event") == "committed"}
    return [{"step": r["step"], "stall_s": float(r["stall"]),
             "waited_s": float(r.get("waited") or 0.0), "staged_at": float(r["time"]),
             "durable_at": durable.get(r["step"])}
            for r in records if r.get("kind") == "snapshot" and r.get("event") == "staged"]


def copy_stalls(tensors, reps: int = 3) -> List[float]:
    """The reference: ``copy_`` of the same state into preallocated memory (faulted
    in first), each after 50 ms of matmuls as a training loop runs them."""
    import torch
    private = [torch.empty_like(t) for t in tensors]
    benchlib.timed_copy(private, tensors)   # faults the destination in
    out = []
    for _ in range(reps):
        benchlib.train_briefly()
        out.append(benchlib.timed_copy(private, tensors))
    return out


def run_way(cfg: Dict[str, Any]) -> Dict[str, Any]:
    """One loop, one way, in this process: the step stamps, the fit's time, the
    checkpoints taken, snapd's logged stalls and the reference copy's."""
    import torch
    torch.set_num_threads(cfg["threads"])
    os.makedirs(cfg["dir"], exist_ok=True)
    cfg.setdefault("root", os.path.join(cfg["dir"], "snapd"))
    stamps = Stamps(cfg["root"], window(cfg["every"], cfg["steps"]))
    loop = lightning_fit if cfg["framework"] == "lightning" else trainer_train
    res = loop(cfg, stamps)
    res.update(framework=cfg["framework"], way=cfg["way"],
               state_bytes=benchlib.nbytes_of(res["tensors"]),
               n_tensors=len(res["tensors"]), window=list(stamps.marks),
               **stamps.figures())
    res["snapshots"] = snapshot_stalls(cfg["root"]) if cfg["way"] == "snapd" else []
    res["copy_s"] = copy_stalls(res.pop("tensors"), cfg.get("copy_reps", 3))
    return res


# --- Lightning ----------------------------------------------------------------------

def lightning_fit(cfg: Dict[str, Any], stamps: Stamps) -> Dict[str, Any]:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    class WideMLP(pl.LightningModule):
        def __init__(self, width: int, layers: int) -> None:
            super().__init__()
            self.net = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class Clock(Callback):
        def __init__(self, saves: bool) -> None:
            self.saves: List[int] = []
            self.record_saves = saves   # snapd's snapshots dump Lightning's state too

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            stamps.start(trainer.global_step + 1)

        def on_save_checkpoint(self, trainer, pl_module, checkpoint):
            if self.record_saves:
                self.saves.append(trainer.global_step)

    width, every, way = cfg["width"], cfg["every"], cfg["way"]
    pl.seed_everything(0, verbose=False)
    layers = max(1, math.ceil(cfg["size"] / ((width * width + width) * 4 * 3)))
    g = torch.Generator().manual_seed(1)
    n = cfg["steps"] * cfg["batch"]
    loader = DataLoader(TensorDataset(torch.randn(n, width, generator=g),
                                      torch.randn(n, width, generator=g)),
                        batch_size=cfg["batch"], shuffle=True)
    model = WideMLP(width, layers)
    clock = Clock(saves=way == "own")
    callbacks: List[Any] = [clock]
    if way == "own":
        callbacks.append(ModelCheckpoint(dirpath=os.path.join(cfg["dir"], "checkpoints"),
                                         every_n_train_steps=every))
    elif way == "snapd":
        from snapd_client.lightning import SnapdCallback
        callbacks.append(SnapdCallback(cfg["root"], run=RUN, every=every,
                                       **cfg.get("client", {})))
    trainer = pl.Trainer(max_steps=cfg["steps"], max_epochs=1, accelerator="cpu",
                         devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=way == "own",
                         num_sanity_val_steps=0, callbacks=callbacks,
                         default_root_dir=cfg["dir"])
    t0 = time.perf_counter()
    trainer.fit(model, loader)
    fit_s = time.perf_counter() - t0
    opt = trainer.optimizers[0]
    return {"fit_s": fit_s, "saves": clock.saves,
            "global_step": trainer.global_step, "layers": layers,
            "tensors": benchlib.state_tensors(model, opt)}


# --- the Hugging Face Trainer -------------------------------------------------------

def gpt2_layers(size: int, width: int, vocab: int, positions: int) -> int:
    """GPT-2 blocks for a state of at least ``size`` bytes: 12*width^2 weights a block
    (plus biases and norms), embeddings (vocab + positions) * width, 12 bytes a
    weight (itself and AdamW's two moments)."""
    block = 12 * width * width + 13 * width
    rest = size / 12 - (vocab + positions) * width
    return max(1, math.ceil(rest / block))


def trainer_train(cfg: Dict[str, Any], stamps: Stamps) -> Dict[str, Any]:
    import torch
    from transformers import (GPT2Config, GPT2LMHeadModel, TrainerCallback,
                              TrainingArguments, set_seed)

    class Tokens(torch.utils.data.Dataset):
        def __init__(self, n: int, length: int, vocab: int) -> None:
            self.data = torch.randint(0, vocab, (n, length),
                                      generator=torch.Generator().manual_seed(7))

        def __len__(self):
            return len(self.data)

        def __getitem__(self, i):
            return {"input_ids": self.data[i], "labels": self.data[i]}

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.saves: List[int] = []

        def on_step_begin(self, args, state, control, **kwargs):
            stamps.start(state.global_step + 1)

        def on_save(self, args, state, control, **kwargs):   # the Trainer's own saves
            self.saves.append(state.global_step)

    width, every, way, seq = cfg["width"], cfg["every"], cfg["way"], cfg["seq"]
    set_seed(0)
    layers = gpt2_layers(cfg["size"], width, cfg["vocab"], seq)
    config = GPT2Config(vocab_size=cfg["vocab"], n_positions=seq, n_embd=width,
                        n_layer=layers, n_head=max(1, width // 64))
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(
        output_dir=cfg["dir"], run_name=RUN, max_steps=cfg["steps"],
        per_device_train_batch_size=cfg["batch"], learning_rate=1e-4,
        save_strategy="steps" if way == "own" else "no", save_steps=every,
        logging_steps=every, dataloader_num_workers=0, use_cpu=True, report_to="none",
        disable_tqdm=True, seed=0)
    if way == "snapd":
        from snapd_client.transformers import Trainer
        extra = {"snapd_root": cfg["root"], "snapd_run": RUN,
                 "snapd_options": {"every": every, **cfg.get("client", {})}}
    else:
        from transformers import Trainer
        extra = {}
    clock = Clock()
    trainer = Trainer(model=model, args=args, callbacks=[clock],
                      train_dataset=Tokens(cfg["steps"] * cfg["batch"], seq, cfg["vocab"]),
                      **extra)
    t0 = time.perf_counter()
    trainer.train()
    fit_s = time.perf_counter() - t0
    opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)   # accelerate's wrapper
    return {"fit_s": fit_s, "saves": clock.saves,
            "global_step": trainer.state.global_step, "layers": layers,
            "tensors": benchlib.state_tensors(model, opt)}
