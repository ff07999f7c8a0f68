#!/usr/bin/env python
"""Time to durable and the daemon's CPU per snapshot, with option ``sha256`` on and off.

    python scripts/bench_sha256.py [--size 1G] [--reps 2] [--rounds 2]
                                   [--json /tmp/snapd-bench-sha256.json]

The state is scripts/bench.py's (an MLP of Linear(2048, 2048) layers and its AdamW
state, ~size bytes, after one optimizer step). One root, one daemon (the Client
starts it); the two settings are two runs of it, each its own Client, alternated
``--rounds`` times (on, off, off, on, ...) so that drift in the machine's load falls
on both alike. Each Client takes an uncounted warm-up snapshot, then ``--reps``
counted ones, each after 50 ms of matmuls: the stall is ``snapshot()``'s own time
(what the training loop waits), time to durable from ``snapshot()`` to ``wait()``
returning, the daemon's CPU the change of its user + system time over the
same span. Figures are medians. Then each run's newest snapshot is restored once
into a fresh model, from the files (``daemon=False``: no hot copy), its SHA-256s
checked or, written with the option off, none: ``restore_s``. The load average before
and after is printed: on a busy machine the figures mean little.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import (build_state, daemon_pid_of, median, parse_size,  # noqa: E402
                      stop_daemon, train_briefly)


def one_client(root: str, model, opt, sha256: bool, reps: int, first_step: int
               ) -> List[Dict[str, float]]:
    """A Client with ``sha256`` on or off: a warm-up snapshot, then ``reps`` timed."""
    import psutil
    from snapd_client import Client
    client = Client(root, "sha-on" if sha256 else "sha-off", sha256=sha256, keep_last=2)
    client.track(model=model, optimizer=opt)
    client.snapshot(first_step).wait()   # warm-up: the arena, the daemon's first write
    daemon = psutil.Process(daemon_pid_of(root))
    out = []
    for i in range(1, reps + 1):
        train_briefly()
        cpu0 = sum(daemon.cpu_times()[:2])
        t0 = time.perf_counter()
        handle = client.snapshot(first_step + i)
        stall = time.perf_counter() - t0   # the training loop's wait: the staging copy
        handle.wait()
        out.append({"stall_s": stall, "durable_s": time.perf_counter() - t0,
                    "daemon_cpu_s": sum(daemon.cpu_times()[:2]) - cpu0})
    client.close()
    return out


def time_restore(root: str, sha256: bool, size: int, threads: int) -> float:
    """One restore of the run's newest snapshot from its files, timed."""
    from snapd_client import Client
    model, opt = build_state(size, threads, step=False)
    client = Client(root, "sha-on" if sha256 else "sha-off", daemon=False)
    client.track(model=model, optimizer=opt)
    t0 = time.perf_counter()
    client.restore()
    seconds = time.perf_counter() - t0
    client.close()
    return seconds


def main(argv: List[str] | None = None) -> Dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="1G")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default="/tmp/snapd-bench-sha256.json")
    args = ap.parse_args(argv)
    model, opt = build_state(parse_size(args.size), args.threads)
    root = tempfile.mkdtemp(prefix="snapd-bench-sha256-", dir=os.environ.get("TMPDIR"))
    load_before = os.getloadavg()
    runs: Dict[str, List[Dict[str, float]]] = {"on": [], "off": []}
    try:
        step = 0
        for r in range(args.rounds):
            for setting in (("on", "off") if r % 2 == 0 else ("off", "on")):
                runs[setting] += one_client(root, model, opt, setting == "on",
                                            args.reps, step)
                step += args.reps + 1
        stop_daemon(root)
        restores = {s: time_restore(root, s == "on", parse_size(args.size), args.threads)
                    for s in ("on", "off")}
    finally:
        stop_daemon(root)
        shutil.rmtree(root, ignore_errors=True)
    result: Dict[str, Any] = {"size": args.size, "reps": args.reps, "rounds": args.rounds,
                              "load_before": load_before, "load_after": os.getloadavg()}
    for setting, samples in runs.items():
        result[setting] = {k: median([s[k] for s in samples])
                           for k in ("stall_s", "durable_s", "daemon_cpu_s")}
        result[setting]["samples"] = samples
        result[setting]["restore_s"] = restores[setting]
    result["durable_ratio"] = result["on"]["durable_s"] / result["off"]["durable_s"]
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    print(f"{args.size}: stall sha256 on {result['on']['stall_s'] * 1e3:.1f} ms, off "
          f"{result['off']['stall_s'] * 1e3:.1f} ms; time to durable sha256 on {result['on']['durable_s']:.3f} s, "
          f"off {result['off']['durable_s']:.3f} s (x{result['durable_ratio']:.2f}); "
          f"daemon CPU on {result['on']['daemon_cpu_s']:.3f} s, "
          f"off {result['off']['daemon_cpu_s']:.3f} s; restore on "
          f"{result['on']['restore_s']:.3f} s, off {result['off']['restore_s']:.3f} s; "
          f"load average "
          f"{load_before[0]:.1f} before, {result['load_after'][0]:.1f} after")
    return result


if __name__ == "__main__":
    main()
