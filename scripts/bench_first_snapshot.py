"""The first snapshot of a run against the later ones, and the run's shared memory.

    python scripts/bench_first_snapshot.py --size 100M --reps 5

A fresh root (so the client starts its daemon), an MLP + AdamW after one step, then
``track()``, a pause as long as a trainer's setup (``--setup``), and ``reps + 1``
snapshots with 50 ms of matmuls before each. Prints the first snapshot() call against
the median of the later ones, the peak of this run's /dev/shm bytes (trainer and
daemon mappings, and files named for the run), and the daemon's RSS outside shared
memory.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from snapd_client import Client  # noqa: E402

RUN = "first"


def shm_bytes(pids) -> int:
    """/dev/shm/snapd-* files these processes map, and those named for the run, by inode."""
    sizes = {}
    for pid in pids:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6 and parts[5].startswith("/dev/shm/snapd-"):
                    lo, hi = (int(x, 16) for x in parts[0].split("-"))
                    sizes[parts[4]] = max(sizes.get(parts[4], 0), hi - lo)
    for name in os.listdir("/dev/shm"):
        if name.startswith(f"snapd-hot-{os.getuid()}-{RUN}-"):
            st = os.stat(f"/dev/shm/{name}")
            sizes[str(st.st_ino)] = max(sizes.get(str(st.st_ino), 0), st.st_size)
    return sum(sizes.values())


def rss_outside_shm(pid: int) -> int:
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            fields[key] = value.split()
    return (int(fields["VmRSS"][0]) - int(fields["RssShmem"][0])) * 1024


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="100M")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--setup", type=float, default=1.0, help="seconds between track() "
                    "and the first snapshot (a trainer's data and model setup)")
    ap.add_argument("--hot-restore", type=int, default=1)
    args = ap.parse_args()
    target = int(float(args.size[:-1]) * {"M": 1e6, "G": 1e9}[args.size[-1]])
    torch.set_num_threads(2)
    width = 2048
    layers = max(1, round(target / (3 * 4 * width * width)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, width)).sum().backward()
    opt.step()
    state = sum(t.numel() * t.element_size() for t in model.state_dict().values()) + \
        sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values())
    a = torch.randn(1024, 1024)
    root = tempfile.mkdtemp(prefix="sd-first-", dir="/tmp")
    client = Client(root, RUN, hot_restore=bool(args.hot_restore))
    t0 = time.perf_counter()
    client.track(model=model, optimizer=opt)
    track_s = time.perf_counter() - t0
    time.sleep(args.setup)
    calls, peak = [], 0
    for step in range(args.reps + 1):
        end = time.perf_counter() + 0.05
        while time.perf_counter() < end:
            a @ a
        t0 = time.perf_counter()
        handle = client.snapshot(step)
        calls.append(time.perf_counter() - t0)
        handle.wait()
        peak = max(peak, shm_bytes([os.getpid(), client.daemon_pid]))
    daemon_rss = rss_outside_shm(client.daemon_pid)
    client.close()
    later = statistics.median(calls[1:])
    print(f"state {state / 2**20:.0f} MiB; track() {track_s * 1e3:.1f} ms; first snapshot "
          f"{calls[0] * 1e3:.1f} ms, later median {later * 1e3:.1f} ms "
          f"({calls[0] / later:.2f}x); /dev/shm peak {peak / state:.2f}x the state; "
          f"daemon RSS outside shm {daemon_rss / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
