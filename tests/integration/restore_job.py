"""A small multi-rank job for tests/integration/test_multirank_restore.py, run by
``python -m torch.distributed.run --standalone --nproc-per-node N``.

    restore_job.py ROOT OUT PHASE

A per-rank model (each rank its own weights and data) with SGD;
PHASE ``train`` trains steps 1..6, a part at steps 2 and 4, and dumps its state at 6;
PHASE ``resume`` restores, trains on to 6 and dumps. Every phase writes
``OUT/<phase>-rank<r>.pt``: the restored step and the state.

Parts are written in-process from the client's capture, by the writer the daemon
uses: the test needs no daemon.
"""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "multirank"))
from dump import leave_job  # noqa: E402

from snapd.options import Options
from snapd.writer import write_snapshot
from snapd_client import Client

ROOT, OUT, PHASE = sys.argv[1:4]
RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def write_part(client, step):
    """This rank's part of snapshot ``step`` through the one commit path, in this
    process (the last rank's write commits it)."""
    write_snapshot(client.store, client.capture(step).plan_in_memory(), Options())


def plain():
    torch.manual_seed(100 + RANK)   # every rank its own model: parts differ
    model = torch.nn.Linear(5, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    client = Client(ROOT, "job", daemon=False)
    client.track(model=model, optimizer=opt)
    start = client.restore() if PHASE == "resume" else 0
    for step in range(start + 1, 7):
        x = torch.randn(8, 5)          # the torch RNG stream, restored per rank
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        client.log(step, loss=loss.item())
        if PHASE == "train" and step in (2, 4):
            write_part(client, step)
    client.close()
    return start, {"model": model.state_dict(), "optimizer": opt.state_dict(),
                   "rng": torch.get_rng_state()}


def main():
    dist.init_process_group("gloo")
    start, state = plain()
    torch.save({"start": start, "world": WORLD, "state": state},
               os.path.join(OUT, f"{PHASE}-rank{RANK}.pt"))
    leave_job()


if __name__ == "__main__":
    main()
