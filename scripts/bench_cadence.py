#!/usr/bin/env python
"""Automatic cadence: what ``snapshot(step)`` after every step costs with ``every="auto"``.

    python scripts/bench_cadence.py [--sizes 100M,1G] [--steps 1600] [--budgets 0.01,0.05]
                                    [--every 25,100,400] [--mtbf 600] [--rounds 1]
                                    [--quick]
                                    [--json PATH] [--doc docs/benchmarks.md]

One run, one training loop per configuration, all in this process, on the MLP + AdamW
state of scripts/benchlib.py (``--sizes``; ``torch.set_num_threads(--threads)``,
default 1: the daemon has the other core). A step is a fixed amount of work: as many
256×256 matmuls as took ``--step-ms`` (default 50) when calibrated at the start, so
that a daemon taking CPU from the loop makes its steps longer (a step that spins for
a fixed time would hide that). The configurations, each over ``--steps`` steps:

- *no snapshots*: the loop alone, run before each round and after the last; a
  configuration's overhead is against the mean of the two its round sits between,
  and how far those two differ (*drift*) is the noise floor of that figure;
- ``every="auto", overhead=B`` for each budget B (``--budgets``): ``snapshot(step)``
  after every step, the cadence deciding which calls take one (snapd_client/
  cadence.py; docs/operations.md, "Snapshot cadence");
- ``every=N`` for each N of ``--every``: a snapshot when ``step % N == 0``.

``--rounds R`` runs every configuration R times, the order reversed in every other
round, so that the machine's drift falls on each alike; each figure is then the
median over the rounds, and each budget's ``auto`` is set against the best fixed N
both by those medians and round by round (how many rounds it held in).

Per size, one untimed snapshot by a throwaway client comes first (the VM's first
touch of new memory is paid there, not by the first configuration). Each snapd
configuration gets a fresh root in a temporary directory, its own daemon
(stopped at the end by scripts/benchlib.py's ``stop_daemon``) and ``keep_last=2`` (the
disk holds two snapshots, not one per interval). Before its timed loop, track(), one
step and the snapshot of step 0 (daemon, arena; every configuration takes it,
``auto`` once its staging memory is faulted in) are waited on and the daemon let
settle; they are not timed. After the loop the
snapshots still in flight are waited on, untimed.

The failure rate ``--mtbf`` (M, default 600 s) is handed to the cadence: at the
client's default M (24 h) the cadence's interval on these states is minutes, longer
than a loop this script can afford; its interval grows as √M under the Young/Daly
rule. ``--mtbf default`` leaves M to the client.

Figures, per size and configuration: loop time; *overhead* = loop time / loop time
without snapshots (its neighbours' mean) − 1; *in loop*, the same against the loop's
own undisturbed steps (none of a snapshot's call-to-durable window in them, nor the
two steps after it): this VM's speed drifts by several percent over minutes, more
than most overheads measured here, and a baseline taken in the same seconds cancels
that drift; snapshots taken in the timed loop; for
``auto``, the interval and the rule (``bound``) its newest ``cadence`` log record of
the timed loop names (none: it took no snapshot after step 0); the median time to
durable D of the loop's snapshots (snapshot() called to the handle settling); the
*expected lost work per failure*, interval / 2 + D, with interval = interval in steps
× the loop's median step (``auto``: the cadence's final interval in steps). Each
budget's ``auto`` is set against the best fixed N whose overhead in its loop is no
higher than auto's in its loop (the one losing least per failure), and beside CheckFreq's published bound of 3.5 %
overhead (Mohan et al., FAST '21). The script prints a markdown section, writes every
raw figure with ``--json`` and replaces its section of a markdown file with ``--doc``.
``--quick``: a smoke run (50M, 120 steps, N of 10 and 40, M = 30 s).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import benchlib  # noqa: E402  (the bench scripts' shared pieces)
from benchlib import median  # noqa: E402

SECTION = "## Automatic cadence (scripts/bench_cadence.py)"
RUN = "cadence"
CHECKFREQ_BOUND = 0.035   # CheckFreq (Mohan et al., FAST '21): its published overhead
FULL = {"sizes": "100M,1G", "steps": 1600, "every": "25,100,400", "mtbf": "600"}
QUICK = {"sizes": "50M", "steps": 120, "every": "10,40", "mtbf": "30"}
MATMUL = 256


# --- the training step --------------------------------------------------------------

_MM: Dict[str, Any] = {}


def matmuls(n: int) -> None:
    """``n`` matmuls: one step's fixed work."""
    import torch
    if not _MM:
        _MM.update(a=torch.randn(MATMUL, MATMUL), b=torch.randn(MATMUL, MATMUL),
                   c=torch.empty(MATMUL, MATMUL))
    for _ in range(n):
        torch.mm(_MM["a"], _MM["b"], out=_MM["c"])


