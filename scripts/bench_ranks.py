#!/usr/bin/env python
"""Many ranks: per-rank stall and time to the global commit, against DCP.

    python scripts/bench_ranks.py --ranks 2 4 --mb 100 [--reps 5] [--doc docs/benchmarks.md]

For each world size N and each method, one job ``python -m torch.distributed.run
--standalone --nproc-per-node N`` of this script (worker mode, gloo, CPU,
``OMP_NUM_THREADS=1``); each rank writes its figures as JSON and this script gathers
them. Every rank holds the same state: an MLP of ``Linear(2048, 2048)`` layers +
AdamW after one step (``scripts/benchlib.py``'s ``build_state``: params, exp_avg and
exp_avg_sq add up to ~``--mb`` MiB), wrapped in ``DistributedDataParallel``, so it
is replicated on every rank. Methods, each in its own job:

- ``snapd``: the six calls on every rank (Client, track, snapshot). Stall = the
  snapshot() call (mode=wait). Part = until this rank's handle is done (its part
  durable). Global = from the rank's snapshot() call until
  ``<root>/<run>/snapshots/<name>/`` exists: that directory appears at the global
  commit (a rename of ``.parts-<name>``). Measured in the same job, polled every
  millisecond together with the handle.
- ``dcp_async``: ``torch.distributed.checkpoint.async_save`` with a reused
  ``DefaultStager`` set up for CPU (shared memory, staging in a background thread;
  pinned memory and non-blocking copies need an accelerator), on its own gloo group
  (its collectives run on a background thread), thread executor. Stall = until
  ``async_save`` returns + until ``staging_completion`` resolves (no update may
  start before). Durable = until ``upload_completion`` resolves.
- ``dcp_async_proc``: the same with ``AsyncCheckpointerType.PROCESS`` (the upload
  in a separate process, reading the shared-memory staging copy).
- ``dcp_save``: ``dcp.save`` (synchronous: stall = durable).

The state dict handed to DCP is ``get_state_dict(model, optimizer)``, built once
before the first save, as ``scripts/bench.py`` does. DCP's default planner writes a
replicated tensor once (its plans are deduplicated across ranks); snapd writes it
once by its own deterministic choice of writer. Before each save every rank meets
at a barrier (not timed) and runs 50 ms of matmuls (``train_briefly``); the first
save of each job is a warm-up and is not counted. Bytes on disk: the last
checkpoint's directory (for snapd, the globally committed snapshot with every
part; the per-rank state logs are not counted).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench  # noqa: E402  (its methods and timing loop)
from benchlib import (REPO, GiB, MiB, build_state, dir_bytes, emit, end_run,  # noqa: E402
                      fr, fs, machine_text, median, nbytes_of, start_run, state_tensors,
                      stop_daemon, train_briefly)

SECTION = "## Many ranks (scripts/bench_ranks.py)"
RUN = "bench"
METHODS = ["snapd", "dcp_async", "dcp_async_proc", "dcp_save"]
LABEL = {"snapd": "snapd (mode=wait)",
         "dcp_async": "dcp.async_save (DefaultStager shm + async staging, thread)",
         "dcp_async_proc": "dcp.async_save (DefaultStager shm + async staging, process)",
         "dcp_save": "dcp.save"}
POLL_S = 0.001


# --- worker: one rank of one job ------------------------------------------------------

def rank_worker(args) -> Dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = build_state(args.mb * MiB, threads=1)
    ddp = DDP(model)
    res: Dict[str, Any] = {"method": args.worker, "rank": rank, "world_size": world,
                           "state_bytes": nbytes_of(state_tensors(model, opt)),
                           "threads": torch.get_num_threads()}
    os.makedirs(args.root, exist_ok=True)
    # No barrier on failure: the rank exits, torchrun stops the others, and the
    # launcher stops the daemon.
    (w_snapd if args.worker == "snapd" else w_dcp)(args, ddp, opt, res)
    dist.barrier()
    if rank == 0:
        stop_daemon(args.root)
    dist.destroy_process_group()
    return res


def worker_main(args) -> None:
    """One rank: its figures, or its traceback, as JSON for the launcher (torchrun's
    own report of a failed rank carries no traceback)."""
    rank = int(os.environ.get("RANK", 0))
    try:
        res = rank_worker(args)
    except BaseException:
        with open(os.path.join(args.out, f"rank-{rank}.json"), "w") as f:
            json.dump({"rank": rank, "error": traceback.format_exc(),
                       "failed_at": time.time()}, f)
        raise
    with open(os.path.join(args.out, f"rank-{rank}.json"), "w") as f:
        json.dump(res, f)


def w_snapd(args, ddp, opt, res) -> None:
    from snapd.store import SnapshotId
    from snapd_client import Client
    ckpt = Client(args.root, RUN, data_version="bench")
    ckpt.track(model=ddp, optimizer=opt)
    snaps = os.path.join(args.root, RUN, "snapshots")
    call, part, glob, starts, seen, staged = [], [], [], [], [], []
    path = None
    for i in range(args.reps + 1):   # the first is a warm-up: daemon start, arena
        path = os.path.join(snaps, SnapshotId(0, i).name)
        barrier()
        train_briefly()
        t0 = time.perf_counter()
        h = ckpt.snapshot(i)
        t1 = time.perf_counter()
        t_part, t_glob = poll_commit(h, path, t0, args.commit_timeout)
        h.wait()
        if i:
            call.append(t1 - t0)
            part.append(t_part - t0)
            glob.append(t_glob - t0)
            starts.append(t0)
            seen.append(t_glob)
            staged.append(getattr(h.result, "bytes_written", None))
        barrier()   # every rank saw the commit: the next snapshot starts clean
    ckpt.close()
    res.update(stall_s=call, part_s=part, durable_s=glob, start_t=starts, seen_t=seen,
               part_bytes=staged)
    if res["rank"] == 0:
        res["disk_bytes"] = dir_bytes(path)


def poll_commit(handle, path: str, t0: float, timeout: float):
    """(when this rank's part was durable, when the global commit appeared). A part
    whose outcome reaches the client after the commit is counted as durable at the
    commit: the commit needs every part durable."""
    t_part = None
    deadline = t0 + timeout
    while True:
        now = time.perf_counter()
        if t_part is None and handle.done():
            t_part = now
        if os.path.isdir(path):
            return (now if t_part is None else t_part), now
        if now > deadline:
            raise TimeoutError(f"{path}: no global commit {timeout:.0f} s after "
                               f"snapshot() (this rank's part durable: "
                               f"{t_part is not None}); see .parts-* beside it")
        if handle.done() and handle.failed:
            handle.wait()   # raises this rank's failure
        time.sleep(POLL_S)


def barrier() -> None:
    import torch.distributed as dist
    dist.barrier()


def w_dcp(args, ddp, opt, res) -> None:
    """DCP through scripts/bench.py's methods and timing loop, each save after a barrier
    and a little training. The async methods get a gloo group of their own: their
    collectives run off the training thread, and must not interleave with the training
    loop's (DDP's all-reduce, our barrier)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    if args.worker == "dcp_save":
        method = bench.DcpSave(args.root, ddp, opt)
    else:
        kind = AsyncCheckpointerType.PROCESS if args.worker == "dcp_async_proc" \
            else AsyncCheckpointerType.THREAD
        method = bench.DcpAsync(args.root, ddp, opt, async_checkpointer_type=kind,
                                process_group=dist.new_group(backend="gloo"))
    model_sd, optim_sd = get_state_dict(ddp, opt)
    method.sd = {"model": model_sd, "optim": optim_sd}   # once, before the first save

    def before() -> None:
        barrier()
        train_briefly()
    try:
        bench.time_saves(method, [0], before)   # warm-up
        res.update(bench.time_saves(method, range(1, args.reps + 1), before))
    finally:
        method.close()
    barrier()
    if res["rank"] == 0:
        res["disk_bytes"] = dir_bytes(method.path)


