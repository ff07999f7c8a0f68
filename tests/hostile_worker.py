"""Runs hostile cases for tests/integration/test_hostile_processes.py in a process of
its own: a restore by a new trainer, then the operator commands. One JSON line per
case, flushed as each ends, so that a crash or a hang is charged to the case that
caused it. The run they damage is ``train``'s (shared with tests/test_hostile.py).

Usage: python hostile_worker.py ROOT:COMMANDS [ROOT:COMMANDS ...], where COMMANDS
is "all" (restore and every command), "cli" or "restore".
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch

RUN = "h"


def build(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    loader = torch.utils.data.DataLoader(list(range(64)), batch_size=4, shuffle=True)
    return model, opt, loader


def train(root: str) -> None:
    """One real run: a model, AdamW and a data cursor; snapshots at steps 1 and 2."""
    from snapd_client import Client   # as restore() does: imported where it is used

    model, opt, loader = build()
    client = Client(root, RUN, data_version="v1", daemon=False)
    client.track(model=model, optimizer=opt)
    batches = client.batches(loader)
    for step in (1, 2):
        x = next(batches).float().reshape(-1, 1).expand(-1, 8)
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
        client.snapshot(step).wait()
    client.close()


def snap(root: str, name: str = "00000002") -> str:
    return os.path.join(root, RUN, "snapshots", name)


def restore(root: str) -> dict:
    from snapd.errors import SnapdError
    from snapd.reader import SnapshotReader
    from snapd_client import Client

    model, opt, loader = build(seed=7)
    before = [p.detach().clone() for p in model.parameters()]
    client = Client(root, RUN, data_version="v1", daemon=False)
    client.track(model=model, optimizer=opt)
    client.batches(loader)
    out: dict = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out["step"] = client.restore()
        except SnapdError as e:
            out.update(error=type(e).__name__, message=str(e))
    out["warnings"] = [str(w.message) for w in caught]
    now = [p.detach() for p in model.parameters()]
    good = SnapshotReader(os.path.join(root, RUN, "snapshots", "00000001"))
    out["model_is_good"] = all(torch.equal(a, b) for a, b in
                               zip(now, good.load_object("model")))
    out["model_untouched"] = all(torch.equal(a, b) for a, b in zip(now, before))
    return out


def commands(root: str) -> dict:
    """Each command on the hostile step 2: exit code, output, any escaped exception."""
    from click.testing import CliRunner
    from snapd.cli import main

    out_file = os.path.join(os.path.dirname(root), "w.safetensors")
    runs = {"verify": ["verify", f"{RUN}/2"], "verify_all": ["verify", "--all"],
            "ls": ["ls", RUN], "inspect": ["inspect", f"{RUN}/2"],
            "diff": ["diff", f"{RUN}/1", f"{RUN}/2"],
            "export": ["export", f"{RUN}/2", "-o", out_file]}
    results = {}
    for name, args in runs.items():
        result = CliRunner().invoke(main, args + ["--root", root], env={"COLUMNS": "200"})
        escaped = result.exception if not isinstance(result.exception, SystemExit) else None
        results[name] = {"code": result.exit_code, "output": result.output[-2000:],
                         "exception": repr(escaped) if escaped else None}
    return results


def main() -> None:
    for arg in sys.argv[1:]:
        root, what = arg.rsplit(":", 1)
        out: dict = {"root": root}
        if what in ("all", "restore"):
            out["restore"] = restore(root)
        if what in ("all", "cli"):
            out["cli"] = commands(root)
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