def calibrate(step_s: float, probe_s: float = 1.0) -> int:
    """How many matmuls take ``step_s`` here, now (counted over ``probe_s``)."""
    matmuls(20)   # threads and caches warm
    count, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < probe_s:
        matmuls(10)
        count += 10
    return max(1, round(count * step_s / (time.perf_counter() - t0)))


def run_loop(work: int, steps: int, after_step: Optional[Callable[[int], None]] = None
             ) -> Dict[str, Any]:
    """Steps 1..``steps``, each ``work`` matmuls then ``after_step(step)``: loop time,
    median step."""
    marks = [time.perf_counter()]
    for step in range(1, steps + 1):
        matmuls(work)
        if after_step is not None:
            after_step(step)
        marks.append(time.perf_counter())
    durations = [b - a for a, b in zip(marks, marks[1:])]
    return {"loop_s": marks[-1] - marks[0], "step_s": median(durations),
            "max_step_s": max(durations), "marks": marks}


# --- snapshots ----------------------------------------------------------------------

class Snapshots:
    """``snapshot(step)`` after each step, and what each taken one cost: the call, the
    wait for a free staging slot in it, the time to durable (stamped when its handle
    settles, on the client's thread that learns it)."""

    def __init__(self, client) -> None:
        self.client, self.taken, self.handles = client, [], []
        self.skip_call_s: List[float] = []

    def __call__(self, step: int) -> None:
        t0 = time.perf_counter()
        handle = self.client.snapshot(step)
        call = time.perf_counter() - t0
        if not handle.taken:
            self.skip_call_s.append(call)
            return
        record = {"step": step, "call_s": call, "waited_s": handle.stall_seconds,
                  "called_at": t0}
        self.taken.append(record)
        self.handles.append(handle)
        # setdefault: a retried snapshot runs its callbacks again; the first settles it
        handle.add_done_callback(
            lambda h: record.setdefault("durable_s", time.perf_counter() - t0))

    def wait_all(self) -> None:
        for handle in self.handles:
            handle.wait()


def client_options(every: Any, budget: Optional[float], mtbf: Optional[float]
                   ) -> Dict[str, Any]:
    opts: Dict[str, Any] = {"every": every, "keep_last": 2}
    if every == "auto":
        opts["overhead"] = budget
        if mtbf is not None:
            opts["mtbf"] = mtbf
    return opts


def snapd_loop(args, state, work: int, every: Any, budget: Optional[float] = None
               ) -> Dict[str, Any]:
    """One configuration: a fresh root and daemon, the untimed snapshot of step 0, the
    timed loop, its snapshots waited on, the run's cadence records read back."""
    from snapd_client import Client
    model, opt = state
    root = tempfile.mkdtemp(prefix="sd-cad-", dir=args.tmp)
    res: Dict[str, Any] = {"every": every, "budget": budget}
    try:
        with Client(root, RUN, **client_options(every, budget, args.mtbf)) as client:
            client.track(model=model, optimizer=opt)
            matmuls(work)
            t0 = time.perf_counter()
            first_snapshot(client).wait()   # daemon, arena: every configuration's
            res["first_durable_s"] = time.perf_counter() - t0
            res["settle_s"] = benchlib.wait_idle(benchlib.daemon_pid_of(root))
            snaps = Snapshots(client)
            res.update(run_loop(work, args.steps, snaps))
            snaps.wait_all()
        marks = res.pop("marks")
        res["in_loop"] = in_loop_overhead(marks, busy_windows(snaps.taken, marks[-1]),
                                          guard_s=2 * res["step_s"])
        res["taken"] = snaps.taken
        res["skip_call_s"] = median(snaps.skip_call_s)
        res["cadence"] = cadence_records(client.store.path)
    finally:
        res["daemon_stopped"] = benchlib.stop_daemon(root)
        shutil.rmtree(root, ignore_errors=True)
    return res


