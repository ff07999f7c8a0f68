"""A 2-rank DDP job under torchrun, through the daemon: each snapshot is committed
globally once both parts are in, and the model and optimizer are on disk once."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from snapd import format as fmt
from snapd.globalcommit import read_part
from snapd.reader import read_commit
from snapd.store import RunStore

JOB = r'''
import json, sys
import torch
import torch.distributed as dist
from snapd_client import Client

root, run = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
    torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256)))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
ckpt = Client(root, run, "v1")
ckpt.track(model=model, optimizer=opt)
torch.manual_seed(1 + dist.get_rank())   # per-rank data
for step in range(1, 5):
    opt.zero_grad()
    model(torch.randn(8, 256)).pow(2).mean().backward()
    opt.step()
    if step % 2 == 0:
        ckpt.snapshot(step)
summary = ckpt.close()
one_copy = sum(t.numel() * t.element_size() for t in model.state_dict().values()) + sum(
    t.numel() * t.element_size() for s in opt.state.values() for t in s.values())
print("RESULT " + json.dumps({"rank": ckpt.rank, "world": ckpt.world_size,
                              "committed": list(summary.committed), "one_copy": one_copy}))
dist.destroy_process_group()
'''


def run_job(tmp_path, env, nproc: int = 2):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    proc_env = {**os.environ, "SNAPD_MIN_FREE_BYTES": "0", "OMP_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc-per-node={nproc}", str(script), env.root, env.run],
        env=proc_env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    # Two ranks print to one pipe: their lines may run together, so each result is
    # found by its marker, not by line.
    decoder = json.JSONDecoder()
    return [decoder.raw_decode(part)[0] for part in out.stdout.split("RESULT ")[1:]]


def tensors(manifest):
    return {(name, t["path"]): t for name, obj in manifest["objects"].items()
            for t in obj["tensors"]}


def test_ddp_job_commits_globally_with_one_copy_of_the_model(tmp_path, env):
    results = run_job(tmp_path, env)
    assert sorted(r["rank"] for r in results) == [0, 1]
    assert all(r["world"] == 2 and r["committed"] == [2, 4] for r in results)
    store = RunStore(env.root, env.run)
    latest = store.read_pointer("LATEST")
    assert latest is not None and latest.step == 4
    final = store.snapshot_path(latest)
    record = read_commit(final)                      # the global commit record
    assert record["world_size"] == 2 and [p["rank"] for p in record["parts"]] == [0, 1]
    parts = [tensors(read_part(os.path.join(final, fmt.part_dir_name(r)))[0])
             for r in (0, 1)]
    replicated = [k for k in parts[0] if k[0] in ("model", "optimizer")]
    assert replicated and all(("ref" in parts[0][k]) != ("ref" in parts[1][k])
                              for k in replicated)
    assert all(parts[1][k]["ref"] == 0 for k in replicated if "ref" in parts[1][k])
    one_copy = results[0]["one_copy"]
    assert 0.95 * one_copy < record["bytes"] < 1.1 * one_copy   # not two copies
    assert not [d for d in os.listdir(store.snapshots_path) if d.startswith(".parts-")]
