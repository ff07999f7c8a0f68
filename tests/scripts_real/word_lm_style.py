"""An epoch loop in the style of pytorch/examples' word_language_model/main.py.

    python word_lm_style.py '{"root": ..., "run": ..., "epochs": 3}'

Plain SGD written by hand with a learning rate annealed (``lr /= 4.0``) whenever the
validation loss does not improve, and an LSTM ``hidden`` state carried from batch to
batch (repackaged, detached, each batch). Lines ending in ``# snapd`` are what adding
snapd took; ``# test`` lines are the test's hooks.
"""

import hashlib
import json
import os
import signal
import sys

import torch
from torch import nn

from snapd_client import Client  # snapd

cfg = json.loads(sys.argv[1])
epochs, bptt, bsz, ntokens, clip = cfg.get("epochs", 3), 5, 4, 20, 0.25
torch.manual_seed(1111)
torch.set_num_threads(1)

corpus = torch.randint(ntokens, (500,), generator=torch.Generator().manual_seed(3))


def batchify(data, bsz):
    nbatch = data.size(0) // bsz
    return data[:nbatch * bsz].view(bsz, -1).t().contiguous()


train_data, val_data = batchify(corpus[:400], bsz), batchify(corpus[400:], bsz)


class RNNModel(nn.Module):
    def __init__(self, ntoken, ninp, nhid):
        super().__init__()
        self.drop = nn.Dropout(0.2)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid)
        self.decoder = nn.Linear(nhid, ntoken)
        self.nhid = nhid

    def forward(self, input, hidden):
        output, hidden = self.rnn(self.drop(self.encoder(input)), hidden)
        return self.decoder(self.drop(output)).view(-1, self.decoder.out_features), hidden

    def init_hidden(self, bsz):
        return (torch.zeros(1, bsz, self.nhid), torch.zeros(1, bsz, self.nhid))


def repackage_hidden(h):
    """Wraps hidden states in new Tensors, to detach them from their history."""
    if isinstance(h, torch.Tensor):
        return h.detach()
    return tuple(repackage_hidden(v) for v in h)


def get_batch(source, i):
    seq_len = min(bptt, len(source) - 1 - i)
    return source[i:i + seq_len], source[i + 1:i + 1 + seq_len].reshape(-1)


def evaluate(data_source):
    model.eval()
    total_loss, hidden = 0.0, model.init_hidden(bsz)
    with torch.no_grad():
        for i in range(0, data_source.size(0) - 1, bptt):
            data, targets = get_batch(data_source, i)
            output, hidden = model(data, hidden)
            total_loss += len(data) * criterion(output, targets).item()
    return total_loss / (len(data_source) - 1)


def train_batch(data, targets):
    global hidden
    model.train()
    hidden = repackage_hidden(hidden)
    model.zero_grad()
    output, hidden = model(data, hidden)
    loss = criterion(output, targets)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    for p in model.parameters():
        p.data.add_(p.grad, alpha=-lr)
    return loss.item()


model = RNNModel(ntokens, 8, 8)
criterion = nn.CrossEntropyLoss()
lr, best_val_loss = 20.0, None
epoch, i, step = 1, 0, 0  # the epoch, the next batch's first row in it, the updates done
hidden = model.init_hidden(bsz)
ckpt = Client(cfg["root"], run=cfg["run"]).track_globals("model", "lr", "best_val_loss", "epoch", "i", "step", "hidden")  # snapd
ckpt.restore()  # snapd
while epoch <= epochs:
    while i < train_data.size(0) - 1:
        data, targets = get_batch(train_data, i)
        loss = train_batch(data, targets)
        i, step = i + bptt, step + 1
        print(f"| epoch {epoch} | batch {i // bptt} | lr {lr} | loss {loss!r}", flush=True)
        ckpt.log(step, loss=loss)  # snapd
        if step % 7 == 0: ckpt.snapshot(step)  # snapd
        if step == cfg.get("kill_at"): os.kill(os.getpid(), signal.SIGKILL)  # test
    val_loss = evaluate(val_data)
    print(f"| end of epoch {epoch} | valid loss {val_loss!r}")
    if not best_val_loss or val_loss < best_val_loss:
        best_val_loss = val_loss
    else:
        lr /= 4.0  # anneal the learning rate if no improvement has been seen
    epoch, i, hidden = epoch + 1, 0, model.init_hidden(bsz)
ckpt.close()  # snapd
print("weights", hashlib.sha256(b"".join(t.numpy().tobytes() for t in model.state_dict().values())).hexdigest())  # test