def first_snapshot(client, limit_s: float = 300.0):
    """The snapshot of step 0, taken. ``every="auto"`` takes its first only once the
    staging memory track() made is faulted in (snapd_client/cadence.py), so the call
    is repeated until it does (the step does not move: no training is timed)."""
    deadline = time.monotonic() + limit_s
    while True:
        handle = client.snapshot(0)
        if handle.taken:
            return handle
        if time.monotonic() > deadline:
            raise RuntimeError(f"snapshot(0) took no snapshot in {limit_s:g} s: the "
                               "staging memory never became ready")
        time.sleep(0.02)


def warm_up(args, state) -> float:
    """One snapshot by a throwaway client and daemon, untimed: the VM's first touch of
    new memory (arena, hot copy) is paid here, not by whichever configuration runs
    first. Its time to durable."""
    from snapd_client import Client
    model, opt = state
    root = tempfile.mkdtemp(prefix="sd-cad-", dir=args.tmp)
    try:
        with Client(root, RUN) as client:
            client.track(model=model, optimizer=opt)
            t0 = time.perf_counter()
            client.snapshot(0).wait()
            return time.perf_counter() - t0
    finally:
        benchlib.stop_daemon(root)
        shutil.rmtree(root, ignore_errors=True)


def cadence_records(run_dir: str) -> List[Dict[str, Any]]:
    """The run's ``cadence`` log records (one per snapshot the cadence took), oldest
    first: read as ``snapd status`` reads them, from the log."""
    from snapd.statelog import read_records
    return [r for r in read_records(run_dir, 0) if r.get("kind") == "cadence"]


# --- figures (pure) -----------------------------------------------------------------

def overhead(loop_s: float, base_s: float) -> float:
    """Loop time against the loop without snapshots, minus one: 0.02 is 2 % slower."""
    return loop_s / base_s - 1


def busy_windows(taken: List[Dict[str, Any]], loop_end: float) -> List[tuple]:
    """(from, to) of each taken snapshot: snapshot() called to durable (the loop's end
    for one not durable by then)."""
    return [(t["called_at"], t["called_at"] + t["durable_s"] if "durable_s" in t
             else loop_end) for t in taken]


def in_loop_overhead(marks: List[float], windows: List[tuple], guard_s: float
                     ) -> Dict[str, Any]:
    """Overhead against the loop's own undisturbed steps: loop time / (steps × the
    mean step that neither overlaps a snapshot's call-to-durable window nor starts
    within ``guard_s`` after one) − 1. The baseline runs in the same seconds as the
    loop, so the VM's drift over minutes, which moves a loop without snapshots run
    before or after by several percent, cancels; *drift* here is how far the mean
    undisturbed step of the loop's first half differs from its second half's."""
    steps = list(zip(marks, marks[1:]))
    calm = benchlib.calm_steps(steps, windows, guard_s)
    if len(calm) < 2:
        return {"overhead": None, "drift": None, "calm_steps": len(calm)}
    mean = sum(calm) / len(calm)
    half = len(calm) // 2
    first, second = sum(calm[:half]) / half, sum(calm[half:]) / (len(calm) - half)
    return {"overhead": (marks[-1] - marks[0]) / (len(steps) * mean) - 1,
            "drift": abs(second - first) / mean, "calm_steps": len(calm)}


def expected_loss(interval_s: Optional[float], durable_s: Optional[float]
                  ) -> Optional[float]:
    """Training lost per failure on average: half an interval, plus the time the
    newest snapshot takes to become durable (a failure in it loses the one before)."""
    if interval_s is None or durable_s is None:
        return None
    return interval_s / 2 + durable_s


def taken_intervals(taken: List[Dict[str, Any]]) -> List[int]:
    """The intervals, in steps, the loop's snapshots were taken at: from step 0's
    (durable before the loop) to the first, and between each two after."""
    steps = [0] + [t["step"] for t in taken]
    return [b - a for a, b in zip(steps, steps[1:])]


