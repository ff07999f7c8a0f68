#!/usr/bin/env python
"""Time to resume: how long a restarted trainer stands still before it trains again.

    python scripts/bench_resume.py [--sizes 1G,2G] [--reps 3] [--quick]
                                   [--device cpu|cuda] [--batch 64]
                                   [--json PATH] [--doc docs/benchmarks.md]

The state is scripts/benchlib.py's ``build_state``: an MLP of Linear(2048, 2048)
layers plus its AdamW state (params + exp_avg + exp_avg_sq ~ the size) after one
optimizer step, on ``--threads`` torch threads. For each size one *save* process
builds it and saves it three ways: ``torch.save`` + fsync and ``dcp.save`` (both as
scripts/bench.py saves them; DCP's state dict from ``get_state_dict``, the form a
fresh trainer can load into) and one snapd snapshot through its daemon, whose
connection then drops as a killed trainer's does, so the daemon keeps its copy in
memory for a restart on the same node. It also runs the first update on the saved
state and keeps the digest (xxh3) of every tensor after it.

Then every restore runs in a *freshly started process*, a restarted trainer: it
builds the model and an AdamW holding no state (untimed), constructs what restores
(the snapd Client and its track(), untimed), runs 50 ms of matmuls (benchlib's
``train_briefly``, as before every timed copy), then, timed from the call that
restores:

- ``snapd_overlap``: ``Client.restore(overlap=True)``: returns before the optimizer's
  moments are read; the first ``optimizer.step()`` waits for them;
- ``snapd``: ``Client.restore()``;
- ``torch_load``: ``torch.load(weights_only=True)`` + both ``load_state_dict``;
- ``dcp_load``: ``get_state_dict`` (which allocates the optimizer's state), ``dcp.load``
  in place, ``set_state_dict``;

each followed by the same first update: one forward of a fixed batch
(``--batch`` rows of 2048, from a seeded generator of its own), ``square().mean()``,
backward, ``optimizer.step()``. The batch sets how much compute the moments can
arrive behind: a larger one favours overlap. The figures of one process:

- ``ready_s``, *time to ready*: the restore call until it returns (for every method
  but ``snapd_overlap`` that is the full restore);
- ``first_update_s``, *time to first update done*: the restore call until the end of
  that first ``optimizer.step()``;
- ``forward_backward_s`` (the forward and backward) and ``step_s`` (the first
  ``optimizer.step()``; with overlap it includes the wait in snapd's pre-hook for
  the moments still arriving);
- ``paired_direct_s`` (cold only): after the update, the files the method read, read
  raw by O_DIRECT with scripts/bench.py's ``DirectReader``: that worker's own floor of
  a cold read, at the disk speed of that minute;
- ``faults``: the process's minor page faults (first touches of memory) during the
  restore, the forward and backward, and the step: where each method pays for its
  new memory (the first backward allocates the gradients, a third of the state);
- ``digest``: every tensor of the state after the update; every process of a size
  should end with the save process's.

*Hot*: the files read once into the page cache before the restore (torch.load,
DCP); snapd reads the daemon's copy (a read-only Client, so that the daemon keeps the
copy for the next process, as scripts/bench.py's hot restores do; it writes no resume
record and takes no lock, hot or cold). *Cold*: the method's files dropped from the
page cache first (benchlib's ``drop_cache``), snapd without its daemon (from the
files, by direct I/O). Restores run method by method in turn, the order rotated
each repetition, ``--reps`` of each (hot, then cold); figures are medians.

Goals, as ratios of medians of the same run (the targets table):

- overlap first update / no-overlap first update ≤ 0.75, cold;
- overlap first update / the faster peer's (torch.load, dcp.load) ≤ 0.6, cold;
- overlap ready / the full restore (snapd without overlap) ≤ 0.45, hot and cold;
- each method's cold restore over its own worker's raw read (bench_render's
  ``cold_against_own_raw``): snapd's ≤ 1.1× the best peer's, at every size.

``--device cuda``: the state and the first update on the GPU (every restore copies
to it; torch.load's file was saved from it and loads onto it). The timings wait for
the kernels queued on the timed thread's stream; the background part of
``restore(overlap=True)`` is waited for by the step's pre-hook, as in training. On a
GPU a forward and backward of a batch of 64 rows take a few milliseconds: there is
nothing to hide the moments behind unless ``--batch`` is near what training uses.

``--quick`` is a smoke run: a 32M state, one repetition.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench  # noqa: E402  (the save methods, DirectReader)
import bench_render  # noqa: E402  (cold_against_own_raw, target rows)
import benchlib  # noqa: E402
from benchlib import REPO, fr, fs, median  # noqa: E402

SECTION = "## Time to resume: restore with overlap (scripts/bench_resume.py)"
RUN = "resume"
METHODS = ["snapd_overlap", "snapd", "torch_load", "dcp_load"]
TEMPS = ["hot", "cold"]
PEERS = ("torch_load", "dcp_load")
LABEL = {"snapd_overlap": "snapd, restore(overlap=True)", "snapd": "snapd, restore()",
         "torch_load": "torch.load + load_state_dict", "dcp_load": "dcp.load"}
# bench_render.cold_against_own_raw's names for the same full restores
COLD_NAME = {"snapd": "snapd_wait", "torch_load": "torch_save", "dcp_load": "dcp_save"}
GOALS = {"vs_plain": 0.75, "vs_peer": 0.6, "ready": 0.45, "raw_vs_peer": 1.1}


# --- the save process ---------------------------------------------------------------

def dcp_state(model, opt) -> Dict[str, Any]:
    """DCP's state dict of the pair, keyed by parameter name: what a fresh trainer's
    ``get_state_dict`` asks ``dcp.load`` for."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def first_update(model, opt, x) -> None:
    """The first update of a resumed run: forward, backward, step."""
    model(x).square().mean().backward()
    opt.step()