# --- orchestration -------------------------------------------------------------------

def run_job(method: str, world: int, base: str, args) -> Dict[str, Any]:
    """One torchrun job of ``world`` ranks; {"ranks": [per-rank JSON], ...}."""
    root, out = f"{base}/{world}-{method}", f"{base}/{world}-{method}-out"
    os.makedirs(out, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(world), os.path.abspath(__file__),
           "--worker", method, "--root", root, "--out", out, "--mb", str(args.mb),
           "--reps", str(args.reps), "--commit-timeout", str(args.commit_timeout)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=args.timeout)
        rc, tail = proc.returncode, (proc.stdout + proc.stderr).strip()[-3000:]
    except subprocess.TimeoutExpired as e:
        rc, tail = "timeout", str(e)[-3000:]
    job: Dict[str, Any] = {"method": method, "world_size": world,
                           "wall_s": time.perf_counter() - t0, "ranks": []}
    for r in range(world):
        try:
            with open(os.path.join(out, f"rank-{r}.json")) as f:
                job["ranks"].append(json.load(f))
        except (OSError, ValueError):
            job.setdefault("error", f"rank {r} wrote no result (exit {rc}): {tail}")
    failed = sorted((r for r in job["ranks"] if "error" in r), key=lambda r: r["failed_at"])
    if failed:   # the first to fail (the others lost their peer); its own traceback
        # says more than torchrun's summary
        job["error"] = f"rank {failed[0]['rank']}: {failed[0]['error']}"
    stop_daemon(root)   # belt and braces: no daemon outlives its job
    shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    status = "error" if "error" in job else "ok"
    print(f"  {method:15s} {world} ranks: {status} in {job['wall_s']:5.1f} s",
          file=sys.stderr, flush=True)
    if status == "error":
        print("    " + job["error"][-1500:].replace("\n", "\n    "), file=sys.stderr)
    return job


