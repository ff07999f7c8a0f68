"""A Trainer class with callbacks, in the style of karpathy/minGPT (projects/adder).

    python mingpt_adder_style.py '{"root": ..., "run": ..., "max_iters": 60}'

The trainer owns the optimizer and an endless random-sampling loader; a batch-end
callback evaluates now and then and keeps the best score on the trainer
(``trainer.top_score``). Lines ending in ``# snapd`` are what adding snapd took;
``# test`` lines are the test's hooks.
"""

import hashlib
import json
import os
import signal
import sys
from collections import defaultdict

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.sampler import RandomSampler

from snapd_client import Client  # snapd

cfg = json.loads(sys.argv[1])
torch.manual_seed(3407)
torch.set_num_threads(1)
NDIGIT = 2


class AdditionDataset(Dataset):
    """a + b = c, digits in, the sum's digits (reversed) out."""

    def __init__(self, split):
        perm = torch.randperm(10 ** (2 * NDIGIT), generator=torch.Generator().manual_seed(1337))
        self.ixes = perm[:200] if split == "test" else perm[200:1200]

    def __len__(self):
        return len(self.ixes)

    def __getitem__(self, idx):
        idx = self.ixes[idx].item()
        a, b = idx // 10 ** NDIGIT, idx % 10 ** NDIGIT
        render = f"{a:0{NDIGIT}d}{b:0{NDIGIT}d}{a + b:0{NDIGIT + 1}d}"[::-1]
        dix = torch.tensor([int(s) for s in render[::-1][:2 * NDIGIT]] + [int(s) for s in render[:NDIGIT + 1]])
        x, y = dix[:-1].clone(), dix[1:].clone()
        y[:2 * NDIGIT - 1] = -1  # only the sum's digits are predicted
        return x, y


class GPT(nn.Module):
    def __init__(self, vocab_size=10, block_size=3 * NDIGIT, n_embd=16):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab_size, n_embd), nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(0.1)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))
        self.head = nn.Linear(n_embd, vocab_size)

    def forward(self, idx, targets=None):
        x = self.drop(self.tok(idx) + self.pos(torch.arange(idx.size(1))))
        logits = self.head(x + self.mlp(x))
        loss = None if targets is None else F.cross_entropy(
            logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss

    def configure_optimizers(self, config):
        return torch.optim.AdamW(self.parameters(), lr=config["learning_rate"], betas=(0.9, 0.95))


class Trainer:
    def __init__(self, config, model, train_dataset):
        self.config, self.model, self.train_dataset = config, model, train_dataset
        self.optimizer = None
        self.callbacks = defaultdict(list)
        self.iter_num = 0
        self.top_score = 0

    def add_callback(self, onevent, callback):
        self.callbacks[onevent].append(callback)

    def trigger_callbacks(self, onevent):
        for callback in self.callbacks.get(onevent, []):
            callback(self)

    def run(self):
        model, config = self.model, self.config
        self.optimizer = model.configure_optimizers(config)
        train_loader = DataLoader(
            self.train_dataset,
            sampler=RandomSampler(self.train_dataset, replacement=True, num_samples=int(1e10)),
            shuffle=False, batch_size=config["batch_size"])
        model.train()
        self.iter_num = 0
        ckpt = Client(config["root"], run=config["run"]).track_attrs(self, "model", "optimizer", "iter_num", "top_score")  # snapd
        data_iter = ckpt.batches(train_loader)  # snapd
        ckpt.restore()  # snapd
        while True:
            try:
                batch = next(data_iter)
            except StopIteration:
                data_iter = iter(train_loader)
                batch = next(data_iter)
            x, y = batch
            logits, self.loss = model(x, y)
            model.zero_grad(set_to_none=True)
            self.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            self.optimizer.step()
            self.trigger_callbacks("on_batch_end")
            self.iter_num += 1
            if self.iter_num % 10 == 0: ckpt.snapshot(self.iter_num)  # snapd
            if self.iter_num == config.get("kill_at"): os.kill(os.getpid(), signal.SIGKILL)  # test
            if self.iter_num >= config["max_iters"]:
                break
        ckpt.close()  # snapd


def eval_split(trainer, dataset, max_batches):
    results = []
    loader = DataLoader(dataset, batch_size=50, drop_last=False)
    for b, (x, y) in enumerate(loader):
        logits, _ = model(x)
        pred = logits.argmax(-1)[:, -(NDIGIT + 1):]
        results.extend((pred == y[:, -(NDIGIT + 1):]).all(1).tolist())
        if max_batches is not None and b + 1 >= max_batches:
            break
    return sum(results)


def batch_end_callback(trainer):
    print(f"iter {trainer.iter_num}: train loss {trainer.loss.item()!r}", flush=True)
    if trainer.iter_num % 8 == 0:
        model.eval()
        with torch.no_grad():
            score = eval_split(trainer, train_dataset, 2) + eval_split(trainer, test_dataset, 2)
        if score > trainer.top_score:
            trainer.top_score = score
            print(f"iter {trainer.iter_num}: saving model with new top score of {score}")
        model.train()


train_dataset, test_dataset = AdditionDataset("train"), AdditionDataset("test")
model = GPT()
config = {"learning_rate": 2e-2, "batch_size": 16, "max_iters": cfg.get("max_iters", 60), **cfg}
trainer = Trainer(config, model, train_dataset)
trainer.add_callback("on_batch_end", batch_end_callback)
trainer.run()
print("top_score", trainer.top_score)  # test
print("weights", hashlib.sha256(b"".join(t.numpy().tobytes() for t in model.state_dict().values())).hexdigest())  # test