def batch(rows: int, device: str = "cpu"):
    import torch
    gen = torch.Generator().manual_seed(1234)
    return torch.randn(rows, benchlib.WIDTH, generator=gen).to(device)


def sync(device: str) -> None:
    """Wait for the work queued on this thread's stream: a CUDA call returns before its
    kernels end. That stream only: a background restore's copies on another stream
    are waited for where the step's pre-hook waits, not here."""
    if device.startswith("cuda"):
        import torch
        torch.cuda.current_stream().synchronize()


def digest(model, opt) -> str:
    """xxh3 of every tensor of the state, in order."""
    import torch
    import xxhash
    h = xxhash.xxh3_64()
    for t in benchlib.state_tensors(model, opt):
        h.update(memoryview(t.detach().cpu().contiguous().reshape(-1)
                            .view(torch.uint8).numpy()))
    return h.hexdigest()


def w_save(args) -> Dict[str, Any]:
    """Save the state three ways; the files, and the digest after its first update."""
    from snapd_client import Client
    model, opt = benchlib.build_state(benchlib.parse_size(args.size), args.threads,
                                      args.device)
    os.makedirs(args.root, exist_ok=True)
    res: Dict[str, Any] = {"state_bytes": benchlib.nbytes_of(
        benchlib.state_tensors(model, opt))}
    ts = bench.make_method("torch_save", args.root, model, opt)
    ts.save(0)
    dcp = bench.DcpSave(args.root, model, opt)
    dcp.sd = dcp_state(model, opt)
    dcp.save(0)
    client = Client(args.root, RUN)
    client.track(model=model, optimizer=opt)
    client.restore()   # a fresh run: 0
    client.snapshot(1).wait()
    res["daemon_pid"] = benchlib.daemon_pid_of(args.root)
    res["settle_s"] = benchlib.wait_idle(res["daemon_pid"])
    benchlib.close_as_if_killed(client)   # the daemon keeps its copy for a restart
    res.update(torch_file=ts.path, dcp_dir=dcp.path, snapd_dir=newest_snapshot(args.root))
    # build_state's gradients are not saved: a restarted trainer's backward starts
    # from none, and so does this one.
    opt.zero_grad(set_to_none=True)
    first_update(model, opt, batch(args.batch, args.device))
    res["digest"] = digest(model, opt)
    return res


def newest_snapshot(root: str) -> str:
    snaps = os.path.join(root, RUN, "snapshots")
    return max((os.path.join(snaps, d) for d in os.listdir(snaps)
                if not d.startswith(".")),
               key=lambda d: os.path.getmtime(os.path.join(d, "manifest.snapd")))


# --- a restarted trainer --------------------------------------------------------------

def method_files(method: str, saved: Dict[str, Any]) -> tuple:
    """What a cold restore drops from the page cache, and the files it reads."""
    if method == "torch_load":
        return saved["torch_file"], [saved["torch_file"]]
    if method == "dcp_load":
        return saved["dcp_dir"], benchlib.files_under(saved["dcp_dir"])
    tensors = [p for p in benchlib.files_under(saved["snapd_dir"])
               if not p.endswith("manifest.snapd")]
    return os.path.dirname(saved["snapd_dir"]), tensors


