#!/usr/bin/env python
"""Fine-tuning: what a snapshot every step costs with a large frozen base.

    python scripts/bench_finetune.py [--base-mb 1024] [--snapshots 8] [--json PATH]
                                     [--doc docs/benchmarks.md]

The model is tests/lora.py's: ``Linear(W, W)`` layers (float32, ``W = --width``,
default 4096) frozen (``requires_grad=False``, in no optimizer), as many as make
``--base-mb`` MiB, each with a trainable low-rank adapter (rank chosen so that the
adapters and their AdamW state are ``--trainable-pct`` % of the base, default 1),
trained by AdamW over the adapters only; ``torch.set_num_threads(--threads)``.

Three methods, one after the other in this process, each on a fresh model built from
the same seed (and, for snapd, a fresh root in a temporary directory with its own
daemon, stopped at the end by scripts/benchlib.py's ``stop_daemon``):

- ``snapd_shared``: the snapd Client as a trainer uses it (``share_unchanged`` on,
  the default): from the second snapshot on, the frozen base is referred to, not
  copied (snapd_client/frozen.py, snapd/sharing.py).
- ``snapd_full``: the same with ``share_unchanged=False``: every snapshot copies the
  whole state into the staging arena.
- ``torch_save``: ``torch.save`` of the trainable state only (the adapters' tensors
  and ``opt.state_dict()``) into a new file, flush, fsync, fsync of the directory.
  Synchronous: its stall is its time to durable. The base must then come from
  elsewhere (the base model's own files) at restore.

For snapd the first snapshot (it follows track() and one training step; the daemon
starts, the arena is allocated, the base is copied) is reported on its own. Then two
passes of ``--snapshots`` training steps, each step followed by a snapshot:

1. *stall pass*, as a training loop runs: nothing waits for the snapshot; the stall
   is the time snapshot() takes, of which ``stall_seconds`` waited for the previous
   write to free the staging slot (backpressure). Bytes staged
   (``SnapshotHandle.staged_bytes``) and written (``result.bytes_written``) per
   snapshot are read once all are durable.
2. *durable pass*: after each snapshot the loop waits (``handle.wait()``); time to
   durable is from the snapshot() call until wait() returns.

The daemon is let settle (scripts/benchlib.py's ``wait_idle``) after the first snapshot
and between the passes. ``torch_save`` saves ``--snapshots`` + 1 times, the first a
warm-up. Figures are medians; the script prints a markdown section, writes every raw
figure with ``--json`` and replaces its section of a markdown file with ``--doc``.
Every snapshot is kept (snapd's default retention); a snapd run's root holds about
one copy of the base (later snapshots refer to its chunks) and is removed after its
method, as are torch.save's files.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(REPO, "tests"))
import benchlib  # noqa: E402  (the bench scripts' shared pieces)
from bench import Snapd, TorchSave, time_saves  # noqa: E402  (methods, the timing loop)
from benchlib import median  # noqa: E402
import lora  # noqa: E402  (tests/lora.py: the LoRA model the tests use too)

SECTION = "## Fine-tuning: a frozen base (scripts/bench_finetune.py)"
RUN = "finetune"
MiB = 1 << 20
METHODS = ("snapd_shared", "snapd_full", "torch_save")
LABEL = {"snapd_shared": "snapd (frozen base shared, the default)",
         "snapd_full": "snapd, `share_unchanged=False` (whole state copied and written)",
         "torch_save": "`torch.save` of the trainable state only + fsync"}


# --- the model --------------------------------------------------------------------

def shape_of(base_mb: float, width: int, trainable_pct: float,
             rank: Optional[int] = None) -> Dict[str, int]:
    """Layers of ``width`` making ~``base_mb`` MiB of float32 base, and the adapter rank
    whose parameters + AdamW's two moments are ~``trainable_pct`` % of it: per layer
    the base holds W(W+1) floats, the adapter and its moments 3 · 2 · rank · W."""
    per_layer = (width * width + width) * 4
    layers = max(1, round(base_mb * MiB / per_layer))
    if rank is None:
        rank = max(1, round(trainable_pct / 100 * (width + 1) / 6))
    return {"width": width, "layers": layers, "rank": rank}


def build(shape: Dict[str, int]):
    return lora.build(shape["width"], shape["layers"], shape["rank"], seed=0)


def adapters(model) -> Dict[str, Any]:
    return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}


# --- snapd --------------------------------------------------------------------------

def snapd_method(args, shape: Dict[str, int], share: bool) -> Dict[str, Any]:
    """The first snapshot, the stall pass and the durable pass (module docstring)."""
    root = tempfile.mkdtemp(prefix="sd-ft-", dir=args.tmp)
    model, opt = build(shape)
    n = args.snapshots
    res: Dict[str, Any] = {"share_unchanged": share}
    try:
        method = Snapd(root, model, opt, overlap=False, share_unchanged=share)
        method.ckpt.track(model=model, optimizer=opt)
        first = durable_pass(method, shape, 0, 1)   # daemon, arena, the base
        res["first"] = {k: v[0] for k, v in first.items()}
        res["trainable_bytes"] = lora.trainable_bytes(model, opt)
        res["base_bytes"] = lora.base_bytes(model)
        pid = res["daemon_pid"] = benchlib.daemon_pid_of(root)
        res["settle_s"] = [benchlib.wait_idle(pid)]
        res["stall"] = stall_pass(method, shape, 1, n)
        res["settle_s"].append(benchlib.wait_idle(pid))
        res["durable"] = durable_pass(method, shape, 1 + n, n)
        method.ckpt.close()
        res["disk_bytes"] = benchlib.dir_bytes(os.path.join(root, RUN))
        res["snapshots_on_disk"] = 1 + 2 * n
    finally:
        res["daemon_stopped"] = benchlib.stop_daemon(root)
        shutil.rmtree(root, ignore_errors=True)
    return res


def stall_pass(method, shape: Dict[str, int], step: int, n: int) -> Dict[str, List[Any]]:
    """A training loop that never waits for its snapshots; bytes read once all are
    durable."""
    handles, calls = [], []
    for _ in range(n):
        step += 1
        lora.train_step(method.model, method.opt, step, shape["width"])
        t0 = time.perf_counter()
        handles.append(method.ckpt.snapshot(step))
        calls.append(time.perf_counter() - t0)
    results = [h.wait() for h in handles]
    return {"stall_s": calls, "backpressure_s": [h.stall_seconds for h in handles],
            "staged": [h.staged_bytes for h in handles],
            "written": [r.bytes_written for r in results],
            "daemon_write_s": [r.seconds for r in results]}


def durable_pass(method, shape: Dict[str, int], step: int, n: int) -> Dict[str, List[Any]]:
    """A training loop that waits for each snapshot before its next step: scripts/
    bench.py's timing loop (stall, durable, staged and written bytes, the daemon's
    write), a training step before each snapshot."""
    ids = range(step + 1, step + n + 1)
    steps = iter(ids)
    return time_saves(method, ids, lambda: lora.train_step(method.model, method.opt,
                                                           next(steps), shape["width"]))


# --- torch.save ---------------------------------------------------------------------

def torch_save_method(args, shape: Dict[str, int]) -> Dict[str, Any]:
    """``--snapshots`` + 1 saves of the trainable state (the first a warm-up), each
    after a training step, into a new file: scripts/bench.py's torch.save method
    (flush, fsync, fsync of the directory) and timing loop."""
    where = tempfile.mkdtemp(prefix="ts-ft-", dir=args.tmp)
    model, opt = build(shape)
    method, steps = TorchSave(where, model, opt), iter(range(1, args.snapshots + 2))

    def train_step() -> None:
        lora.train_step(model, opt, next(steps), shape["width"])
        method.sd = {"adapters": adapters(model), "optim": opt.state_dict()}
    try:
        out = time_saves(method, range(args.snapshots + 1), train_step)
        sizes = [os.path.getsize(os.path.join(where, f"ts{i}.pt"))
                 for i in range(1, args.snapshots + 1)]
    finally:
        shutil.rmtree(where, ignore_errors=True)
    return {"warmup_s": out["stall_s"][0], "stall_s": out["stall_s"][1:],
            "durable_s": out["durable_s"][1:], "written": sizes,
            "trainable_bytes": lora.trainable_bytes(model, opt),
            "base_bytes": lora.base_bytes(model)}


# --- summary and report -----------------------------------------------------------------

def summarize(results: Dict[str, Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """Per method, the medians the table shows (snapshots 2..N for snapd)."""
    out: Dict[str, Dict[str, Any]] = {}
    for method, r in results.items():
        if "error" in r:
            continue
        if method == "torch_save":
            out[method] = {"stall_s": median(r["stall_s"]), "backpressure_s": 0.0,
                           "durable_s": median(r["durable_s"]), "staged": None,
                           "written": median(r["written"])}
            continue
        s, d = r["stall"], r["durable"]
        out[method] = {"stall_s": median(s["stall_s"]),
                       "backpressure_s": median(s["backpressure_s"]),
                       "staged": median(s["staged"] + d["staged"]),
                       "written": median(s["written"] + d["written"]),
                       "durable_s": median(d["durable_s"]),
                       "idle_stall_s": median(d["stall_s"]),
                       "daemon_write_s": median(d["daemon_write_s"]),
                       "first": r["first"], "disk_bytes": r["disk_bytes"]}
    return out


def mib(n: Optional[float]) -> str:
    if n is None:
        return "–"
    return f"{n / MiB:.2f}" if n < 10 * MiB else f"{n / MiB:.0f}"


def report(data: Dict[str, Any]) -> str:
    info, cfg, summ = data["machine"], data["config"], data["summary"]
    lines = [SECTION, ""] + benchlib.machine_text(info) + describe(cfg) + [""]
    ts = summ.get("torch_save", {})
    lines += ["| snapshots 2..N, median | stall | of which waiting for the previous write "
              "| staged MiB | written MiB | time to durable | stall vs torch.save | "
              "durable vs torch.save |", "|---|---|---|---|---|---|---|---|"]
    for method in METHODS:
        s = summ.get(method)
        if s is None:
            lines.append(f"| {LABEL[method]} | error: see the JSON | | | | | | |")
            continue
        lines.append(f"| {LABEL[method]} | {benchlib.fs(s['stall_s'])} | "
                     f"{benchlib.fs(s['backpressure_s'])} | {mib(s['staged'])} | "
                     f"{mib(s['written'])} | {benchlib.fs(s['durable_s'])} | "
                     f"{benchlib.fr(s['stall_s'], ts.get('stall_s'))} | "
                     f"{benchlib.fr(s['durable_s'], ts.get('durable_s'))} |")
    lines += ["", "| first snapshot (after track() and one step) | stall | staged MiB | "
              "written MiB | time to durable |", "|---|---|---|---|---|"]
    for method in ("snapd_shared", "snapd_full"):
        first = summ.get(method, {}).get("first")
        if first:
            lines.append(f"| {LABEL[method]} | {benchlib.fs(first['stall_s'])} | "
                         f"{mib(first['staged'])} | {mib(first['written'])} | "
                         f"{benchlib.fs(first['durable_s'])} |")
    return "\n".join(lines + [""] + notes(summ, cfg)) + "\n"


def describe(cfg: Dict[str, Any]) -> List[str]:
    return [
        f"Model (tests/lora.py): {cfg['layers']} frozen `Linear({cfg['width']}, "
        f"{cfg['width']})` layer{'s' if cfg['layers'] > 1 else ''}, float32, {cfg['base_bytes'] / MiB:.0f} MiB in all, "
        f"each with a rank-{cfg['rank']} adapter; the trainable state (adapters + AdamW "
        f"moments) is {cfg['trainable_bytes'] / MiB:.2f} MiB, "
        f"{100 * cfg['trainable_bytes'] / max(cfg['base_bytes'], 1):.2f}% of the base; "
        f"`torch.set_num_threads({cfg['threads']})`. A training step, then a snapshot, "
        f"every step. All figures are from **one run**: medians over "
        f"{cfg['snapshots']} snapshots per pass. *Stall*: the snapshot() call in a loop "
        "that never waits for its snapshots (the part spent waiting for the previous "
        "write to free the staging slot is shown apart). *Staged*: the bytes the "
        "snapshot copied out of the live state; *written*: the bytes the daemon wrote. "
        "*Time to durable*: snapshot() call to `handle.wait()` returning, in a second "
        "pass that waits after each snapshot. `torch.save` is synchronous: its stall is "
        "its time to durable, and it saves the trainable state only (the base must come "
        "from the base model's own files at restore); its row has no staging. Ratios "
        "are the method's figure divided by `torch.save`'s in this run (`1/20`: twenty "
        "times shorter). The first snapshot of each snapd run (daemon start, arena, the "
        "base copied once) is not in the medians and is shown below them."]


def notes(summ: Dict[str, Any], cfg: Dict[str, Any]) -> List[str]:
    out = []
    shared, full = summ.get("snapd_shared"), summ.get("snapd_full")
    if shared and full:
        out.append(f"- sharing against `share_unchanged=False`: stall "
                   f"{benchlib.fr(shared['stall_s'], full['stall_s'])}, staged "
                   f"{benchlib.fr(shared['staged'], full['staged'])}, time to durable "
                   f"{benchlib.fr(shared['durable_s'], full['durable_s'])}")
    for method, s in ((m, summ.get(m)) for m in ("snapd_shared", "snapd_full")):
        if not s:
            continue
        out.append(f"- {LABEL[method]}: the daemon's own write (checksums, chunk "
                   f"identities, write, fsync, commit) took {benchlib.fs(s['daemon_write_s'])} "
                   f"of the {benchlib.fs(s['durable_s'])} to durable; snapshot() took "
                   f"{benchlib.fs(s['idle_stall_s'])} when the previous snapshot was durable; "
                   f"the run's directory held {mib(s['disk_bytes'])} MiB after "
                   f"{1 + 2 * cfg['snapshots']} snapshots")
    return out + [""]


# --- driver ---------------------------------------------------------------------------

def run_all(args) -> Dict[str, Any]:
    import torch
    torch.set_num_threads(args.threads)
    shape = shape_of(args.base_mb, args.width, args.trainable_pct, args.rank)
    info = benchlib.start_run(probe=not args.no_probe)
    results: Dict[str, Dict[str, Any]] = {}
    for method in args.methods:
        t0 = time.perf_counter()
        try:
            results[method] = torch_save_method(args, shape) if method == "torch_save" \
                else snapd_method(args, shape, share=method == "snapd_shared")
        except Exception as e:  # one method's failure is reported, the others still run
            results[method] = {"error": f"{type(e).__name__}: {e}"}
        results[method]["wall_s"] = time.perf_counter() - t0
        print(f"  {method:13s} {'error' if 'error' in results[method] else 'ok'} in "
              f"{results[method]['wall_s']:5.1f} s", file=sys.stderr, flush=True)
    benchlib.end_run(info, "bench_finetune.py", args.argv, probe=not args.no_probe)
    sizes = next((r for r in results.values() if "base_bytes" in r), {})
    cfg = {**shape, "base_mb": args.base_mb, "snapshots": args.snapshots,
           "threads": args.threads, "trainable_bytes": sizes.get("trainable_bytes", 0),
           "base_bytes": sizes.get("base_bytes", 0),
           "command": info["command"]}
    return {"machine": info, "config": cfg, "results": results,
            "summary": summarize(results)}


def parse(argv: Optional[List[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-mb", type=float, default=1024,
                    help="frozen base, MiB of float32 weights (default 1024)")
    ap.add_argument("--width", type=int, default=4096, help="layer width (default 4096)")
    ap.add_argument("--trainable-pct", type=float, default=1.0,
                    help="adapters + AdamW state as a %% of the base (default 1)")
    ap.add_argument("--rank", type=int, default=None, help="adapter rank (default: "
                    "from --trainable-pct)")
    ap.add_argument("--snapshots", type=int, default=8,
                    help="snapshots per pass, after the first (default 8)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--tmp", default=tempfile.gettempdir(),
                    help="where the roots and files go (default the temp dir)")
    ap.add_argument("--json", default=None, help="write every figure here")
    ap.add_argument("--doc", default=None,
                    help="replace this script's section of that markdown file")
    ap.add_argument("--no-probe", action="store_true",
                    help="skip the 1 s samples of other processes' CPU (tests)")
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.methods = args.methods.split(",")
    unknown = set(args.methods) - set(METHODS)
    if unknown:
        ap.error(f"--methods: unknown {sorted(unknown)}; use some of {', '.join(METHODS)}")
    if args.snapshots < 1:
        ap.error("--snapshots: at least 1")
    return args


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    return benchlib.run_bench(argv, parse, run_all, report, SECTION)


if __name__ == "__main__":
    main()
