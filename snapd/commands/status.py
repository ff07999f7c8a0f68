"""``snapd status [ROOT]``: every run's progress and risk, from logs and manifests only.

The last snapshot is the newest committed directory (or LATEST, or the log's record,
whichever is newest; snapd.progress.RunProgress.committed): a client killed right after
a commit never logged it, and "at risk" counts from that snapshot, in updates and in
seconds of training (``at_risk_seconds``). A run snapshotting with ``every="auto"``
also shows its newest ``cadence`` record: the interval, the bound that sets it, the
expected loss per failure and the MTBF used, with where it came from. The last
resume shows its phases (snapd.progress.RunProgress.resume_phases): ready to train
and, after restore(overlap=True), when the optimizer state was complete. Each run's
pins (snapd/pins.py: the snapshots kept before an anomaly in the logged loss, with the
anomaly) and its newest anomaly in the log's tail are listed under the table.

A multi-rank run is also shown as a job (snapd.liveview.job_model): its world size,
each rank's last logged step, the last global commit and the incomplete snapshots
(ranks present and missing), from the logs, a commit record and part manifests.

``snapd status --daemons``: every live daemon of this user instead (snapd/daemons.py
finds them), with its root, pid, memory, how long it has been idle and when it exits
by itself (from its status reply; one that does not answer shows only what its
process tells).

A damaged log never stops it: each row is planned from the valid records, the damage
the readers skipped is listed in the row's ``log_damage`` (and, in the table view,
printed once to stderr), and a run that cannot be read at all gets an ``error``.
"""

from __future__ import annotations

import sys
import time
import warnings
from typing import Any, Dict, List, Optional

import click
from rich.table import Table

from snapd import pins, statelog
from snapd.commands.common import console, emit_json
from snapd.commands.locate import root_of
from snapd.daemons import LiveDaemon, find_daemons
from snapd.liveview import (DaemonProbe, at_risk_text, cadence_line, cadence_text,
                            job_lines, jobs_of, phases_text, remote_lines)
from snapd.progress import RunProgress, at_risk_seconds, read_progress
from snapd.roots import Root
from snapd.store import RunStore, list_runs
from snapd.humanize import age, count, human_bytes


def collect(root: str) -> List[Dict[str, Any]]:
    """One entry per (run, rank): its progress (snapd.progress.RunProgress), as plain data."""
    rows = []
    for run in list_runs(root):
        store = RunStore(root, run)
        for rank in statelog.list_ranks(store.path) or [0]:
            rows.append(_row(store, rank))
    return rows


def _row(store: RunStore, rank: int) -> Dict[str, Any]:
    error = None
    with warnings.catch_warnings():  # reported in the row instead
        warnings.simplefilter("ignore", statelog.LogDamageWarning)
        try:
            progress = read_progress(store, rank)
        except (OSError, ValueError) as e:  # unreadable (permissions): say so, go on
            progress, error = RunProgress(store.run, rank), f"{type(e).__name__}: {e}"
    row = progress.to_json()
    committed_at = progress.committed_time
    row["committed_age_s"] = None if committed_at is None else time.time() - committed_at
    row["error"] = error
    row["pins"] = pins.pin_records(store.path) if rank == 0 else []
    return row


def _against_commits(found: Root, base: str, rows: List[Dict[str, Any]],
                     jobs: List[Dict[str, Any]]) -> None:
    """The rows set against the root's own commits (behind a URL: the remote's, see
    snapd/roots.py). Where that moves a row's snapshot, its seconds at risk are
    measured again, from the log's record of the new snapshot's step."""
    planned = [row["committed"] for row in rows]
    found.against_commits(rows, jobs)
    with warnings.catch_warnings():  # the damage is in the rows already
        warnings.simplefilter("ignore", statelog.LogDamageWarning)
        for row, committed in zip(rows, planned):
            if row["committed"] != committed:
                row["at_risk_seconds"] = at_risk_seconds(
                    RunStore(base, row["run"]), row["rank"], row["at_risk"],
                    row["committed_step"], row["reached_time"], row["last_resume"])


def _say_damage(rows: List[Dict[str, Any]]) -> None:
    for row in rows:
        for problem in row["log_damage"] + ([row["error"]] if row["error"] else []):
            print(f"snapd: warning: run {row['run']} rank {row['rank']}: {problem}",
                  file=sys.stderr)


