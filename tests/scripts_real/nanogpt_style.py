"""A module-level training script in the style of karpathy/nanoGPT's train.py.

    python nanogpt_style.py '{"root": ..., "run": ..., "max_iters": 40}'

Loop state lives in module globals: the prefetched batch ``X, Y`` (fetched before the
update it feeds), ``iter_num``, ``best_val_loss``; the learning rate is computed from
``iter_num``. Lines ending in ``# snapd`` are what adding snapd took; ``# test`` lines
are the test's hooks (the kill, the final digest).
"""

import hashlib
import json
import math
import os
import signal
import sys

import torch
from torch import nn
from torch.nn import functional as F

from snapd_client import Client  # snapd

cfg = json.loads(sys.argv[1])
max_iters, eval_interval, eval_iters = cfg.get("max_iters", 40), 8, 2
snapshot_interval = 10
block_size, batch_size, vocab_size, n_embd = 8, 4, 16, 16
learning_rate, min_lr, warmup_iters, lr_decay_iters = 1e-2, 1e-3, 5, 40
torch.manual_seed(1337)
torch.set_num_threads(1)

data = torch.randint(vocab_size, (400,), generator=torch.Generator().manual_seed(0))
train_data, val_data = data[:360], data[360:]


def get_batch(split):
    data = train_data if split == "train" else val_data
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([data[i:i + block_size] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + block_size] for i in ix])
    return x, y


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(0.1)
        self.attn = nn.MultiheadAttention(n_embd, 2, batch_first=True)
        self.lm_head = nn.Linear(n_embd, vocab_size)

    def forward(self, idx, targets):
        t = idx.size(1)
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(t)))
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool), 1)
        x = x + self.attn(x, x, x, attn_mask=mask, need_weights=False)[0]
        logits = self.lm_head(x)
        return logits, F.cross_entropy(logits.view(-1, vocab_size), targets.view(-1))


@torch.no_grad()
def estimate_loss():
    out = {}
    model.eval()
    for split in ["train", "val"]:
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            X, Y = get_batch(split)
            losses[k] = model(X, Y)[1].item()
        out[split] = losses.mean()
    model.train()
    return out


def get_lr(it):
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    ratio = min(1.0, (it - warmup_iters) / (lr_decay_iters - warmup_iters))
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


iter_num = 0
best_val_loss = 1e9
model = GPT()
optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)

X, Y = get_batch("train")  # fetch the very first batch
ckpt = Client(cfg["root"], run=cfg["run"]).track_globals("model", "optimizer", "X", "Y", "iter_num", "best_val_loss")  # snapd
ckpt.restore()  # snapd
while True:
    lr = get_lr(iter_num)
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr
    if iter_num % eval_interval == 0:
        losses = estimate_loss()
        print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        if losses["val"] < best_val_loss:
            best_val_loss = losses["val"]
    logits, loss = model(X, Y)
    X, Y = get_batch("train")  # prefetch the next batch while the GPU would be busy
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    lossf = loss.item()
    print(f"iter {iter_num}: loss {lossf!r}", flush=True)
    iter_num += 1
    ckpt.log(iter_num, loss=lossf)  # snapd
    if iter_num % snapshot_interval == 0: ckpt.snapshot(iter_num)  # snapd
    if iter_num == cfg.get("kill_at"): os.kill(os.getpid(), signal.SIGKILL)  # test
    if iter_num > max_iters:
        break
ckpt.close()  # snapd
print("best_val_loss", repr(float(best_val_loss)))  # test
print("weights", hashlib.sha256(b"".join(t.numpy().tobytes() for t in model.state_dict().values())).hexdigest())  # test