def measured_loss(intervals: List[int], step_s: float, durable_s: Optional[float]
                  ) -> Optional[float]:
    """Training lost per failure on average over the intervals the loop took. A
    failure at a random instant falls in an interval of I steps with a chance of I / ΣI
    and loses I / 2 of it on average: Σ I² / (2 ΣI) steps, plus D. For equal
    intervals (every=N) that is N / 2 + D, as :func:`expected_loss` has it; uneven
    ones lose more than their mean's half, since the long ones hold more of the
    failures. The time after the last snapshot is left out: where the loop stops is
    not the cadence's choice."""
    if not intervals or durable_s is None:
        return None
    return sum(i * i for i in intervals) / (2 * sum(intervals)) * step_s + durable_s


def summarize(res: Dict[str, Any], bases: List[Dict[str, Any]]) -> Dict[str, Any]:
    """One configuration's figures: overhead against the mean of the loops without
    snapshots run just before and just after it (and how far those two differ: the
    drift the overhead cannot tell from its own cost), snapshots taken, the interval
    (steps and seconds at the loop's median step), its rule, D and the expected loss:
    over the intervals taken, and (``final_loss_s``) at the final interval alone."""
    taken = res["taken"]
    durable = median([t["durable_s"] for t in taken if "durable_s" in t])
    before, after = (bases[res["base_index"]]["loop_s"],
                     bases[res["base_index"] + 1]["loop_s"])
    base_s = (before + after) / 2
    in_loop = res["in_loop"]
    out: Dict[str, Any] = {"overhead": overhead(res["loop_s"], base_s),
                           "noise": abs(after - before) / base_s,
                           "in_loop": in_loop["overhead"], "in_loop_drift": in_loop["drift"],
                           "calm_steps": in_loop["calm_steps"],
                           "loop_s": res["loop_s"], "step_s": res["step_s"],
                           "taken": len(taken), "durable_s": durable,
                           "call_s": median([t["call_s"] for t in taken]),
                           "skip_call_s": res.get("skip_call_s"),
                           "waited_s": max([t["waited_s"] for t in taken], default=None)}
    if res["every"] == "auto":
        # The decision of the newest snapshot of the timed loop; step 0's is "first"
        # (nothing measured yet) and says nothing of the cadence.
        in_loop = [r for r in res["cadence"] if r["step"] > 0]
        last = in_loop[-1] if in_loop else {}
        steps = last.get("interval_steps")
        first = res["cadence"][0] if res["cadence"] else {}
        out.update(bound=last.get("bound"), cadence_interval_s=last.get("interval_s"),
                   delta_s=last.get("delta_s"),
                   cadence_expected_loss_s=last.get("expected_loss_s"),
                   mtbf_s=first.get("mtbf_s"), mtbf_from=first.get("mtbf_from"),
                   first_stall_s=first.get("stall_s"), records=len(res["cadence"]))
    else:
        steps = res["every"]
    out["interval_steps"] = steps
    out["interval_s"] = None if steps is None else steps * res["step_s"]
    out["final_loss_s"] = expected_loss(out["interval_s"], durable)
    intervals = taken_intervals(taken)
    out["mean_interval_steps"] = sum(intervals) / len(intervals) if intervals else None
    out["expected_loss_s"] = measured_loss(intervals, res["step_s"], durable)
    return out


def best_fixed(fixed: Dict[str, Dict[str, Any]], limit: Optional[float]
               ) -> Optional[str]:
    """Of the fixed ``every=N`` figures, the N whose overhead measured in its loop is
    no higher than ``limit`` and that loses least per failure; None when none is
    that cheap (or nothing is measured)."""
    if limit is None:
        return None
    cheap = [(f["expected_loss_s"], n) for n, f in fixed.items()
             if f["in_loop"] is not None and f["in_loop"] <= limit
             and f["expected_loss_s"] is not None]
    return min(cheap)[1] if cheap else None