def _verdict(row: Dict[str, Any]) -> str:
    replay = row.get("last_replay")
    if not replay:
        return "-"
    if replay.get("verdict") == "match":
        return f"match ({count(replay.get('checked'), 'step')})"
    return f"DIVERGED at {replay.get('step')}: {replay.get('cause')}"


def _resume_text(resume: Dict[str, Any], phases: Optional[Dict[str, Any]]) -> str:
    """``from 00000004 (resume; ready 0.42s, optimizer state 1.30s)``: the last
    resume and its phases, timed from restore()'s call (liveview.phases_text)."""
    if not resume:
        return "-"
    said = phases_text(phases)
    return f"from {resume.get('snapshot')} ({resume.get('mode')}" + \
        (f"; {said})" if said else ")")


def render(rows: List[Dict[str, Any]]) -> Table:
    table = Table(title="snapd status", title_justify="left")
    for column in ("run", "rank", "step", "steps/s", "last snapshot", "age", "at risk",
                   "cadence", "last resume", "replay"):
        table.add_column(column, justify="right" if column in ("step", "steps/s",
                                                                "at risk") else "left")
    for r in rows:
        resume = r.get("last_resume") or {}
        table.add_row(
            r["run"], str(r["rank"]), "-" if r["reached"] is None else str(r["reached"]),
            "-" if r["steps_per_s"] is None else f"{r['steps_per_s']:.2f}",
            r["committed"] or "-", age(r["committed_age_s"]),
            at_risk_text(r["at_risk"], r.get("at_risk_seconds")),
            cadence_text(r.get("cadence")),
            _resume_text(resume, r.get("resume_phases")),
            _verdict(r))
    return table


