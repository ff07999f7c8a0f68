"""``snapd repro ROOT RUN@STEP -- <the training command>``: recompute one logged step
of a run, read-only, proved against the run's log, and keep the state after it.

The command runs unchanged, with ``SNAPD_REPRO`` in its environment; its Client does
the work (snapd_client/repro.py: restore the newest snapshot at or before STEP,
recompute, check each step against the log, write the state after STEP as a snapshot
of run ``RUN.repro-STEP``, end the process). This side picks the step (``RUN@anomaly``:
the newest anomaly the run logged), refuses what cannot work before anything runs,
and prints the outcome: the start snapshot, the steps recomputed and checked, the
batches STEP consumed (from the run's log) and where the state now is.

Many ranks: COMMAND is the job's ``torchrun`` line, at the run's world size; each rank
reports its own outcome (``outcome.json.rank-R``), and the report names each rank's
batches. A failure on any rank is every rank's (they agree before writing).

Exit 0 when the state was written; 1 on a divergence (``ReplayDivergence``, naming the
step and the field), or when the command ended without reaching STEP.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from typing import Any, Dict, List, Optional, Tuple

import click

from snapd import statelog
from snapd.commands.batch import consumed
from snapd.commands.common import fail, resolve_root
from snapd.commands.target import resolve_step
from snapd.store import RunStore

VARIABLE = "SNAPD_REPRO"   # read by snapd_client/repro.py


def out_run(run: str, step: int, before: bool) -> str:
    """The run a reproduction writes to: ``RUN.repro-STEP`` (``-before`` with --before)."""
    return f"{run}.repro-{step}" + ("-before" if before else "")


def check_target(root: str, run: str, step: int, before: bool, steps: int = 1) -> None:
    """Exit before running anything when STEP cannot be reproduced: the log has no
    record of it (or of the last of ``steps``), or the reproduction's run is there
    already."""
    path = os.path.join(root, run)
    if steps < 1:
        fail(f"--steps {steps}: the number of steps to write from STEP, 1 or more", 2)
    last = step + steps - 1 - (1 if before else 0)
    for wanted in sorted({step, last}):
        if statelog.find_step(path, 0, wanted) is None:
            fail(f"{path}/log: the run's log holds no record of step {wanted}, so a "
                 "recompute could not be checked; choose a logged step (snapd batch RUN "
                 "STEP tells)", 1)
    if before and step < 1:
        fail(f"{run}@{step} --before: step {step} has no state before it (steps count "
             "updates from 1)", 2)
    out = RunStore(root, out_run(run, step, before))
    if os.path.isdir(out.path):
        fail(f"{out.path}: a reproduction of step {step} is there already; remove that "
             "run's directory to write it again", 1)


def run_command(command: Tuple[str, ...], asked: Dict[str, Any]
                ) -> Tuple[int, List[Dict[str, Any]]]:
    """Run ``command`` with the reproduction asked in its environment; (its exit code,
    the outcome each rank's client reported, in rank order: none when it reached no
    client)."""
    scratch = tempfile.mkdtemp(prefix="snapd-repro-")   # outside the root: writes nothing there
    report = os.path.join(scratch, "outcome.json")
    env = dict(os.environ, **{VARIABLE: json.dumps({**asked, "report": report})})
    try:
        code = subprocess.run(list(command), env=env).returncode
        # One rank: outcome.json; many (under torchrun): outcome.json.rank-R each.
        names = [n for n in os.listdir(scratch) if n == "outcome.json"
                 or n.startswith("outcome.json.rank-") and not n.endswith(".tmp")]
        outcomes = []
        for name in sorted(names, key=lambda n: int(n.rpartition("-")[2]) if "rank-" in n
                           else 0):
            with open(os.path.join(scratch, name)) as f:
                outcomes.append(json.load(f))
        return code, outcomes
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def verdict(outcomes: List[Dict[str, Any]], run: str, step: int) -> Dict[str, Any]:
    """The one outcome the report is made of: a failure of any rank (the ranks agreed
    on it, so the first is every rank's), else rank 0's with each rank's counts, once
    every rank of the world reported."""
    failed = [o for o in outcomes if not o["ok"]]
    if failed:
        fail(f"{failed[0].get('type', 'ReplayDivergence')}: {failed[0]['error']}", 1)
    world = outcomes[0].get("world_size", 1)
    ranks = sorted(o.get("rank", 0) for o in outcomes)
    if ranks != list(range(world)):
        fail(f"repro of {run}@{step}: {world} ranks ran, but only rank(s) "
             f"{', '.join(map(str, ranks))} reported the state written: the command "
             "ended on the others first", 1)
    return {**outcomes[0], "ranks": outcomes}


def consumed_text(batches: Dict[str, Any]) -> str:
    """One rank's batches of a step, from its log (snapd/commands/batch.py)."""
    where = [f"epoch {e} batch {i}" for e, i in batches.get("batches", [])]
    return (", ".join(where) or "no batch logged") + \
        (f"; samples {batches['samples']}" if batches.get("samples") is not None else "")


def report_lines(outcome: Dict[str, Any], step: int, batches: List[Dict[str, Any]],
                 anomaly: Optional[Dict[str, Any]]) -> List[str]:
    """The report: ``outcome`` as :func:`verdict` makes it, ``batches`` each rank's
    of STEP, in rank order."""
    run, before = outcome["run"], outcome["step"] < step
    start = outcome.get("start")
    world = len(outcome.get("ranks", [outcome]))
    lines = [f"repro of {run}@{step}" + (" --before" if before else "")
             + (f" on {world} ranks" if world > 1 else "")
             + (f" (the anomaly: {anomaly.get('cause')}, value {anomaly.get('value')!r})"
                if anomaly else "")]
    lines.append("  started from: " + (f"snapshot {start['snapshot']} (step {start['step']})"
                                       if start else "the start (no snapshot at or before "
                                       "it)"))
    ranks = outcome.get("ranks", [outcome])
    if len(ranks) == 1:
        lines.append(f"  recomputed: {outcome['recomputed']} steps, {outcome['checked']} "
                     "checked against the log, all matched"
                     + (f" ({outcome['missing']} without a valid record to check)"
                        if outcome.get("missing") else ""))
        lines.append(f"  step {step} consumed: " + consumed_text(batches[0]))
    else:
        missing = sum(o.get("missing", 0) for o in ranks)
        lines.append(f"  recomputed: {outcome['recomputed']} steps on each of {len(ranks)} "
                     f"ranks, {sum(o['checked'] for o in ranks)} checked against each "
                     "rank's own log, all matched"
                     + (f" ({missing} without a valid record to check)" if missing else ""))
        lines.append(f"  step {step} consumed:")
        lines += [f"    rank {o.get('rank', 0)}: " + consumed_text(b)
                  for o, b in zip(ranks, batches)]
    written = outcome.get("snapshots") or [outcome["snapshot"]]
    if len(written) == 1:
        lines.append((f"  state before step {step}'s update (after step {step - 1})"
                      if before else f"  state after step {step}")
                     + f": run {outcome['repro_run']}, {written[0]}")
    else:
        lines.append(f"  states after steps {outcome['step']} to {outcome['last']}: run "
                     f"{outcome['repro_run']}, {os.path.dirname(written[0])}/ "
                     f"({', '.join(os.path.basename(p) for p in written)})")
    return lines


@click.command(context_settings={"ignore_unknown_options": True})
@click.argument("root")
@click.argument("target")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@click.option("--before", is_flag=True,
              help="Stop just before STEP's update: write the state STEP's batch met "
                   "(after STEP - 1), to run RUN.repro-STEP-before.")
@click.option("--steps", "count", type=int, default=1, show_default=True,
              help="Write the state after each of K steps from STEP (each checked "
                   "first), all to the one run.")
def repro(root: str, target: str, command: Tuple[str, ...], before: bool,
          count: int) -> None:
    """Recompute STEP of RUN (TARGET is RUN@STEP, or RUN@anomaly: the newest anomaly
    the run logged) by running COMMAND, the run's own training command, unchanged.

    Its Client opens the run read-only (nothing is written to it; it may be training
    meanwhile), restores the newest snapshot at or before STEP, checks every
    recomputed step against the run's log (ReplayDivergence names the first step and
    field that differ, and nothing is written), writes the state after STEP as a
    snapshot of the new run RUN.repro-STEP, and ends the command. Exit 0 once the
    state is written. With --before, the state before STEP's update instead (after
    STEP - 1, checked up to there), to run RUN.repro-STEP-before. With --steps K,
    the states after each of K steps from there, each checked first.

    Many ranks: COMMAND starts torchrun with the run's world size; every rank checks
    its own rank's log, and the state is one snapshot of every rank's part.

    Example: snapd repro checkpoints gpt-small@48211 -- python train.py --config c.yaml
    """
    base = resolve_root(root)
    run, step, anomaly = resolve_step(base, target)
    check_target(base, run, step, before, count)
    write_at = step - 1 if before else step
    code, outcomes = run_command(command, {"root": base, "run": run, "step": write_at,
                                           "count": count,
                                           "out": out_run(run, step, before)})
    if not outcomes:
        fail(f"repro of {run}@{step}: the command exited with code {code} before "
             f"reaching step {write_at}: it must create Client({base!r}, {run!r}), "
             "restore() and log() each step", 1)
    outcome = verdict(outcomes, run, step)
    batches = [consumed(os.path.join(base, run), o.get("rank", 0), step)
               for o in outcome["ranks"]]
    for line in report_lines(outcome, step, batches, anomaly):
        click.echo(line)
