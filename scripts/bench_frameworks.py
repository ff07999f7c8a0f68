#!/usr/bin/env python
"""Training time of a Lightning fit and a Hugging Face Trainer run with snapd's
snapshots, with the framework's own checkpoints, and with none.

    python scripts/bench_frameworks.py [--size 1G] [--every 5] [--steps 41]
        [--frameworks lightning,transformers] [--rounds 3] [--threads 1]
        [--mode wait] [--json PATH] [--doc docs/benchmarks.md]

For each framework, one stock loop (scripts/stock_loops.py: Lightning trains a wide
MLP, the Trainer a GPT-2 built from its config, each sized to a state of ``--size``
bytes: weights + AdamW's two moments) runs three ways, each in a fresh child
process of this one, so that one way does not warm the next: ``none`` (no
checkpoint), ``own`` (``ModelCheckpoint(every_n_train_steps=N)``; ``save_steps=N``)
and ``snapd`` (a snapshot every N steps). With ``--rounds`` above 1 the order
alternates (none, own, snapd; snapd, own, none; ...) so that drift in the machine's
load falls on every way alike. Between two children the page cache's dirty pages are
written out (``sync``) and a snapd daemon is stopped.

Figures, per framework (medians over the rounds):

- the whole ``fit()`` / ``train()`` time of each way, and the timed *window*: from
  the start of step N+1 to the start of step kN+1 (stock_loops.py says why), with
  the ratios own / none and snapd / none;
- the overhead per checkpoint: (window of the way - window of none) / checkpoints
  in the window, each round's ways compared with each other;
- snapd's overhead per snapshot in its own run: its window against its own calm
  steps (none overlapping a snapshot's call-to-durable span or the step after it),
  which the machine's speed from one process to the next does not move;
- snapd's stall: what each ``snapshot()`` call cost the training thread, as the
  client logs it (the ``staged`` event of the state log; the first snapshot, which
  may start the daemon and touches the staging arena first, apart);
- the reference: ``copy_`` of the same state into preallocated memory, timed in the
  snapd child after its fit (each copy after 50 ms of matmuls);
- the target: snapd's overhead per snapshot at most 1.1x that copy, judged in its own
  run where the window has calm steps, else between runs.
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
import benchlib  # noqa: E402  (the bench scripts' shared pieces)
from benchlib import fr, fs, median  # noqa: E402
from stock_loops import FRAMEWORKS, WAYS, run_way, window  # noqa: E402

SECTION = ("## Frameworks: training time with snapd, with their own checkpoints, "
           "with none (scripts/bench_frameworks.py)")
TARGET = 1.1   # snapd's overhead per snapshot, at most this times the copy_
LABEL = {"lightning": "Lightning", "transformers": "HF Trainer"}
OWN = {"lightning": "`ModelCheckpoint(every_n_train_steps=N)`",
       "transformers": "`save_strategy=\"steps\", save_steps=N`"}
# Per framework: a step whose compute is small beside AdamW's pass over the state
# (GPT-2's forward and backward cost 6 flops a weight a token: 2 x 32 tokens).
DEFAULT_WIDTH = {"lightning": 2048, "transformers": 1024}
DEFAULT_BATCH = {"lightning": 8, "transformers": 2}


# --- the children -------------------------------------------------------------------

def order(round_: int) -> tuple:
    """The ways of one round: forward in even rounds, backward in odd ones."""
    return benchlib.round_order(WAYS, round_)


def child_config(args, framework: str, way: str, base: str, round_: int) -> Dict[str, Any]:
    return {"framework": framework, "way": way, "size": args.size,
            "width": args.width or DEFAULT_WIDTH[framework], "every": args.every,
            "steps": args.steps, "threads": args.threads,
            "batch": args.batch or DEFAULT_BATCH[framework], "seq": args.seq,
            "vocab": args.vocab,
            "dir": os.path.join(base, f"{framework}-{way}-{round_}"),
            "client": {"mode": args.mode}, "copy_reps": args.copy_reps}


def run_child(cfg: Dict[str, Any]) -> Dict[str, Any]:
    """One way in a fresh interpreter: its figures, or the error it ended with."""
    os.makedirs(cfg["dir"])
    spec, out = os.path.join(cfg["dir"], "config.json"), os.path.join(cfg["dir"], "out.json")
    with open(spec, "w") as f:
        json.dump(cfg, f)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [benchlib.REPO] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
        "OMP_NUM_THREADS": str(cfg["threads"]), "HF_HUB_OFFLINE": "1"}
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", spec, out],
                          env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0 or not os.path.exists(out):
        return {"error": f"exit {done.returncode}: {done.stderr[-2000:]}", "wall_s": wall}
    with open(out) as f:
        res = json.load(f)
    res["wall_s"] = wall
    return res


def child_main(spec: str, out: str) -> None:
    import logging
    for name in ("lightning.pytorch", "transformers"):   # their banners, not errors
        logging.getLogger(name).setLevel(logging.ERROR)
    with open(spec) as f:
        cfg = json.load(f)
    res = run_way(cfg)
    with open(out, "w") as f:
        json.dump(res, f)


def after_child(cfg: Dict[str, Any], res: Dict[str, Any]) -> None:
    """The daemon the snapd child started stopped, its files removed, and what other
    ways wrote put on disk, before the next child starts."""
    if cfg["way"] == "snapd":
        res["daemon_stopped"] = benchlib.stop_daemon(os.path.join(cfg["dir"], "snapd"))
    shutil.rmtree(cfg["dir"], ignore_errors=True)
    os.sync()


def run_all(args) -> Dict[str, Any]:
    info = benchlib.start_run(probe=not args.no_probe)
    shm_before = set(benchlib.snapd_shm_files())   # other runs' are not this one's
    base = tempfile.mkdtemp(prefix="sdfw-", dir=args.tmp)   # daemon sockets: 107 bytes
    runs: Dict[str, List[Dict[str, Any]]] = {fw: [] for fw in args.frameworks}
    try:
        for framework in args.frameworks:
            for r in range(args.rounds):
                ways: Dict[str, Any] = {}
                for way in order(r):
                    cfg = child_config(args, framework, way, base, r)
                    ways[way] = run_child(cfg)
                    after_child(cfg, ways[way])
                    print(f"  {framework:12s} round {r} {way:5s} "
                          f"{'error' if 'error' in ways[way] else 'ok'} in "
                          f"{ways[way]['wall_s']:6.1f} s", file=sys.stderr, flush=True)
                runs[framework].append(ways)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    benchlib.end_run(info, "bench_frameworks.py", args.argv, probe=not args.no_probe)
    config = {k: getattr(args, k) for k in ("size", "every", "steps", "rounds", "threads",
                                            "mode", "batch", "seq", "vocab", "width")}
    return {"machine": info, "config": config, "runs": runs,
            "summary": {fw: summarize(rounds) for fw, rounds in runs.items()},
            "shm_left": sorted(set(benchlib.snapd_shm_files()) - shm_before)}


# --- the figures --------------------------------------------------------------------

def in_window(steps: List[int], win: List[int]) -> List[int]:
    return [s for s in steps if win[0] <= s < win[1]]


def in_run_overhead(snapd: Dict[str, Any], win: List[int]) -> Dict[str, Any]:
    """snapd's overhead per snapshot against its own run's undisturbed steps, the
    estimate that the machine's speed from one process to the next does not move
    (bench_cadence.py's *in loop*, here per snapshot): a window step is disturbed when
    it overlaps a snapshot's call-to-durable span (from the call's start to its
    ``committed`` record; to the run's end for one never committed) or starts within
    one median step after one; the others are calm. Overhead per snapshot: (window
    time - window steps x the calm steps' mean) / snapshots in the window; None with
    fewer than two calm steps (a window too short for it)."""
    stamped, walls = snapd["stamped"], snapd["step_walls"]
    guard = median(snapd["step_times"])
    spans = [(s["staged_at"] - s["stall_s"], s["durable_at"] if s["durable_at"] is not None
              else walls[-1]) for s in snapd["snapshots"]]
    steps = [(a, b) for step, a, b in zip(stamped, walls, walls[1:])
             if win[0] <= step < win[1]]
    calm = benchlib.calm_steps(steps, spans, guard)
    taken = in_window([s["step"] for s in snapd["snapshots"]], win)
    if len(calm) < 2 or not taken:
        return {"per_snapshot_s": None, "calm_steps": len(calm)}
    excess = sum(b - a for a, b in steps) - len(steps) * sum(calm) / len(calm)
    return {"per_snapshot_s": excess / len(taken), "calm_steps": len(calm)}


def one_round(ways: Dict[str, Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """One round's figures: each way against none, in the same round."""
    if any("error" in ways.get(w, {"error": "missing"}) for w in WAYS):
        return None
    none, own, snapd = (ways[w] for w in WAYS)
    win = none["window"]
    taken = in_window([s["step"] for s in snapd["snapshots"]], win)
    saved = in_window(own["saves"], win)
    stalls = [s["stall_s"] for s in snapd["snapshots"] if s["step"] in taken]
    first = snapd["snapshots"][0] if snapd["snapshots"] else {}
    copy = median(snapd["copy_s"])
    per_snapshot = (snapd["window_s"] - none["window_s"]) / len(taken) if taken else None
    own_run = in_run_overhead(snapd, win)
    in_run = own_run["per_snapshot_s"]
    return {
        "fit_s": {w: ways[w]["fit_s"] for w in WAYS},
        "window_s": {w: ways[w]["window_s"] for w in WAYS},
        "trainer_cpu_s": {w: ways[w]["trainer_cpu_s"] for w in WAYS},
        "fit_ratio": {w: ways[w]["fit_s"] / none["fit_s"] for w in ("own", "snapd")},
        "window_ratio": {w: ways[w]["window_s"] / none["window_s"] for w in ("own", "snapd")},
        "step_s": none["step_s"],
        "own_per_checkpoint_s": (own["window_s"] - none["window_s"]) / len(saved)
        if saved else None,
        "snapd_per_snapshot_s": per_snapshot,
        "daemon_cpu_per_snapshot_s": snapd["daemon_cpu_s"] / len(taken)
        if taken and snapd["daemon_cpu_s"] is not None else None,
        "stall_s": median(stalls), "waited_s": max([s["waited_s"] for s in
                                                    snapd["snapshots"]], default=0.0),
        "first_stall_s": first.get("stall_s"),
        "copy_s": copy,
        "overhead_vs_copy": per_snapshot / copy if per_snapshot is not None and copy
        else None,
        "in_run_per_snapshot_s": in_run, "calm_steps": own_run["calm_steps"],
        "in_run_vs_copy": in_run / copy if in_run is not None and copy else None,
        "snapshots": [s["step"] for s in snapd["snapshots"]], "in_window": len(taken),
        "saves": own["saves"], "saves_in_window": len(saved),
        "state_bytes": snapd["state_bytes"], "layers": snapd["layers"],
    }


def summarize(rounds: List[Dict[str, Dict[str, Any]]]) -> Dict[str, Any]:
    """Medians of the rounds' figures (rounds with a failed way left out)."""
    done = [f for f in (one_round(w) for w in rounds) if f is not None]
    if not done:
        return {"error": next((w[k]["error"] for w in rounds for k in WAYS
                               if "error" in w.get(k, {})), "no round")}

    def med(*path):
        vals = []
        for f in done:
            for key in path:
                f = f.get(key) if isinstance(f, dict) else None
            if f is not None:
                vals.append(f)
        return median(vals)

    out: Dict[str, Any] = {"rounds": len(done)}
    for group in ("fit_s", "window_s", "trainer_cpu_s"):
        out[group] = {w: med(group, w) for w in WAYS}
    for group in ("fit_ratio", "window_ratio"):
        out[group] = {w: med(group, w) for w in ("own", "snapd")}
    for key in ("step_s", "own_per_checkpoint_s", "snapd_per_snapshot_s",
                "daemon_cpu_per_snapshot_s", "stall_s",
                "waited_s", "first_stall_s", "copy_s", "overhead_vs_copy",
                "in_run_per_snapshot_s", "in_run_vs_copy", "calm_steps"):
        out[key] = med(key)
    for key in ("snapshots", "in_window", "saves", "saves_in_window", "state_bytes",
                "layers"):
        out[key] = done[0][key]
    # The verdict by the run's own calm steps where the window has them: between two
    # processes the same step's time differs by more than a snapshot costs.
    out["target_by"] = "in_run" if out["in_run_vs_copy"] is not None else "between"
    ratio = out["target_ratio"] = out["in_run_vs_copy"] if out["target_by"] == "in_run" \
        else out["overhead_vs_copy"]
    out["target_met"] = None if ratio is None else ratio <= TARGET
    return out


# --- the section --------------------------------------------------------------------

def model_text(framework: str, s: Dict[str, Any], cfg: Dict[str, Any]) -> str:
    width = cfg["width"] or DEFAULT_WIDTH[framework]
    what = (f"MLP, {s['layers']} × `Linear({width}, {width})`" if framework == "lightning"
            else f"GPT-2, {s['layers']} layer{'s' if s['layers'] > 1 else ''}, "
            f"`n_embd={width}`")
    return f"{what}; {benchlib.fg(s['state_bytes'])} GiB"


def batch_text(cfg: Dict[str, Any]) -> str:
    light = cfg["batch"] or DEFAULT_BATCH["lightning"]
    hf = cfg["batch"] or DEFAULT_BATCH["transformers"]
    return f"{light} (Lightning) and {hf} × {cfg['seq']} tokens (Trainer)"


def times(ratio: Optional[float]) -> str:
    return "–" if ratio is None else f"{ratio:.2f}×"


def report(data: Dict[str, Any]) -> str:
    cfg, summ = data["config"], data["summary"]
    n, first, last = cfg["every"], *window(cfg["every"], cfg["steps"])
    lines = [SECTION, "",
             f"`scripts/bench_frameworks.py`: one stock loop per framework, run three "
             f"ways, each in a fresh child process: no checkpoint, the framework's own "
             f"checkpoint every N={n} steps, a snapd snapshot every N steps "
             f"(`SnapdCallback(root, run, every=N)`; `snapd_client.transformers.Trainer`, "
             f"`snapd_options={{\"every\": N}}`, mode `{cfg['mode']}`). Lightning trains a wide MLP "
             "with AdamW, the Trainer a GPT-2 built from its config (no download) on "
             "generated tokens, each sized to the state given (weights + AdamW's two "
             f"moments); {cfg['steps']} steps, a batch of {batch_text(cfg)}, "
             f"`torch.set_num_threads({cfg['threads']})`, CPU. *Window*: from the start "
             f"of step {first} to the start of step {last}, {last - first} steps with "
             f"the checkpoints at steps {', '.join(str(s) for s in range(2 * n, last, n))} "
             "and what each costs the steps after it (the daemon's start and the first "
             "checkpoint, the first to touch its staging memory or files, are before "
             "it; the first snapshot's stall is shown apart). *Per checkpoint*, "
             "*between runs*: (the way's window - none's) / "
             "checkpoints in the window. *In its own run*: snapd's window against its "
             "own calm steps, those neither overlapping a snapshot's span from its call "
             "to its `committed` record nor starting within one step after it: (window "
             "- window steps × their mean) / snapshots in the window; the same step's "
             "time differs from one process to the next by more than a snapshot costs, "
             "so the target is judged by this figure where the window has calm steps. *Stall*: the `snapshot()` call as the client "
             "logs it. *Daemon CPU*: the daemon's user + system time over the window, "
             "per snapshot in it (on a machine with few cores, time the trainer may "
             "lose to it). *copy_*: the same state copied into preallocated memory in the "
             "snapd child after its fit, each copy after 50 ms of matmuls. Target: "
             f"snapd's overhead per snapshot ≤ {TARGET}× the copy_. "
             f"Medians over {cfg['rounds']} round(s), the ways' order alternating.", ""]
    lines += benchlib.machine_text(data["machine"])
    lines += ["| framework | model, state | step, none | window none / own / snapd | "
              "own / none | snapd / none | whole fit none / own / snapd | fit own / none "
              "| fit snapd / none |", "|---|---|---|---|---|---|---|---|---|"]
    for fw, s in summ.items():
        if "error" in s:
            lines.append(f"| {LABEL[fw]} | failed: {s['error'][-200:]!r} |")
            continue
        w, f = s["window_s"], s["fit_s"]
        lines.append(
            f"| {LABEL[fw]} | {model_text(fw, s, cfg)} | {fs(s['step_s'])} | "
            f"{fs(w['none'])} / {fs(w['own'])} / {fs(w['snapd'])} | "
            f"{fr(w['own'], w['none'])} | {fr(w['snapd'], w['none'])} | "
            f"{fs(f['none'])} / {fs(f['own'])} / {fs(f['snapd'])} | "
            f"{fr(f['own'], f['none'])} | {fr(f['snapd'], f['none'])} |")
    lines += ["", "| framework | own checkpoint | own, per checkpoint | snapd, per snapshot: "
              "between runs / in its own run | snapshot() stall (median in window) | "
              "first snapshot's stall | daemon CPU per snapshot | copy_ of the state | "
              f"snapd per snapshot / copy_: between / in run | ≤ {TARGET}× |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for fw, s in summ.items():
        if "error" in s:
            continue
        met = {True: "pass", False: "**fail**", None: "–"}[s["target_met"]]
        if s["target_met"] and s["target_ratio"] < 0:
            met = "pass (below 0: the run's noise)"   # shorter than the calm steps'
        lines.append(
            f"| {LABEL[fw]} | {OWN[fw]} | {fs(s['own_per_checkpoint_s'])} | "
            f"{fs(s['snapd_per_snapshot_s'])} / {fs(s['in_run_per_snapshot_s'])} | "
            f"{fs(s['stall_s'])} | "
            f"{fs(s['first_stall_s'])} | {fs(s['daemon_cpu_per_snapshot_s'])} | "
            f"{fs(s['copy_s'])} | {times(s['overhead_vs_copy'])} / "
            f"{times(s['in_run_vs_copy'])} | {met} |")
    lines.append("")
    for fw, s in summ.items():
        if "error" not in s:
            lines.append(f"- {LABEL[fw]}: snapshots at steps {s['snapshots']} "
                         f"({s['in_window']} in the window), the longest wait for a free "
                         f"staging slot {fs(s['waited_s'])}; own checkpoints at steps "
                         f"{s['saves']} ({s['saves_in_window']} in the window); the "
                         "trainer's CPU in the window, none / own / snapd: "
                         + " / ".join(fs(s["trainer_cpu_s"][w]) for w in WAYS))
    if "shm_left" in data:
        lines.append("- snapd files left in /dev/shm after the run (staging arenas, hot "
                     f"copies): {', '.join(data['shm_left']) or 'none'}")
    return "\n".join(lines) + "\n"


# --- the command line ---------------------------------------------------------------

def parse(argv: Optional[List[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="1G", help="state: weights + AdamW moments (1G)")
    ap.add_argument("--every", type=int, default=5, help="N: steps between checkpoints")
    ap.add_argument("--steps", type=int, default=41,
                    help="training steps (default 41; at least 2N+1)")
    ap.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    ap.add_argument("--rounds", type=int, default=3, help="each way this many times")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per child")
    ap.add_argument("--mode", default="wait", choices=("wait", "overlap"),
                    help="snapd's mode (docs/operations.md)")
    ap.add_argument("--width", type=int, default=None,
                    help="Lightning's MLP width / GPT-2's n_embd (default 2048 / 1024)")
    ap.add_argument("--batch", type=int, default=None,
                    help="batch size (default 8 / 2)")
    ap.add_argument("--seq", type=int, default=32, help="GPT-2 sequence length")
    ap.add_argument("--vocab", type=int, default=8192, help="GPT-2 vocabulary")
    ap.add_argument("--copy-reps", type=int, default=3)
    ap.add_argument("--tmp", default="/tmp", help="where the children's files go")
    ap.add_argument("--json", default=None, help="write every figure here")
    ap.add_argument("--doc", default=None,
                    help="replace this script's section of that markdown file")
    ap.add_argument("--no-probe", action="store_true",
                    help="skip the 1 s samples of other processes' CPU")
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.size = benchlib.parse_size(args.size)
    args.frameworks = args.frameworks.split(",")
    unknown = set(args.frameworks) - set(FRAMEWORKS)
    if unknown:
        ap.error(f"--frameworks: unknown {sorted(unknown)}; use some of "
                 f"{', '.join(FRAMEWORKS)}")
    try:
        window(args.every, args.steps)
    except ValueError as e:
        ap.error(str(e))
    return args


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    return benchlib.run_bench(argv, parse, run_all, report, SECTION)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child_main(*sys.argv[2:4])
    else:
        main()