@click.command()
@click.argument("root", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
@click.option("--daemons", is_flag=True,
              help="List this user's live daemons, whatever their roots: root, pid, "
                   "memory, idle time and when each exits by itself.")
def status(root: str | None, as_json: bool, daemons: bool) -> None:
    """Runs, last step, steps/s, last committed snapshot and its age, updates and
    seconds of training at risk, the snapshot cadence (interval in steps and seconds,
    the bound that sets it, expected loss per failure, MTBF and its source), last
    resume (its phases: ready to train, optimizer state complete) and its replay
    verdict; for a multi-rank run, its world size, each
    rank's last step, the last global commit and incomplete snapshots (ranks
    missing). Reads only logs, manifests and commit records; with a daemon serving
    ROOT with a remote tier, also each run's remote lag (last remote commit, steps and
    bytes behind, last error), from the daemon. ROOT may be a URL (snapd status
    s3://bucket/prefix): each run's replicated log against its newest remote commit
    ("at risk": what a restore from there would recompute).

    With --daemons: every live daemon of this user instead, with its root, pid,
    resident memory, hot copies held, trainers connected, idle time and the idle
    time after which it exits by itself.

    Example: snapd status checkpoints --json; snapd status --daemons
    """
    if daemons:
        if root is not None:
            raise click.UsageError(f"--daemons lists the daemons of every root: leave "
                                   f"out ROOT ({root})")
        _show_daemons(as_json)
        return
    found = root_of(root)
    with found.logs() as base:   # behind a URL: the replicated logs, pulled
        rows = collect(base)
        jobs = jobs_of(base, rows)
        _against_commits(found, base, rows, jobs)
    served = found.daemon_root()
    lag = _remote_status(served) if served else None
    if as_json:
        emit_json({"runs": rows, "jobs": jobs, "remote": lag})
        return
    _say_damage(rows)
    if not rows:
        click.echo("no runs under this root")
    else:
        out = console()
        out.print(render(rows))
        for line in _lines_under(rows, jobs):
            out.print(line, highlight=False, markup=False, soft_wrap=True)
    for line in remote_lines(lag, time.time()):
        console().print(line, highlight=False, markup=False, soft_wrap=True)


def _lines_under(rows: List[Dict[str, Any]], jobs: List[Dict[str, Any]]) -> List[str]:
    """What the table has no room for: each row's cadence in full, then the jobs."""
    cadences = [cadence_line(r["run"], r["rank"], r.get("cadence")) for r in rows]
    return [line for line in cadences if line] + \
        [line for r in rows for line in anomaly_lines(r)] + \
        [line for job in jobs for line in job_lines(job)]


def anomaly_lines(row: Dict[str, Any]) -> List[str]:
    """``run r: pinned 00000040 before the anomaly at step 45 (nonfinite:loss)``, one
    line per pin, and the newest anomaly when no pin names it."""
    lines, named = [], set()
    for held in row.get("pins") or []:
        anomaly = held.get("anomaly") or {}
        named.add(anomaly.get("step"))
        why = f"before the anomaly at step {anomaly.get('step')} ({anomaly.get('cause')})" \
            if anomaly else held.get("error", "")
        lines.append(f"run {row['run']}: pinned {held.get('snapshot')} {why}; snapd unpin "
                     f"ROOT {row['run']}@{held.get('step')} releases it")
    last = row.get("last_anomaly")
    if last and last.get("step") not in named:
        lines.append(f"run {row['run']} rank {row['rank']}: anomaly at step "
                     f"{last.get('step')} ({last.get('cause')}, value {last.get('value')!r}); "
                     f"pinned {last.get('pinned') or 'nothing'}")
    return lines


def _remote_status(root: str) -> Optional[Dict[str, Any]]:
    """The remote lag as the daemon serving ``root`` knows it (None: no daemon, or no
    remote tier); asked once, never starting a daemon."""
    probe = DaemonProbe(root)
    try:
        return (probe.status() or {}).get("remote")
    finally:
        probe.close()


# --- snapd status --daemons ---------------------------------------------------------

def daemon_rows() -> List[Dict[str, Any]]:
    """One row per live daemon of this user: its process, and what its status reply
    says (``answering`` False when it gave none: stopping, or hung)."""
    return [_daemon_row(d) for d in find_daemons()]


def _daemon_row(daemon: LiveDaemon) -> Dict[str, Any]:
    probe = DaemonProbe(daemon.root)
    try:
        reply = probe.status()
    finally:
        probe.close()
    row = {"root": daemon.root, "pid": daemon.pid, "rss": daemon.rss,
           "started": daemon.started, "answering": reply is not None,
           "stopping": None, "idle_seconds": None, "idle_limit_seconds": None,
           "clients": None, "hot_bytes": None}
    if reply is not None:
        row.update(stopping=bool(reply.get("stopping")),
                   idle_seconds=reply.get("idle_seconds"),
                   idle_limit_seconds=reply.get("idle_limit_seconds"),
                   clients=sum(1 for c in reply.get("clients") or [] if c.get("run")),
                   hot_bytes=reply.get("hot_bytes"))
    return row


def _exits_text(row: Dict[str, Any]) -> str:
    """When the daemon exits by itself: ``after 60s idle``, ``never`` or why not known."""
    if not row["answering"]:
        return "not answering"
    if row["stopping"]:
        return "stopping"
    limit = row["idle_limit_seconds"]
    if limit is None:   # a daemon of an older snapd, which does not say
        return "-"
    return "never (idle exit off)" if limit <= 0 else f"after {age(limit)} idle"


def render_daemons(rows: List[Dict[str, Any]]) -> Table:
    table = Table(title="snapd daemons", title_justify="left")
    for column in ("root", "pid", "memory", "hot copies", "trainers", "idle", "exits"):
        table.add_column(column, justify="left" if column in ("root", "exits")
                         else "right")
    for r in rows:
        table.add_row(r["root"], str(r["pid"]), human_bytes(r["rss"]),
                      human_bytes(r["hot_bytes"]),
                      "-" if r["clients"] is None else str(r["clients"]),
                      age(r["idle_seconds"]), _exits_text(r))
    return table


def _show_daemons(as_json: bool) -> None:
    rows = daemon_rows()
    if as_json:
        emit_json({"daemons": rows})
        return
    if not rows:
        click.echo("no snapd daemon of this user is running")
        return
    out = console()
    out.print(render_daemons(rows))
    total = sum(r["rss"] for r in rows)
    out.print(f"{count(len(rows), 'daemon')}, {human_bytes(total)} resident "
              "(snapd stop --all stops them)", highlight=False, markup=False)
