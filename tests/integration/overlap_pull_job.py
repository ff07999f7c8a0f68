"""A restore with overlap from the remote tier, killed while the optimizer's files are
still downloading: for tests/integration/test_remote_overlap_s3.py.

    overlap_pull_job.py ROOT URL MARKER

Restores run ``r`` under ROOT from URL with ``restore(overlap=True)``, the background
half of the pull held (remotearrival.FINISH substituted by one that never goes on),
then runs the first forward and backward and writes MARKER; the test SIGKILLs it
there. The AWS variables come from the environment.
"""

import sys
import threading

import torch

from snapd_client import Client, remotearrival

ROOT, URL, MARKER = sys.argv[1:4]


def held(pending, read, **how):
    threading.Event().wait()   # until the process is killed


remotearrival.FINISH = held
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
opt = torch.optim.AdamW(model.parameters(), lr=0.05)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
client = Client(ROOT, "r", daemon=False, remote=URL)
client.track(model=model, optimizer=opt, scheduler=sched)
step = client.restore(overlap=True)
assert client.optimizer_state_pending and client.restored_from == "remote"
((model(torch.randn(16, 8)) - torch.randn(16, 3)) ** 2).mean().backward()
with open(MARKER, "w") as f:
    f.write(str(step))
threading.Event().wait()