def summarize(job: Dict[str, Any]) -> Dict[str, Any]:
    """Per-rank medians, then the median rank and the worst rank."""
    ranks = job.get("ranks", [])
    out: Dict[str, Any] = {}
    for key in ("stall_s", "durable_s", "part_s", "return_s"):
        per = [median(r[key]) for r in ranks if r.get(key)]
        if per:
            out[key] = (median(per), max(per))
    if ranks and all(r.get("seen_t") for r in ranks):
        # The job's own figure: from the first rank's snapshot() call to the first
        # rank that saw the commit, per snapshot.
        reps = len(ranks[0]["seen_t"])
        out["job_commit_s"] = median([min(r["seen_t"][i] for r in ranks) -
                                      min(r["start_t"][i] for r in ranks)
                                      for i in range(reps)])
    parts = [median([b for b in r.get("part_bytes", []) if b is not None] or [0])
             for r in ranks]
    if any(parts):
        out["part_bytes"] = parts
    out["disk_bytes"] = next((r["disk_bytes"] for r in ranks if "disk_bytes" in r), None)
    out["state_bytes"] = ranks[0]["state_bytes"] if ranks else None
    return out


def orchestrate(args) -> None:
    info = start_run()
    base = f"/tmp/sbr{os.getpid()}"
    os.makedirs(base, exist_ok=True)
    results: Dict[int, Dict[str, Any]] = {}
    try:
        for world in args.ranks:
            print(f"{world} ranks ({args.reps} counted snapshots per job)", file=sys.stderr)
            results[world] = {m: run_job(m, world, base, args) for m in args.methods}
    finally:
        shutil.rmtree(base, ignore_errors=True)
    end_run(info, "bench_ranks.py", sys.argv[1:])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "machine": info}, f, indent=1)
    emit(report(results, info, args), args.doc, SECTION)


# --- report ---------------------------------------------------------------------------

def pair(v: Optional[tuple]) -> str:
    return "–" if v is None else f"{fs(v[0])} / {fs(v[1])}"


def first(v: Optional[tuple]) -> Optional[float]:
    return None if v is None else v[0]


