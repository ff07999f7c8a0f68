"""Staging copy benchmark: snapshot()'s copy into the arena against a plain ``copy_``.

    python scripts/bench_staging.py [--sizes 100M,1G] [--reps 15]

Prints a markdown table (pasted into docs/benchmarks.md, "Staging copy"). For each
state size (the MLP + AdamW state of scripts/bench.py) and torch thread count, the
median time of:

- ``copy_``: the bench's reference, ``copy_`` of every tensor into preallocated,
  faulted-in private memory;
- ``stage``: ``Arena.stage`` as snapshot() runs it (default ``copy_threads``);
- ``stage, copy_threads=1``: the same on the calling thread alone.

Each is timed in three conditions, because a copy's speed on a small VM depends on
what ran just before it more than on the copy itself:

- *after compute*: 50 ms of matmuls before each copy, as in a training loop;
- *after idle*: 50 ms asleep before each copy (a loop that waited for something);
- *core taken*: after compute, with another process spinning on one core.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from typing import Callable, Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import build_state, parse_size, state_tensors, train_briefly  # noqa: E402

from snapd.options import Options  # noqa: E402
from snapd_client.staging import Arena, layout, slot_size_for  # noqa: E402

GAP = 0.05


def timed(copy: Callable[[], None], before: Callable[[], None], reps: int) -> float:
    copy()
    times = []
    for _ in range(reps):
        before()
        t0 = time.perf_counter()
        copy()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def idle() -> None:
    time.sleep(GAP)


def measure(size: int, threads: int, reps: int) -> Dict[str, Dict[str, float]]:
    model, opt = build_state(size, threads)
    tensors = state_tensors(model, opt)
    private = [torch.empty_like(t) for t in tensors]
    offsets, need = layout(tensors)
    arenas = {"stage": Arena(slot_size_for(need), copy_threads=Options().copy_threads),
              "stage, copy_threads=1": Arena(slot_size_for(need), copy_threads=1)}

    def reference() -> None:
        for d, s in zip(private, tensors):
            d.copy_(s)

    copies = {"copy_ (reference)": reference}
    for name, arena in arenas.items():
        copies[name] = lambda a=arena: a.stage(0, tensors, offsets)
    out: Dict[str, Dict[str, float]] = {}
    try:
        for cond, before in (("after compute", train_briefly), ("after idle", idle)):
            out[cond] = {n: timed(c, before, reps) for n, c in copies.items()}
        spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            time.sleep(0.3)
            out["core taken"] = {n: timed(c, train_briefly, reps) for n, c in copies.items()}
        finally:
            spinner.kill()
            spinner.wait()
    finally:
        for arena in arenas.values():
            arena.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="100M,1G")
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    rows: List[str] = []
    for label in args.sizes.split(","):
        for threads in (1, 2):
            res = measure(parse_size(label), threads, args.reps)
            for cond, figures in res.items():
                ref = figures["copy_ (reference)"]
                cells = [f"{v * 1e3:.1f} ms ({v / ref:.2f}×)" for v in figures.values()]
                rows.append(f"| {label} | {threads} | {cond} | " + " | ".join(cells) + " |")
            names = list(res["after compute"])
    print("| state | torch threads | before each copy | " + " | ".join(names) + " |")
    print("|---|---|---|" + "---|" * len(names))
    print("\n".join(rows))
    print(f"\n(median of {args.reps}; python {sys.version.split()[0]}, torch "
          f"{torch.__version__}, {os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