def round_figures(done: Dict[str, Any], bases: List[Dict[str, Any]]
                  ) -> Dict[str, Any]:
    """One round's configurations summarized against their loops without snapshots,
    and each budget's ``auto`` against its best fixed N in that round."""
    auto = {k: summarize(r, bases) for k, r in done["auto"].items() if "error" not in r}
    fixed = {k: summarize(r, bases) for k, r in done["fixed"].items()
             if "error" not in r}
    return {"auto": auto, "fixed": fixed, "versus": versus(auto, fixed)}


def versus(auto: Dict[str, Dict[str, Any]], fixed: Dict[str, Dict[str, Any]]
           ) -> Dict[str, Dict[str, Any]]:
    """Each budget's best fixed N at no more overhead in its loop, and auto's expected
    loss against that N's."""
    out = {}
    for budget, a in auto.items():
        n = best_fixed(fixed, a["in_loop"])
        out[budget] = {"best_fixed": n, "loss_ratio": None if n is None or not
                       fixed[n]["expected_loss_s"] or a["expected_loss_s"] is None
                       else a["expected_loss_s"] / fixed[n]["expected_loss_s"]}
    return out


def held_in(v: Dict[str, Any]) -> bool:
    """Auto lost no more per failure than the best fixed N at no more overhead (or no
    fixed N was that cheap)."""
    ratio = v["loss_ratio"]
    return v["best_fixed"] is None or (ratio is not None and ratio <= 1)


