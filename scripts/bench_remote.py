"""The remote tier's figures (docs/benchmarks.md): upload throughput, and the stall.

Usage: python scripts/bench_remote.py [--mb 50] [--reps 3] [--snapshots 8]

Starts moto's S3 server on 127.0.0.1 (a free port; ``pip install 'moto[server]'``) and:

1. **Upload throughput.** A snapshot of ``--mb`` MiB (four objects, so four tensor
   files) committed locally, then uploaded by ``upload_snapshot`` (4 threads, the
   record last) to a fresh prefix, against a plain ``fs.put`` of the same files to
   another prefix of the same server; MB/s, the median of ``--reps``.
2. **The training stall.** A trainer (a real daemon) of ``--mb`` MiB of state calls
   ``snapshot()`` ``--snapshots`` times with one step of work between them, with the
   remote tier on and off; the median time ``snapshot()`` took (what training waits),
   and, with the remote on, how many snapshots reached the remote (newest wins).

The server is local, at nice 19 (it stands in for a store on other machines): the
figures compare snapd's path with the plain one on the same link, not a real object
store's speed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

import torch

HOST = "127.0.0.1"
ENV = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
       "AWS_DEFAULT_REGION": "us-east-1"}


def _background() -> None:
    os.nice(19)
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def start_s3() -> tuple:
    with socket.socket() as s:
        s.bind((HOST, 0))
        port = s.getsockname()[1]
    endpoint = f"http://{HOST}:{port}"
    os.environ.update(ENV, AWS_ENDPOINT_URL=endpoint)
    # At nice 19: the server stands in for a store on other machines, which would not
    # take the trainer's CPU (on this 2-core machine it otherwise would).
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", HOST, "-p",
                             str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            preexec_fn=_background)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection((HOST, port), 0.2).close()
            break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit("moto's server did not start: pip install 'moto[server]'")
            time.sleep(0.05)
    import s3fs
    fs = s3fs.S3FileSystem(endpoint_url=endpoint, skip_instance_cache=True)
    fs.mkdir("bench")
    return proc, fs


def state_of(mb: int) -> dict:
    n = (mb << 20) // 4 // 4
    return {f"o{i}": torch.randn(n) for i in range(4)}


def commit(root: str, mb: int):
    """A snapshot of ``mb`` MiB committed locally, as a trainer's plan would make it."""
    from snapd.options import Options
    from snapd.plan import ObjectPlan, SnapshotPlan, TensorSource
    from snapd.store import RunStore
    from snapd.writer import write_snapshot
    from snapd_client.capture import tensor_bytes
    from snapd_client.state import flatten
    objects = []
    for name, tensor in state_of(mb).items():
        flat = flatten({"t": tensor}, name)
        sources = [TensorSource(p, str(t.dtype)[6:], list(t.shape), tensor_bytes(t))
                   for p, t in zip(flat.paths, flat.tensors)]
        objects.append(ObjectPlan(name, "bench.State", flat.skeleton, sources))
    plan = SnapshotPlan("bench", 1, {"id": 0, "mode": "fresh", "parent": None}, objects,
                        {"python": b"s"})
    store = RunStore(root, "bench")
    return store, write_snapshot(store, plan, Options()).sid


def throughput(fs, mb: int, reps: int) -> dict:
    from snapd.remote.layout import RemoteRoot
    from snapd.remote.upload import local_files, upload_snapshot
    root = tempfile.mkdtemp(prefix="sd-bench-")
    try:
        store, sid = commit(root, mb)
        path = store.snapshot_path(sid)
        files = [os.path.join(path, f.relpath) for f in local_files(path)]
        size = sum(os.path.getsize(f) for f in files)
        ours, plain = [], []
        for _ in range(reps):
            remote = RemoteRoot(f"s3://bench/{uuid.uuid4().hex[:8]}", fs=fs)
            t = time.perf_counter()
            upload_snapshot(remote, store, sid.name, threads=4)
            ours.append(time.perf_counter() - t)
            dest = f"bench/{uuid.uuid4().hex[:8]}/"
            t = time.perf_counter()
            fs.put(files, dest)
            plain.append(time.perf_counter() - t)
        mbs = lambda secs: size / 1e6 / statistics.median(secs)  # noqa: E731
        return {"bytes": size, "files": len(files), "snapd_MBps": mbs(ours),
                "fs_put_MBps": mbs(plain)}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def stall(mb: int, snapshots: int, remote: str = None) -> list:
    from snapd_client import Client
    root = tempfile.mkdtemp(prefix="sd-", dir="/tmp")
    state = state_of(mb)
    client = Client(root, "bench", remote=remote, idle_exit_seconds=5)
    client.track(model=torch.nn.ParameterDict({k: torch.nn.Parameter(v)
                                               for k, v in state.items()}))
    times = []
    try:
        for step in range(1, snapshots + 1):
            with torch.no_grad():
                for v in state.values():
                    v.mul_(1.0001)
            t = time.perf_counter()
            handle = client.snapshot(step)
            times.append(time.perf_counter() - t)
            handle.wait(120)
        time.sleep(1.0)
    finally:
        client.close()
        subprocess.run([sys.executable, "-m", "snapd", "stop", root], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)
    return times


def summary(times: list) -> dict:
    return {"median_ms": 1000 * statistics.median(times), "max_ms": 1000 * max(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=50)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--snapshots", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2,
                        help="off/on pairs of trainer runs, alternating")
    args = parser.parse_args()
    proc, fs = start_s3()
    try:
        up = throughput(fs, args.mb, args.reps)
        print(f"upload of a {up['bytes'] / 1e6:.1f} MB snapshot ({up['files']} files): "
              f"snapd {up['snapd_MBps']:.0f} MB/s, plain fs.put {up['fs_put_MBps']:.0f} MB/s")
        # Off and on alternate, so that a drift of the machine weighs on both alike.
        times = {"off": [], "on": []}
        for _ in range(args.rounds):
            times["off"] += stall(args.mb, args.snapshots)
            url = f"s3://bench/{uuid.uuid4().hex[:8]}"
            times["on"] += stall(args.mb, args.snapshots, url)
        from snapd.remote.layout import RemoteRoot
        up_count = len(RemoteRoot(url, fs=fs).commits("bench"))
        off, on = (summary(times[k]) for k in ("off", "on"))
        print(f"snapshot() stall, {args.mb} MiB state, {args.rounds} x {args.snapshots} "
              f"snapshots each: remote off median {off['median_ms']:.1f} ms (max "
              f"{off['max_ms']:.1f}), remote on median {on['median_ms']:.1f} ms (max "
              f"{on['max_ms']:.1f}); {up_count} remote commit(s) kept after retention")
    finally:
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    main()
