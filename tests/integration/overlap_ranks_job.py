"""A 2-rank job for tests/integration/test_overlap_ranks.py: restore(overlap=True) on
many ranks, run by ``python -m torch.distributed.run --standalone --nproc-per-node 2``.

    overlap_ranks_job.py OUT PHASE=ROOT [PHASE=ROOT ...]

Each PHASE runs in turn, in this process, on its own ROOT (one launch serves several
cases: a launch is most of a case's time). A per-rank model (each rank its own weights and data) with Adam, whose moments are
what a restore with overlap reads in the background. PHASE:

- ``train``: steps 1..6, a part at steps 2 and 4 (written in this process by the
  daemon's writer: no daemon needed), the state dumped at 6;
- ``overlap``: restore(overlap=True), train on to 6, dump;
- ``damaged``: restore(overlap=True), one forward and backward, then the first
  ``opt.step()``, which must raise; dumps the error and whether the weights changed;
- ``plain``: restore() (no overlap), train on to 6, dump.

The same on a DDP model (one model replicated: each replicated tensor is stored once,
by one rank's part) with ``remote`` set, its URL for each phase in the environment
variable ``OVERLAP_JOB_REMOTES`` (JSON, phase -> URL):

- ``ddp_train``: as ``train``, its parts uploaded to the remote by the test;
- ``remote``: restore(overlap=True) on a fresh root, pulling from the remote while
  the first forward and backward run, train on to 6, dump;
- ``remote_damaged``: as ``damaged``, from a remote whose optimizer file is damaged;
- ``remote_plain``: as ``plain``, from that remote (the damaged commit passed over).

A ROOT with ``{rank}`` in it is a root of each rank's own (node-local roots).

Every phase writes ``OUT/<phase>-rank<r>.pt`` (tensors, numbers and strings only:
read back with ``weights_only=True``).
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "multirank"))
from dump import leave_job  # noqa: E402

from snapd.errors import SnapdError
from snapd.options import Options
from snapd.writer import write_snapshot
from snapd_client import Client

OUT = sys.argv[1]
RANK = int(os.environ["RANK"])


def make(root, ddp=False, remote=None):
    torch.manual_seed(100 if ddp else 100 + RANK)   # without DDP: parts differ
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                                torch.nn.Linear(32, 4))
    if ddp:
        model = DDP(model)
        torch.manual_seed(100 + RANK)   # each rank its own data
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    client = Client(root, "job", daemon=False, remote=remote)
    client.track(model=model, optimizer=opt)
    return model, opt, client


def forward_backward(model, opt):
    loss = model(torch.randn(8, 16)).pow(2).mean()   # the torch RNG stream, restored
    opt.zero_grad()
    loss.backward()
    return loss


def train(model, opt, client, start, phase):
    for step in range(start + 1, 7):
        loss = forward_backward(model, opt)
        opt.step()
        client.log(step, loss=loss.item())
        if phase.endswith("train") and step in (2, 4):   # this rank's part; the last commits
            write_snapshot(client.store, client.capture(step).plan_in_memory(), Options())
    return {"model": model.state_dict(), "optimizer": opt.state_dict(),
            "rng": torch.get_rng_state()}


def first_step_refused(model, opt, client):
    """The first update after a damaged restore: the error, and the weights after."""
    forward_backward(model, opt)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        opt.step()
    except SnapdError as e:
        error = {"type": type(e).__name__, "message": str(e), "path": e.path or ""}
    else:
        error = {"type": "none", "message": "", "path": ""}
    unchanged = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    return {"error": error, "unchanged": unchanged}


def run(phase, root):
    remote = json.loads(os.environ.get("OVERLAP_JOB_REMOTES", "{}")).get(phase)
    model, opt, client = make(root.format(rank=RANK), ddp=phase.startswith(
        ("ddp", "remote")), remote=remote)
    start = client.restore(overlap=phase in ("overlap", "damaged", "remote",
                                             "remote_damaged")) \
        if not phase.endswith("train") else 0
    got = first_step_refused(model, opt, client) if phase.endswith("damaged") else \
        {"state": train(model, opt, client, start, phase)}
    client.close()
    torch.save({"start": start, "restored_from": client.restored_from or "", **got},
               os.path.join(OUT, f"{phase}-rank{RANK}.pt"))


def main():
    dist.init_process_group("gloo")
    for arg in sys.argv[2:]:
        phase, root = arg.split("=", 1)
        run(phase, root)
    leave_job()


if __name__ == "__main__":
    main()
