#!/usr/bin/env python
"""Benchmark the state log: append latency, bytes per step, recovery planning.

    python scripts/bench_log.py [--appends 200000] [--records 1000000] [--dir DIR]

Prints one markdown table. Planning is measured on a log of ``--records`` realistic step
records (a committed-snapshot record every 1000 steps), built with ``append_many``; it
reports both wall time and bytes read, since bytes are what stays bounded as logs grow.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from snapd.logwriter import LogWriter
from snapd.statelog import (IOStats, find_last, find_step, last_record,
                            list_segments, read_tail, tail_report)

STEP_MS = 10.0  # the step time the overhead column is relative to


def step_record(i: int, rng: random.Random) -> dict:
    return {"kind": "step", "step": i, "time": time.time(),
            "cursor": {"epoch": i // 5000, "index": i % 5000},
            "rng": {s: rng.getrandbits(64) for s in ("python", "numpy", "torch", "cuda:0")},
            "scalars": {"loss": rng.random() * 4, "lr": 3e-4}}


def bench_appends(root: Path, n: int, flush_interval: float | None) -> dict:
    rng = random.Random(0)
    records = [step_record(i, rng) for i in range(n)]
    lat = []
    with LogWriter(root, 0, flush_interval=flush_interval) as w:
        for r in records:
            t0 = time.perf_counter_ns()
            w.append(r)
            lat.append(time.perf_counter_ns() - t0)
    size = sum(p.stat().st_size for p in list_segments(root, 0))
    q = statistics.quantiles(lat, n=100)
    return {"p50": q[49] / 1e3, "p99": q[98] / 1e3, "bytes_per_step": size / n}


def build_log(root: Path, n: int) -> float:
    rng = random.Random(1)

    def records():
        for i in range(n):
            yield step_record(i, rng)
            if i % 1000 == 999:
                yield {"kind": "snapshot", "event": "committed", "step": i,
                       "path": f"snapshots/{i:08d}", "rng_state": rng.randbytes(5056)}

    t0 = time.perf_counter()
    with LogWriter(root, 0, flush_interval=None) as w:
        w.append_many(records())
    return time.perf_counter() - t0


def _plan(run_dir: Path, stats: IOStats):
    from snapd.progress import read_progress
    from snapd.store import RunStore
    plan = read_progress(RunStore(str(run_dir.parent), run_dir.name), 0)
    stats.bytes_read += plan.bytes_read
    return plan


def timed(fn, repeat: int = 20) -> tuple[float, int]:
    """Best-of wall time in ms, and the bytes one call reads."""
    best = float("inf")
    for _ in range(repeat):
        stats = IOStats()
        t0 = time.perf_counter()
        fn(stats)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3, stats.bytes_read


def bench_client_log(root: Path, n: int) -> dict:
    """The whole fast path a training loop pays: Client.log() with RNG digests."""
    import torch
    from snapd_client import Client
    client = Client(str(root), "bench", daemon=False)
    client.track(gen=torch.Generator().manual_seed(0))  # a private stream, as a loader has
    lat = []
    for i in range(n):
        t0 = time.perf_counter_ns()
        client.log(i + 1, loss=1.0 / (i + 1), lr=3e-4)
        lat.append(time.perf_counter_ns() - t0)
    client.close()
    size = sum(p.stat().st_size for p in list_segments(root / "bench", 0))
    q = statistics.quantiles(lat, n=100)
    return {"p50": q[49] / 1e3, "p99": q[98] / 1e3, "mean": statistics.fmean(lat) / 1e3,
            "bytes_per_step": size / n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--appends", type=int, default=200_000)
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        tmp = Path(tmp)
        rows = []
        for label, interval in (("no background flush", None), ("flush every 1 s", 1.0),
                                ("flush every 0.05 s", 0.05)):
            r = bench_appends(tmp / label.replace(" ", "_"), args.appends, interval)
            rows.append((f"append p50 / p99, {label}", f"{r['p50']:.2f} / {r['p99']:.2f} us",
                         f"{100 * r['p50'] / (STEP_MS * 1e3):.3f}% / "
                         f"{100 * r['p99'] / (STEP_MS * 1e3):.3f}% of a {STEP_MS:g} ms step"))
        rows.append(("log bytes per step (realistic record, incl. framing and marks)",
                     f"{r['bytes_per_step']:.1f} B", ""))
        c = bench_client_log(tmp / "client", min(args.appends, 50_000))
        rows.append(("Client.log() p50 / p99 / mean (RNG digests + record + append, "
                     "flush every 1 s)", f"{c['p50']:.2f} / {c['p99']:.2f} / {c['mean']:.2f} us",
                     f"mean = {100 * c['mean'] / (STEP_MS * 1e3):.3f}% of a {STEP_MS:g} ms step"))
        rows.append(("Client.log() bytes per step (4 RNG digests, 2 scalars)",
                     f"{c['bytes_per_step']:.1f} B", ""))
        big = tmp / "big"
        built = build_log(big, args.records)
        size = sum(p.stat().st_size for p in list_segments(big, 0))
        rows.append((f"build {args.records:,}-step log (append_many)", f"{built:.1f} s",
                     f"{size / 2**20:.0f} MiB in {len(list_segments(big, 0))} segments"))
        probes = {
            "last_record": lambda s: last_record(big, 0, stats=s),
            "find_last(snapshot)": lambda s: find_last(big, 0, "snapshot", stats=s),
            "read_tail(100)": lambda s: read_tail(big, 0, 100, stats=s),
            "tail_report": lambda s: tail_report(big, 0, stats=s),
            "find_step(random step)": lambda s: find_step(
                big, 0, random.randrange(args.records), stats=s),
            "plan = find_last(snapshot) + read_tail(100)": lambda s: (
                find_last(big, 0, "snapshot", stats=s), read_tail(big, 0, 100, stats=s)),
            "read_progress (what restore() and snapd status run)": lambda s: _plan(big, s),
        }
        for name, fn in probes.items():
            ms, nbytes = timed(fn)
            rows.append((f"{name} on the {args.records:,}-step log", f"{ms:.2f} ms",
                         f"{nbytes / 1024:.1f} KiB read"))
        t0 = time.perf_counter()
        LogWriter(big, 0, flush_interval=None).close()
        rows.append(("LogWriter open (tail check) + close on that log",
                     f"{(time.perf_counter() - t0) * 1e3:.2f} ms", "includes 3 fsyncs"))
    print("| measurement | value | note |\n|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(f"\n(python {os.sys.version.split()[0]}, {os.cpu_count()} CPUs, temp dir on "
          f"{args.dir or tempfile.gettempdir()})")


if __name__ == "__main__":
    main()