def report(results: Dict[int, Dict[str, Any]], info: Dict[str, Any], args) -> str:
    lines = [SECTION, ""] + machine_text(
        info, f" Every rank is a process on this one machine (gloo, CPU, "
              f"`OMP_NUM_THREADS=1`), so N ranks share its {info['nproc']} CPUs and one disk.")
    lines += [
        f"State on every rank: an MLP of `Linear(2048, 2048)` layers + AdamW after one "
        f"step (~{args.mb} MiB of params, exp_avg and exp_avg_sq), wrapped in "
        "`DistributedDataParallel`: replicated, so one copy of it is a whole checkpoint. "
        "Each method runs in its own torchrun job; every rank meets the others at a "
        "barrier and runs 50 ms of matmuls before each save (not timed). Figures are per "
        f"rank, the median of {args.reps} counted saves after one warm-up, shown as "
        "*median rank / slowest rank*. *Stall*: what the training loop waits. "
        "*Durable*: for snapd, from the rank's snapshot() call until the globally "
        "committed snapshot directory exists (every rank's part durable, the commit "
        "record written, the rename done); for DCP, until the future resolves (its "
        "metadata written by the coordinator). Ratios are snapd's figure divided by "
        "DCP's (`1/20`: twenty times shorter).", ""]
    for world, per in results.items():
        lines += world_lines(world, per)
    errors = [f"{j['method']}@{w}: {j['error'][-400:]}" for w, per in results.items()
              for j in per.values() if "error" in j]
    if errors:
        lines += ["Errors:", ""] + [f"- `{e}`".replace("\n", " ") for e in errors] + [""]
    return "\n".join(lines)


def world_lines(world: int, per: Dict[str, Any]) -> List[str]:
    s = {m: summarize(j) for m, j in per.items() if "error" not in j}
    state = next((v["state_bytes"] for v in s.values() if v.get("state_bytes")), 0)
    out = [f"### {world} ranks (state {state / GiB:.2f} GiB per rank)" if state
           else f"### {world} ranks", "",
           "| method | stall | durable / global commit | on disk GiB | × one copy of the "
           "state |", "|---|---|---|---|---|"]
    for m in per:
        if m not in s:
            out.append(f"| {LABEL.get(m, m)} | error | | | |")
            continue
        v = s[m]
        disk = v.get("disk_bytes")
        out.append(f"| {LABEL.get(m, m)} | {pair(v.get('stall_s'))} | "
                   f"{pair(v.get('durable_s'))} | {'–' if disk is None else f'{disk / GiB:.2f}'}"
                   f" | {'–' if not disk or not state else f'{disk / state:.2f}'} |")
    out.append("")
    out += ratio_lines(s)
    return out + [""]


def ratio_lines(s: Dict[str, Dict[str, Any]]) -> List[str]:
    out = []
    sn = s.get("snapd")
    if sn:
        for m in ("dcp_save", "dcp_async", "dcp_async_proc"):
            if m not in s:
                continue
            out.append(f"- snapd against {LABEL[m]}: stall "
                       f"{fr(first(sn.get('stall_s')), first(s[m].get('stall_s')))}, "
                       f"durable {fr(first(sn.get('durable_s')), first(s[m].get('durable_s')))}"
                       " (median ranks)")
        if "part_s" in sn:
            out.append(f"- snapd: a rank's own part was durable after "
                       f"{pair(sn['part_s'])}; from the first rank's snapshot() call to "
                       f"the global commit: {fs(sn.get('job_commit_s'))}")
        if sn.get("part_bytes"):
            out.append("- snapd bytes each rank's part wrote (its share of the replicated "
                       "tensors): " + ", ".join(f"rank {r} {b / MiB:.0f} MiB"
                                                for r, b in enumerate(sn["part_bytes"])))
    for m in ("dcp_async", "dcp_async_proc"):
        if s.get(m, {}).get("return_s"):
            out.append(f"- {LABEL[m]}: the call returned after {pair(s[m]['return_s'])}; "
                       "the rest of its stall is waiting for staging_completion")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--mb", type=int, default=100, help="state per rank, MiB (default 100)")
    ap.add_argument("--reps", type=int, default=5, help="counted saves per job (default 5)")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--doc", default=os.path.join(REPO, "docs", "benchmarks.md"))
    ap.add_argument("--no-doc", action="store_true")
    ap.add_argument("--json", default="/tmp/snapd-bench-ranks.json")
    ap.add_argument("--timeout", type=float, default=900, help="per job, seconds")
    ap.add_argument("--commit-timeout", type=float, default=120)
    # worker mode (under torchrun)
    ap.add_argument("--worker", choices=METHODS, help=argparse.SUPPRESS)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker_main(args)
        return
    if min(args.ranks) < 2:
        ap.error("--ranks: every world size must be at least 2 (scripts/bench.py "
                 "measures one process)")
    args.methods = args.methods.split(",")
    if args.no_doc:
        args.doc = None
    orchestrate(args)


if __name__ == "__main__":
    main()