def restorer(method: str, temp: str, root: str, saved: Dict[str, Any], model, opt):
    """What restores, constructed as a restarted trainer constructs it (untimed): a
    call that restores into ``model`` and ``opt``, and its snapd Client (or None)."""
    if method == "torch_load":
        load = bench.TorchSave(root, model, opt)
        load.path = saved["torch_file"]
        return load.load, None
    if method == "dcp_load":
        return lambda: dcp_restore(saved["dcp_dir"], model, opt), None
    from snapd_client import Client
    # Read-only: a writing trainer's restore lets the daemon drop its copy, and every
    # repetition needs it. Cold: no daemon, the files.
    client = Client(root, RUN, read_only=True, daemon=temp == "hot")
    client.track(model=model, optimizer=opt)
    return (lambda: client.restore(overlap=method == "snapd_overlap")), client


def dcp_restore(path: str, model, opt) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict
    sd = dcp_state(model, opt)
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def minor_faults() -> int:
    """This process's page faults so far that read no disk: first touches of memory,
    which cost this VM far more than a copy into touched pages (snapd_client/prefault.py)."""
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def w_restore(args) -> Dict[str, Any]:
    """One restore and the first update, in this fresh process; its figures."""
    with open(args.saved) as f:
        saved = json.load(f)
    model, opt = benchlib.build_state(benchlib.parse_size(args.size), args.threads,
                                      args.device, step=False)
    x = batch(args.batch, args.device)
    dropped, files = method_files(args.worker, saved)
    res: Dict[str, Any] = {}
    if args.temp == "cold":
        res["cold_dropped"] = benchlib.drop_cache(dropped)
    elif args.worker in PEERS:
        res["warmed_bytes"] = benchlib.warm_cache(dropped)
    restore, client = restorer(args.worker, args.temp, args.root, saved, model, opt)
    benchlib.train_briefly()
    sync(args.device)
    f0, t0 = minor_faults(), time.perf_counter()
    restore()
    sync(args.device)   # a restore's copies to the device are done when it is ready
    ready, f1 = time.perf_counter(), minor_faults()
    model(x).square().mean().backward()   # first_update's, timed in its two parts
    sync(args.device)
    fb, f2 = time.perf_counter(), minor_faults()
    opt.step()
    sync(args.device)
    done, f3 = time.perf_counter(), minor_faults()
    res.update(ready_s=ready - t0, first_update_s=done - t0, forward_backward_s=fb - ready,
               step_s=done - fb, faults=[f1 - f0, f2 - f1, f3 - f2])
    if client is not None:
        res["restored_from"] = client.restored_from
        benchlib.close_as_if_killed(client)   # the daemon keeps its copy
    res["digest"] = digest(model, opt)
    if args.temp == "cold":
        raw = bench.DirectReader(files)
        try:
            res["paired_direct_s"] = raw.read() if raw.fds else None
        finally:
            raw.close()
    return res


# --- the run --------------------------------------------------------------------------

