#!/usr/bin/env python
"""Lightning's own resume against snapd's, on one stock fit killed at the same points.

    python scripts/bench_lightning_resume.py [--parallel 3] [--json PATH]

The fit is tests/integration/lightning_job.py (dropout, AdamW with a per-step
OneCycle schedule, a shuffled DataLoader, accumulate_grad_batches=2, bf16-mixed on the
CPU, 3 epochs of 15 batches). Each trial SIGKILLs it at the same batches and starts
the same command again until it finishes, resumed two ways:

- ``snapd``: ``SnapdCallback(root, run, every=E)`` (the script's two ``# snapd`` lines);
- ``lightning``: ``ModelCheckpoint(save_last=True, every_n_train_steps=E)`` and
  ``trainer.fit(..., ckpt_path="last")``, Lightning's documented way to resume.

Each final set of weights is compared with the uninterrupted fit's (no callback, no
checkpoint, same worker count): exact (bit for bit) or the largest absolute weight
difference. Prints a markdown table (docs/frameworks.md holds one).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

import numpy as np

import benchlib

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
JOB = os.path.join(REPO, "tests", "integration", "lightning_job.py")

# name: (workers, every, kills as [hook, batch]); tests/integration/test_lightning_resume.py
# runs the same points (and says where each lands) for snapd
TRIALS = {
    "mid-accumulation": (0, 3, [["end", 10]]),
    "during-snapshot": (0, 3, [["end", 11]]),
    "epoch-start": (0, 3, [["start", 15]]),
    "twice": (0, 3, [["end", 20], ["start", 36]]),
    "workers-mid-accumulation": (2, 3, [["end", 6]]),
    "workers-from-epoch-end": (2, 4, [["start", 17]]),
    "workers-twice": (2, 3, [["end", 5], ["end", 33]]),
    "workers-mid-epoch-2": (2, 3, [["start", 40]]),
}
ATTEMPTS = 4


def run_fit(cfg: dict) -> int:
    """The command run until it finishes (at most ATTEMPTS times): its kills."""
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    kills = 0
    for _ in range(ATTEMPTS):
        done = subprocess.run([sys.executable, JOB, json.dumps(cfg)], env=env,
                              capture_output=True, text=True, cwd=os.path.dirname(JOB))
        if done.returncode == 0:
            return kills
        if done.returncode != -signal.SIGKILL:
            raise RuntimeError(f"{cfg['run']}: exit {done.returncode}\n{done.stderr[-3000:]}")
        kills += 1
    raise RuntimeError(f"{cfg['run']}: still killed after {ATTEMPTS} runs")


def weights(path: str) -> list:
    with np.load(path, allow_pickle=False) as saved:
        return [saved[k] for k in sorted(saved.files, key=lambda k: int(k.split("_")[1]))]


def drift(a: list, b: list) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


def one(base: str, name: str, mode: str) -> dict:
    workers, every, kills = TRIALS[name]
    marks = os.path.join(base, f"marks-{mode}-{name}")
    os.makedirs(marks)
    out = os.path.join(base, f"{mode}-{name}.npz")
    cfg = {"root": os.path.join(base, mode), "run": name, "workers": workers,
           "every": every, "resume": mode, "kills": kills, "marks": marks, "out": out}
    killed = run_fit(cfg)
    return {"trial": name, "mode": mode, "killed": killed, "out": out, "workers": workers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parallel", type=int, default=3)
    parser.add_argument("--json", help="write the rows here too")
    args = parser.parse_args()
    base = tempfile.mkdtemp(prefix="sdlb-", dir="/tmp")   # daemon sockets: 107 bytes
    try:
        refs = {}
        for workers in (0, 2):
            refs[workers] = os.path.join(base, f"whole-{workers}.npz")
            run_fit({"root": os.path.join(base, "none"), "run": f"whole-{workers}",
                     "workers": workers, "resume": "none", "out": refs[workers]})
        jobs = [(name, mode) for name in TRIALS for mode in ("snapd", "lightning")]
        with ThreadPoolExecutor(args.parallel) as pool:
            rows = list(pool.map(lambda job: one(base, *job), jobs))
        for row in rows:
            d = drift(weights(row.pop("out")), weights(refs[row["workers"]]))
            row["max_abs_dw"], row["exact"] = d, d == 0.0
        print("| trial | workers | kills | snapd | Lightning `ckpt_path=\"last\"` |")
        print("|---|---|---|---|---|")
        for name in TRIALS:
            mine = {r["mode"]: r for r in rows if r["trial"] == name}
            cells = ["exact" if mine[m]["exact"] else f"max abs dW {mine[m]['max_abs_dw']:.1e}"
                     for m in ("snapd", "lightning")]
            print(f"| {name} | {TRIALS[name][0]} | {mine['snapd']['killed']} | "
                  f"{cells[0]} | {cells[1]} |")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    finally:
        benchlib.stop_daemon(os.path.join(base, "snapd"))
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