def median_figures(figs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """One configuration over its rounds: the median of each number (those measured),
    the commonest value of anything else (the cadence's bound, where M came from)."""
    out: Dict[str, Any] = {"rounds": len(figs)}
    for key in figs[0]:
        values = [f[key] for f in figs if f.get(key) is not None]
        if values and all(isinstance(v, (int, float)) for v in values):
            out[key] = median(values)
        else:
            out[key] = max(values, key=values.count) if values else None
    return out


def size_figures(per: Dict[str, Any]) -> Dict[str, Any]:
    """Every round's figures; each configuration's medians over the rounds it did not
    fail in, and each budget's ``auto`` against its best fixed N by those medians;
    how many rounds ``auto`` lost no more than that round's best fixed N; the loops
    without snapshots: their mean and spread."""
    bases = [b["loop_s"] for b in per["base"]]
    rounds = [round_figures(done, per["base"]) for done in per["rounds"]]
    merged: Dict[str, Dict[str, Any]] = {"auto": {}, "fixed": {}}
    for group in merged:
        for key in dict.fromkeys(k for r in rounds for k in r[group]):
            merged[group][key] = median_figures(
                [r[group][key] for r in rounds if key in r[group]])
    held = {b: sum(1 for r in rounds if b in r["versus"] and held_in(r["versus"][b]))
            for b in merged["auto"]}
    return {"base_s": sum(bases) / len(bases),
            "noise": (max(bases) - min(bases)) / (sum(bases) / len(bases)),
            "base_step_s": median([b["step_s"] for b in per["base"]]),
            "auto": merged["auto"], "fixed": merged["fixed"],
            "versus": versus(merged["auto"], merged["fixed"]),
            "rounds": rounds, "held_in_rounds": held}


# --- the section --------------------------------------------------------------------

def pct(x: Optional[float]) -> str:
    return "–" if x is None else f"{x * 100:+.1f}%"


def seconds(x: Optional[float]) -> str:
    return "–" if x is None else f"{x:.0f} s"


def report(data: Dict[str, Any]) -> str:
    cfg = data["config"]
    lines = [SECTION, ""] + benchlib.machine_text(data["machine"]) + describe(cfg) + [""]
    for label, fig in data["figures"].items():
        per = data["results"][label]
        lines += [f"### {label} (state {per['state_bytes'] / benchlib.GiB:.2f} GiB, "
                  f"step {benchlib.fs(fig['base_step_s'])} without snapshots)", ""]
        lines += config_table(fig, per, cfg["steps"]) + [""] + \
            versus_lines(fig, cfg["steps"]) + [""]
    return "\n".join(lines) + "\n"


def describe(cfg: Dict[str, Any]) -> List[str]:
    mtbf = ("the client's default M" if cfg["mtbf"] is None
            else f"M = {cfg['mtbf']:.0f} s (`mtbf=`)")
    return [
        f"A training loop of {cfg['steps']} steps, each a fixed {cfg['step_ms']:.0f} ms "
        f"(calibrated) of {MATMUL}×{MATMUL} matmuls on `torch.set_num_threads("
        f"{cfg['threads']})`, calls `snapshot(step)` after every step; the state is "
        "scripts/benchlib.py's MLP + AdamW. Per size, one untimed snapshot by a "
        "throwaway client first (this VM's first touch of new memory). "
        f"Configurations, in {cfg.get('rounds', 1)} round(s), the order reversed in "
        "every other round: no snapshots (before each round and after the last), "
        f"`every=\"auto\"` with {mtbf} and "
        "the overhead budget shown, and fixed `every=N`; each snapd one on a fresh root "
        "and daemon, `keep_last=2`, its snapshot of step 0 (daemon, arena; `auto`'s "
        "once its staging memory is faulted in) taken and "
        "waited on before the timed loop. *Overhead*: loop time / loop time without "
        "snapshots − 1, against the mean of the two loops without snapshots run just "
        "before and just after its round (this VM's speed drifts over minutes); "
        "*drift*: how far those two differ, the noise floor of that overhead. "
        "*In loop*: the same loop against its own undisturbed steps (those neither "
        "overlapping a snapshot's "
        "call-to-durable window nor starting within two steps after one): loop time / "
        "(steps × their mean) − 1, a baseline measured in the same seconds, so the "
        "drift over minutes cancels; its *drift* is how far the mean undisturbed step "
        "of the loop's first half differs from its second half's. `auto` is set against "
        "fixed N by this figure. *Taken*: snapshots in "
        "the timed loop. *Interval*: in steps (for `auto`, the cadence's final one, "
        "from its newest `cadence` log record of the timed loop) and in "
        "seconds at the loop's median step. *D*: median time from snapshot() to "
        "durable. *Expected loss*: lost training per failure at a random instant, "
        "over the intervals the loop's snapshots were taken at (step 0 to the first, "
        "then each to the next): Σ I² / (2 ΣI) + D, which is N / 2 + D for `every=N`; "
        "`auto` is set against fixed N by this figure (its final interval alone, "
        "interval / 2 + D, is given beside it). *snapshot() when not*: the median "
        "call that took none, right after a step's matmuls (a cost in every step, "
        "so the in-loop figure, whose baseline steps hold it too, leaves it out, and "
        "the overhead against loops without snapshots holds it). "
        "Each figure is the median over the rounds (the commonest bound), and `auto` "
        "is set against fixed N both by those medians and round by round. "
        "All figures are from one run."]


def config_table(fig: Dict[str, Any], per: Dict[str, Any], steps: int) -> List[str]:
    rows = ["| snapshots | loop | overhead | drift | in loop | drift in loop | taken | "
            "interval | bound | D | expected loss per failure | snapshot() when taken | "
            "when not |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
            f"| none ({len(per['base'])} loops) | {benchlib.fs(fig['base_s'])} (mean) | | "
            f"{fig['noise'] * 100:.1f}% (max − min) | | | | | | | | | |"]
    named = [(config_name("auto", b), f) for b, f in fig["auto"].items()]
    named += [(config_name("fixed", n), f) for n, f in fig["fixed"].items()]
    for name, f in named:
        rows.append(f"| {name} | {benchlib.fs(f['loop_s'])} | {pct(f['overhead'])} | "
                    f"{f['noise'] * 100:.1f}% | {pct(f['in_loop'])} | "
                    f"{pct(f['in_loop_drift']).lstrip('+')} | {f['taken']:g} | "
                    f"{interval_text(f, steps)} | "
                    f"{f.get('bound', 'fixed') or '–'} | {benchlib.fs(f['durable_s'])} | "
                    f"{benchlib.fs(f['expected_loss_s'])} | {benchlib.fs(f['call_s'])} | "
                    f"{microseconds(f.get('skip_call_s'))} |")
    failed = [f"| {config_name(group, k)} | error in round {i + 1}: {r['error']} "
              "| | | | | | | | | | | |" for i, done in enumerate(per["rounds"])
              for group in ("auto", "fixed") for k, r in done[group].items()
              if "error" in r]
    return rows + failed


def microseconds(x: Optional[float]) -> str:
    return "–" if x is None else f"{x * 1e6:.0f} µs"


def config_name(group: str, key: str) -> str:
    return f"`auto`, overhead={key}" if group == "auto" else f"`every={key}`"


def interval_text(f: Dict[str, Any], steps: int) -> str:
    if f["interval_steps"] is None:   # ``auto`` took none after step 0
        return f"none taken in {steps} steps"
    return f"{f['interval_steps']:g} steps, {benchlib.fs(f['interval_s'])}"


def mean_interval_text(f: Dict[str, Any]) -> str:
    mean = f.get("mean_interval_steps")
    return "no interval taken" if mean is None else f"intervals taken {mean:.0f} steps " \
        "on average"


def versus_lines(fig: Dict[str, Any], steps: int) -> List[str]:
    out = []
    for budget, a in fig["auto"].items():
        v = fig["versus"][budget]
        chose = (f"interval {interval_text(a, steps)} set by `{a['bound']}`" if a["bound"]
                 else f"no snapshot after step 0 in {steps} steps")
        chose += (f", step 0's stall {benchlib.fs(a['first_stall_s'])} against "
                  f"{benchlib.fs(a['call_s'])} in the loop, cost per snapshot weighed "
                  f"(stall and slowdown) {benchlib.fs(a.get('delta_s'))}")
        head = (f"- `auto` at overhead={budget}: measured {pct(a['in_loop'])} in its loop, "
                f"{pct(a['overhead'])} against the loops without snapshots (budget "
                f"{float(budget) * 100:.0f}%; CheckFreq's published bound, FAST '21: "
                f"{CHECKFREQ_BOUND * 100:.1f}%), {chose} (M {seconds(a.get('mtbf_s'))} "
                f"from {a.get('mtbf_from')}), {mean_interval_text(a)}, expected loss "
                f"{benchlib.fs(a['expected_loss_s'])} (at its final interval alone "
                f"{benchlib.fs(a.get('final_loss_s'))})")
        n = v["best_fixed"]
        if n is None:
            line = head + "; no fixed N measured an overhead that low in its loop."
        else:
            f = fig["fixed"][n]
            ratio = "" if v["loss_ratio"] is None else \
                f"; auto's is {v['loss_ratio']:.2f}× that"
            line = (head + f"; the best fixed N at no more overhead is `every={n}` "
                    f"({pct(f['in_loop'])} in its loop), expected loss "
                    f"{benchlib.fs(f['expected_loss_s'])}{ratio}.")
        out.append(line + rounds_text(fig, budget))
    return out


def rounds_text(fig: Dict[str, Any], budget: str) -> str:
    """Round by round: how often auto lost no more than that round's best fixed N, and
    against which N, by how much."""
    rounds = fig.get("rounds", [])
    if len(rounds) < 2:
        return ""
    each = []
    for r in rounds:
        v = r["versus"].get(budget)
        if v is None:
            each.append("failed")
        elif v["best_fixed"] is None:
            each.append(f"{pct(r['auto'][budget]['in_loop'])}, no fixed N as cheap")
        else:
            ratio = "–" if v["loss_ratio"] is None else f"{v['loss_ratio']:.2f}×"
            each.append(f"{pct(r['auto'][budget]['in_loop'])}, {ratio} "
                        f"`every={v['best_fixed']}`")
    return (f" Round by round, auto lost no more than that round's best fixed N at no "
            f"more overhead in {fig['held_in_rounds'][budget]} of {len(rounds)} "
            f"({'; '.join(each)}).")


# --- driver -------------------------------------------------------------------------

def one_size(args, label: str) -> Dict[str, Any]:
    """Build the state, calibrate the step, warm up, then ``--rounds`` rounds of every
    budget and every fixed N, the order reversed in every other round (a configuration
    run late in one round runs early in the next), with a loop without snapshots before
    each round and after the last (this VM's speed drifts by several percent over
    minutes: each configuration is set against its round's two)."""
    model, opt = benchlib.build_state(benchlib.parse_size(label), args.threads)
    per: Dict[str, Any] = {"state_bytes": benchlib.nbytes_of(
        benchlib.state_tensors(model, opt))}
    work = per["matmuls_per_step"] = calibrate(args.step_ms / 1e3)
    per["warm_up_durable_s"] = warm_up(args, (model, opt))
    per["base"] = [run_loop(work, args.steps)]
    per["rounds"] = []
    configs = [("auto", b) for b in args.budgets] + [(n, None) for n in args.every]
    for r in range(args.rounds):
        done: Dict[str, Dict[str, Any]] = {"auto": {}, "fixed": {}}
        for every, budget in benchlib.round_order(configs, r):
            res = guarded(args, (model, opt), work, every, budget)
            res["base_index"] = len(per["base"]) - 1   # the round's first loop alone
            done["auto" if every == "auto" else "fixed"][str(budget or every)] = res
        per["rounds"].append(done)
        per["base"].append(run_loop(work, args.steps))
    return per


def guarded(args, state, work: int, every: Any, budget: Optional[float] = None
            ) -> Dict[str, Any]:
    """One configuration; its failure is reported and the others still run."""
    t0 = time.perf_counter()
    try:
        res = snapd_loop(args, state, work, every, budget)
    except Exception as e:
        res = {"every": every, "budget": budget, "error": f"{type(e).__name__}: {e}"}
    name = f"auto {budget}" if every == "auto" else f"every={every}"
    print(f"  {name:12s} {'error' if 'error' in res else 'ok'} in "
          f"{time.perf_counter() - t0:5.1f} s", file=sys.stderr, flush=True)
    return res


def run_all(args) -> Dict[str, Any]:
    info = benchlib.start_run(probe=not args.no_probe)
    results = {}
    for label in args.sizes:
        print(f"{label}:", file=sys.stderr, flush=True)
        results[label] = one_size(args, label)
    benchlib.end_run(info, "bench_cadence.py", args.argv, probe=not args.no_probe)
    cfg = {"steps": args.steps, "rounds": args.rounds, "step_ms": args.step_ms,
           "threads": args.threads,
           "budgets": args.budgets, "every": args.every, "mtbf": args.mtbf}
    return {"machine": info, "config": cfg, "results": results,
            "figures": {k: size_figures(r) for k, r in results.items()}}


def parse(argv: Optional[List[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", help=f"states (default {FULL['sizes']})")
    ap.add_argument("--steps", type=int, help=f"steps per loop (default {FULL['steps']})")
    ap.add_argument("--step-ms", type=float, default=50.0,
                    help="one step's matmuls, calibrated (default 50)")
    ap.add_argument("--budgets", default="0.01,0.05", help="overhead budgets of auto")
    ap.add_argument("--every", help=f"fixed intervals N (default {FULL['every']})")
    ap.add_argument("--mtbf", help=f"seconds between failures handed to the cadence, or "
                    f"'default' for the client's (default {FULL['mtbf']})")
    ap.add_argument("--quick", action="store_true", help="a smoke run: " + ", ".join(
        f"--{k} {v}" for k, v in QUICK.items()) + " unless given")
    ap.add_argument("--rounds", type=int, default=1,
                    help="every configuration this many times, the order reversed in "
                    "every other round; figures are medians (default 1)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tmp", default=tempfile.gettempdir(),
                    help="where the roots go (default the temp dir)")
    ap.add_argument("--json", default=None, help="write every figure here")
    ap.add_argument("--doc", default=None,
                    help="replace this script's section of that markdown file")
    ap.add_argument("--no-probe", action="store_true",
                    help="skip the 1 s samples of other processes' CPU")
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    try:
        args.sizes = args.sizes.split(",")
        args.budgets = [float(b) for b in args.budgets.split(",")]
        args.every = [int(n) for n in args.every.split(",")]
        args.mtbf = None if args.mtbf == "default" else float(args.mtbf)
    except ValueError as e:
        ap.error(f"--budgets, --every, --mtbf: numbers, comma-separated ({e})")
    if args.steps < 1 or args.rounds < 1 or min(args.every) < 1 or \
            not all(0 < b < 1 for b in args.budgets):
        ap.error("--steps, --rounds and every N: at least 1; --budgets: fractions "
                 "between 0 and 1")
    return args


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    return benchlib.run_bench(argv, parse, run_all, report, SECTION)


if __name__ == "__main__":
    main()