def run_worker(args, worker: str, size: str, root: str, out: str,
               **extra: str) -> Dict[str, Any]:
    """One process (``--worker``): its JSON, or the error it ended with."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", worker, "--size", size,
           "--root", root, "--out", out, "--threads", str(args.threads),
           "--batch", str(args.batch), "--device", args.device]
    for k, v in extra.items():
        cmd += [f"--{k}", v]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, PYTHONWARNINGS="ignore"),
                          capture_output=True, text=True, timeout=args.timeout)
    try:
        with open(out) as f:
            res = json.load(f)
    except (OSError, ValueError):
        res = {"error": f"exit {proc.returncode}: {proc.stderr.strip()[-2000:]}"}
    res["wall_s"] = time.perf_counter() - t0
    status = "error" if "error" in res else "ok"
    print(f"  {worker:14s} {size:5s} {extra.get('temp', ''):4s} {status} in "
          f"{res['wall_s']:5.1f} s", file=sys.stderr, flush=True)
    if status == "error":
        print("    " + res["error"][-800:].replace("\n", "\n    "), file=sys.stderr)
    return res


def run_size(args, size: str, base: str) -> Dict[str, Any]:
    """The save process, then every restore of one size: hot, then cold."""
    root = os.path.join(base, size)
    saved_json = os.path.join(base, f"saved-{size}.json")
    out: Dict[str, Any] = {"runs": {t: {m: [] for m in METHODS} for t in TEMPS}}
    try:   # the daemon the save process started is stopped however this ends
        out["saved"] = run_worker(args, "save", size, root, saved_json)
        if "error" in out["saved"]:
            return out
        for temp in TEMPS:
            for rep in range(args.reps):
                # Rotated: no method always follows the same one.
                for method in METHODS[rep % len(METHODS):] + METHODS[:rep % len(METHODS)]:
                    res_json = os.path.join(base, f"{method}-{size}-{temp}-{rep}.json")
                    out["runs"][temp][method].append(run_worker(
                        args, method, size, root, res_json, temp=temp, saved=saved_json))
    finally:
        benchlib.stop_daemon(root)
        shutil.rmtree(root, ignore_errors=True)
    return out


def run_all(args) -> Dict[str, Any]:
    info = benchlib.start_run(probe=not args.no_probe)
    base = tempfile.mkdtemp(prefix="snapd-resume-", dir=args.tmp)
    sizes: Dict[str, Any] = {}
    try:
        for size in args.sizes:
            print(f"size {size} ({args.reps} of each restore)", file=sys.stderr)
            sizes[size] = run_size(args, size, base)
            if args.json:   # a run cut short still leaves the sizes it finished
                with open(args.json, "w") as f:
                    json.dump({"partial": True, "sizes": sizes}, f)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    benchlib.end_run(info, "bench_resume.py", args.argv, probe=not args.no_probe)
    config = {"sizes": args.sizes, "reps": args.reps, "threads": args.threads,
              "batch": args.batch, "device": device_name(args.device)}
    return {"machine": info, "config": config, "sizes": sizes,
            "figures": {s: figures(r) for s, r in sizes.items()}}


def device_name(device: str) -> str:
    if not device.startswith("cuda"):
        return device
    import torch
    return f"{device} ({torch.cuda.get_device_name()}, CUDA {torch.version.cuda})"


# --- the figures (pure) ---------------------------------------------------------------

KEYS = ("ready_s", "first_update_s", "forward_backward_s", "step_s",
        "paired_direct_s")


def medians_of(runs: Dict[str, Dict[str, List[Dict[str, Any]]]]) -> Dict[str, Any]:
    """temp -> method -> key -> the median over that method's processes (None when
    none measured it)."""
    return {temp: {method: {key: median([r[key] for r in rs if r.get(key) is not None])
                            for key in KEYS}
                   for method, rs in per.items()}
            for temp, per in runs.items()}


def ratio(x: Optional[float], y: Optional[float]) -> Optional[float]:
    return x / y if x is not None and y else None


def faster_peer(per: Dict[str, Dict[str, Any]], key: str = "first_update_s"):
    """The peer (torch.load, dcp.load) with the smaller median ``key``: (name, s)."""
    measured = [(per[p][key], p) for p in PEERS if per.get(p, {}).get(key) is not None]
    if not measured:
        return None, None
    seconds, name = min(measured)
    return name, seconds


def resume_ratios(med: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    """temp -> the ratios the goals are set on: overlap over no overlap (first
    update), overlap over the faster peer (first update), overlap ready over the full
    restore (snapd's, without overlap)."""
    out = {}
    for temp, per in med.items():
        ov, plain = per.get("snapd_overlap", {}), per.get("snapd", {})
        peer, peer_s = faster_peer(per)
        first = ov.get("first_update_s")
        out[temp] = {"vs_plain": ratio(first, plain.get("first_update_s")),
                     "vs_peer": ratio(first, peer_s), "peer": peer,
                     "ready": ratio(ov.get("ready_s"), plain.get("ready_s"))}
    return out


def cold_raw(runs: Dict[str, Dict[str, List[Dict[str, Any]]]]) -> Dict[str, Any]:
    """Each full restore's cold time over its own processes' raw read of its files
    (bench_render.cold_against_own_raw, by its method names): method -> (cold, raw,
    ratio)."""
    cold = runs.get("cold", {})
    per = {COLD_NAME[m]: {"restore_cold_s": [r["ready_s"] for r in cold.get(m, [])
                                             if r.get("ready_s") is not None],
                          "paired_direct_s": [r["paired_direct_s"] for r in cold.get(m, [])
                                              if r.get("paired_direct_s")]}
           for m in COLD_NAME}
    back = {v: k for k, v in COLD_NAME.items()}
    return {back[name]: (c, raw, c / raw)
            for name, (c, raw) in bench_render.cold_against_own_raw(per).items()}


def fault_medians(runs: Dict[str, Dict[str, List[Dict[str, Any]]]]) -> Dict[str, Any]:
    """temp -> method -> the median page faults of [restore, forward+backward, step]."""
    return {temp: {method: [median([r["faults"][i] for r in rs if "faults" in r])
                            for i in range(3)]
                   for method, rs in per.items()}
            for temp, per in runs.items()}


def figures(size_run: Dict[str, Any]) -> Dict[str, Any]:
    runs = size_run["runs"]
    med = medians_of(runs)
    expected = size_run.get("saved", {}).get("digest")
    differs = sorted({f"{m} ({t})" for t, per in runs.items() for m, rs in per.items()
                      for r in rs if "digest" in r and r["digest"] != expected})
    compared = sum(1 for per in runs.values() for rs in per.values() for r in rs
                   if "digest" in r)
    return {"medians": med, "ratios": resume_ratios(med), "cold_raw": cold_raw(runs),
            "faults": fault_medians(runs),
            "digest_differs": differs, "digest_compared": compared,
            "save_error": size_run.get("saved", {}).get("error"),
            "hot_from_disk": sorted({m for m, rs in runs.get("hot", {}).items() for r in rs
                                     if r.get("restored_from") not in (None, "hot")}),
            "errors": sorted({f"{m} ({t})" for t, per in runs.items()
                              for m, rs in per.items() for r in rs if "error" in r})}


def size_targets(size: str, fig: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The goal rows of one size, in the docstring's order."""
    med, rows = fig["medians"], []
    cold = med.get("cold", {})
    ov = cold.get("snapd_overlap", {}).get("first_update_s")
    peer, peer_s = faster_peer(cold)
    rows.append(bench_render.target(
        "overlap first update ≤ 0.75× without overlap, cold", size, ov,
        cold.get("snapd", {}).get("first_update_s"), GOALS["vs_plain"]))
    peer_label = LABEL.get(peer, "–")
    rows.append(bench_render.target(
        f"overlap first update ≤ 0.6× the faster peer's ({peer_label}), cold",
        size, ov, peer_s, GOALS["vs_peer"]))
    for temp in TEMPS:
        per = med.get(temp, {})
        rows.append(bench_render.target(
            f"overlap ready ≤ 0.45× the full restore (snapd), {temp}", size,
            per.get("snapd_overlap", {}).get("ready_s"),
            per.get("snapd", {}).get("ready_s"), GOALS["ready"]))
    rows.append(raw_target(size, fig["cold_raw"]))
    return [r for r in rows if r is not None]


def raw_target(size: str, raw: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """snapd's cold restore over its own raw read ≤ 1.1× the best peer's ratio."""
    peers = [(raw[p][2], p) for p in PEERS if p in raw]
    if "snapd" not in raw or not peers:
        return None
    best, name = min(peers)
    mine = raw["snapd"][2]
    return {"id": f"snapd cold restore / own raw read ≤ 1.1× the best peer's "
                  f"({LABEL[name]})", "size": size, "ratio": mine / best,
            "measured": f"{mine / best:.2f}× ({mine:.2f} vs {best:.2f})",
            "ok": mine / best <= GOALS["raw_vs_peer"]}


# --- the section ----------------------------------------------------------------------

def report(data: Dict[str, Any]) -> str:
    cfg, info = data["config"], data["machine"]
    lines = [SECTION, "",
             "How long a restarted trainer stands still: each restore in a freshly "
             "started process, timed from the call that restores to its return (*ready*) "
             "and to the end of the first `optimizer.step()` after one forward and "
             f"backward (a batch of {cfg['batch']} rows; *first update*). State: the MLP "
             f"+ AdamW of scripts/benchlib.py on {cfg.get('device', 'cpu')}, "
             f"{cfg['threads']} torch threads; medians of {cfg['reps']} processes per "
             "cell. Hot: torch.load's and DCP's files in the page cache, snapd from its "
             "daemon's copy; cold: the files dropped from the page cache, snapd without "
             "its daemon. The script's docstring says what each figure is.", ""]
    lines += benchlib.machine_text(info)
    lines += ["| size | method | hot: ready | hot: first update | cold: ready | "
              "cold: first update | cold: raw read of its files |",
              "|---|---|---:|---:|---:|---:|---:|"]
    for size, fig in data["figures"].items():
        med = fig["medians"]
        for method in METHODS:
            hot, cold = med["hot"][method], med["cold"][method]
            lines.append(f"| {size} | {LABEL[method]} | {fs(hot['ready_s'])} | "
                         f"{fs(hot['first_update_s'])} | {fs(cold['ready_s'])} | "
                         f"{fs(cold['first_update_s'])} | {fs(cold['paired_direct_s'])} |")
    lines += ["", "| target | size | measured | met |", "|---|---|---|---|"]
    for size, fig in data["figures"].items():
        for row in size_targets(size, fig):
            lines.append(f"| {row['id']} | {size} | {row['measured']} | "
                         f"{'yes' if row['ok'] else '**no**'} |")
    lines += [""] + notes(data)
    return "\n".join(lines) + "\n"


def notes(data: Dict[str, Any]) -> List[str]:
    out = []
    for size, fig in data["figures"].items():
        r = fig["ratios"]
        out.append(f"- {size}: first update with overlap over without: hot "
                   f"{fr_(r['hot']['vs_plain'])}, cold {fr_(r['cold']['vs_plain'])}; "
                   f"ready over the full restore: hot {fr_(r['hot']['ready'])}, cold "
                   f"{fr_(r['cold']['ready'])}.")
        hot = fig.get("faults", {}).get("hot", {})
        if all(None not in hot.get(m, [None]) for m in METHODS):
            out.append(f"- {size}: page faults (restore / forward and backward / step), hot: "
                       + "; ".join(f"{LABEL[m]} " + " / ".join(f"{n / 1e3:.0f} k"
                                                                for n in hot[m])
                                   for m in METHODS) + ".")
        if fig.get("save_error"):
            out.append(f"- {size}: **the save process failed**, nothing was restored: "
                       f"{fig['save_error'][-300:]}")
        elif fig["digest_differs"]:
            out.append(f"- {size}: **the state after the first update differs** from the "
                       f"save process's in: {', '.join(fig['digest_differs'])}.")
        elif fig["digest_compared"]:
            out.append(f"- {size}: every process ({fig['digest_compared']}) ended its "
                       "first update with the save process's state, bit for bit (xxh3 "
                       "of every tensor).")
        if fig.get("hot_from_disk"):
            out.append(f"- {size}: **hot restores that read the files**, not the "
                       f"daemon's copy: {', '.join(fig['hot_from_disk'])}.")
        if fig["errors"]:
            out.append(f"- {size}: **failed**: {', '.join(fig['errors'])} (see the JSON).")
    return out


def fr_(r: Optional[float]) -> str:
    return fr(r, 1.0)


# --- the command line -----------------------------------------------------------------

def parse(argv: Optional[List[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default=None, help="comma-separated (default 1G,2G)")
    ap.add_argument("--reps", type=int, default=None,
                    help="processes per method, size and temperature (default 3)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 32M, one repetition")
    ap.add_argument("--batch", type=int, default=64,
                    help="rows of the first update's batch (default 64)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu",
                    help="where the state and the first update live: cpu (default) or "
                    "cuda (restores copy to the device; timings wait for its kernels)")
    ap.add_argument("--timeout", type=float, default=900,
                    help="seconds one process may take (default 900)")
    ap.add_argument("--tmp", default=tempfile.gettempdir(),
                    help="where the files go (default the temp dir)")
    ap.add_argument("--json", default=None, help="write every figure here")
    ap.add_argument("--doc", default=None,
                    help="replace this script's section of that markdown file")
    ap.add_argument("--no-probe", action="store_true",
                    help="skip the 1 s samples of other processes' CPU (tests)")
    for hidden in ("--worker", "--size", "--root", "--out", "--temp", "--saved"):
        ap.add_argument(hidden, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.sizes = (args.sizes or ("32M" if args.quick else "1G,2G")).split(",")
    args.reps = args.reps or (1 if args.quick else 3)
    return args


def main(argv: Optional[List[str]] = None) -> Optional[Dict[str, Any]]:
    args = parse(argv)
    if args.worker:   # one process of the run
        import warnings
        warnings.filterwarnings("ignore")
        res = w_save(args) if args.worker == "save" else w_restore(args)
        with open(args.out, "w") as f:
            json.dump(res, f)
        return None
    return benchlib.run_bench(argv, parse, run_all, report, SECTION)


if __name__ == "__main__":
    main()
