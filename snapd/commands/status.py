"""``snapd status [ROOT]``: every run's progress and risk, from logs and manifests only."""

from __future__ import annotations

import time
from typing import Any, Dict, List

import click
from rich.console import Console
from rich.table import Table

from snapd import statelog
from snapd.commands.common import age, emit_json, resolve_root
from snapd.recovery import plan_recovery
from snapd.store import RunStore, list_runs


def collect(root: str) -> List[Dict[str, Any]]:
    """One entry per (run, rank): the recovery plan, as plain data."""
    rows = []
    for run in list_runs(root):
        store = RunStore(root, run)
        for rank in statelog.list_ranks(store.path) or [0]:
            plan = plan_recovery(store, rank)
            row = plan.to_json()
            committed_at = (plan.last_committed or {}).get("time")
            row["committed_age_s"] = None if committed_at is None else time.time() - committed_at
            rows.append(row)
    return rows


def _verdict(row: Dict[str, Any]) -> str:
    replay = row.get("last_replay")
    if not replay:
        return "-"
    if replay.get("verdict") == "match":
        return f"match ({replay.get('checked')} steps)"
    return f"DIVERGED at {replay.get('step')}: {replay.get('cause')}"


def render(rows: List[Dict[str, Any]]) -> Table:
    table = Table(title="snapd status", title_justify="left")
    for column in ("run", "rank", "step", "steps/s", "last snapshot", "age", "at risk",
                   "last resume", "replay"):
        table.add_column(column, justify="right" if column in ("step", "steps/s",
                                                                "at risk") else "left")
    for r in rows:
        resume = r.get("last_resume") or {}
        table.add_row(
            r["run"], str(r["rank"]), "-" if r["reached"] is None else str(r["reached"]),
            "-" if r["steps_per_s"] is None else f"{r['steps_per_s']:.2f}",
            r["latest"] or "-", age(r["committed_age_s"]),
            "-" if r["at_risk"] is None else str(r["at_risk"]),
            f"from {resume.get('snapshot')} ({resume.get('mode')})" if resume else "-",
            _verdict(r))
    return table


@click.command()
@click.argument("root", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
def status(root: str | None, as_json: bool) -> None:
    """Runs, last step, steps/s, last committed snapshot and its age, updates at risk,
    last resume and its replay verdict. Reads only logs and manifests.

    Example: snapd status checkpoints --json
    """
    rows = collect(resolve_root(root))
    if as_json:
        emit_json({"runs": rows})
    elif not rows:
        click.echo("no runs under this root")
    else:
        Console().print(render(rows))
