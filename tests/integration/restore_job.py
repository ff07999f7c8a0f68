"""A small multi-rank job for tests/integration/test_multirank_restore.py, run by
``python -m torch.distributed.run --standalone --nproc-per-node N``.

    restore_job.py ROOT OUT KIND PHASE

KIND ``plain``: a per-rank model (each rank its own weights and data) with SGD;
PHASE ``train`` trains steps 1..6, a part at steps 2 and 4, and dumps its state at 6;
PHASE ``resume`` restores, trains on to 6 and dumps. KIND ``fsdp``: an FSDP2 model and
Adam; ``train`` takes 2 steps and a part at 2, ``resume`` restores (at whatever world
size it runs) and steps once more. Every phase writes ``OUT/<phase>-rank<r>.pt``:
the restored step and the state (FSDP2: the full tensors, gathered).

Parts are written in-process from the client's capture (each DTensor's local piece
and its place in the whole, docs/format.md ``shard``), by the writer the daemon uses:
the test needs no daemon.
"""

import os
import sys

import torch
import torch.distributed as dist

from snapd.options import Options
from snapd.writer import write_snapshot
from snapd_client import Client
from snapd_client.reshard import is_dtensor

ROOT, OUT, KIND, PHASE = sys.argv[1:5]
RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def write_part(client, step):
    """This rank's part of snapshot ``step`` through the one commit path, in this
    process (the last rank's write commits it)."""
    write_snapshot(client.store, client.capture(step).plan_in_memory(), Options())


def full(state):
    """A state tree with every DTensor gathered whole (a collective)."""
    if is_dtensor(state):
        return state.full_tensor()
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, dict):
        return {k: full(v) for k, v in state.items()}
    if isinstance(state, list):
        return [full(v) for v in state]
    return state


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


def fsdp():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 8))
    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    client = Client(ROOT, "job", daemon=False)
    client.track(model=model, optimizer=opt)
    start = client.restore() if PHASE == "resume" else 0
    restored = {"model": full(model.state_dict()), "optimizer": full(opt.state_dict())}
    torch.manual_seed(1 + start)
    for step in range(start + 1, start + 3 if PHASE == "train" else start + 2):
        loss = model(torch.randn(4, 8)).pow(2).mean()   # the same batch on every rank
        opt.zero_grad()
        loss.backward()
        opt.step()
        client.log(step, loss=loss.item())
        if PHASE == "train":
            write_part(client, step)
    saved = {"model": full(model.state_dict()), "optimizer": full(opt.state_dict())}
    client.close()
    return start, {"restored": restored, "after": saved}


def main():
    dist.init_process_group("gloo")
    start, state = plain() if KIND == "plain" else fsdp()
    torch.save({"start": start, "world": WORLD, "state": state},
               os.path.join(OUT, f"{PHASE}-rank{RANK}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
