"""``snapd gc``: apply retention to a root's runs, by hand.

The rules and the safe delete are snapd.retention's, the same the daemon and the
in-process writer apply after each commit (snapd/commit.py): keep the last N, every
K-th step, the M best by metric; never the newest snapshot whose manifest verifies,
nor the one LATEST names, nor one whose manifest cannot be read. A delete is one
rename out of the committed namespace, then the slow recursive removal, so an
interrupted gc leaves no half snapshot. The ``.parts-<name>`` directories of multi-rank
snapshots older than LATEST (a rank's part never came) are removed and reported.
The files of deleted snapshots that kept ones read are kept in ``<run>/shared/``, and
the entries there no snapshot reads any more are swept (snapd/keepshared.py); both
reported. Deleting holds the root's lock (refused while a daemon serves it) and
skips runs a live client writes. ``--collect-tmp`` removes old tmp dirs under the
same locks (retention.collect_tmp).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import click

from snapd import retention
from snapd.commands.common import ROOT_HELP, emit_json, fail, resolve_root, run_dir
from snapd.errors import AlreadyServing
from snapd.options import Options
from snapd.store import list_runs
from snapd.humanize import human_bytes


def _as_json(r: retention.RetentionResult) -> Dict[str, Any]:
    return {"deleted": r.deleted, "kept": r.kept, "protected_latest": r.protected,
            "pinned": r.pinned,
            "refused": r.refused, "bytes": r.bytes, "incomplete_removed": r.incomplete,
            "kept_shared": r.kept_shared, "kept_shared_bytes": r.kept_shared_bytes,
            "swept": r.swept, "swept_bytes": r.swept_bytes,
            "sweep_blocked_by": r.sweep_blocked_by, "busy": r.busy}


def _retain(base: str, opts: Options, names: List[str],
            dry_run: bool) -> Dict[str, retention.RetentionResult]:
    try:
        return retention.gc(base, opts, names, dry_run=dry_run)
    except AlreadyServing as e:
        fail(f"{e}\n  hint: gc deletes only while no daemon serves the root (a snapshot "
             "it is writing may read a file of one gc deletes); the daemon applies the "
             "same rules after each commit (SNAPD_KEEP_*). Stop it first (snapd stop ROOT) "
             "to delete by other rules; --dry-run works beside it", 1)


def report_shared(run: str, r: retention.RetentionResult, dry_run: bool) -> None:
    """What the deletes keep in shared/ and what the sweep removes (snapd/keepshared.py)."""
    if r.kept_shared:
        click.echo(f"  {run}: {'would keep' if dry_run else 'kept'} "
                   f"{human_bytes(r.kept_shared_bytes)} in shared/, read by kept "
                   f"snapshots: {', '.join(r.kept_shared)}")
    if r.swept:
        click.echo(f"  {run}: {'would sweep' if dry_run else 'swept'} "
                   f"{human_bytes(r.swept_bytes)} from shared/, read by no snapshot: "
                   f"{', '.join(r.swept)}")
    if r.sweep_blocked_by:
        click.echo(f"  {run}: shared/ not swept: the manifest of "
                   f"{', '.join(r.sweep_blocked_by)} cannot be read, and it may read any "
                   f"shared file (snapd verify {run}/<name> says why)")


def _collect(root: str, runs: List[str]) -> retention.Collected:
    try:
        return retention.collect_tmp(root, runs)
    except AlreadyServing as e:
        fail(f"{e}\n  hint: --collect-tmp is refused while a daemon serves the root "
             "(a .tmp- directory may be its snapshot in progress); the daemon collects "
             "them itself when it starts", 1)


def report(results: Dict[str, retention.RetentionResult], dry_run: bool) -> None:
    verb = "would delete" if dry_run else "deleted"
    for run, r in results.items():
        if r.busy:
            click.echo(f"{run}: left alone, a live client writes this run")
            continue
        line = f"{run}: {verb} {', '.join(r.deleted) or 'nothing'}"
        if r.deleted:
            line += f" ({human_bytes(r.bytes)})"
        click.echo(line + f"; keeps {', '.join(r.kept) or 'nothing'}")
        if r.protected:
            click.echo(f"  {run}: kept {r.protected[0]} because LATEST names it")
        if r.pinned:
            click.echo(f"  {run}: kept {', '.join(r.pinned)}: pinned (snapd unpin "
                       f"ROOT {run}@STEP lets retention delete it)")
        if r.refused:
            click.echo(f"  {run}: left alone, manifest unreadable: {', '.join(r.refused)} "
                       f"(snapd verify {run}/<name> says why)")
        if r.incomplete:
            click.echo(f"  {run}: {'would remove' if dry_run else 'removed'} incomplete "
                       f"multi-rank snapshot parts (a rank's part never came, and a newer "
                       f"snapshot is committed): "
                       + ", ".join(f".parts-{n}" for n in r.incomplete))
        report_shared(run, r, dry_run)


@click.command()
@click.option("--root", help=ROOT_HELP)
@click.option("--run", "runs", multiple=True, help="Only this run (repeatable); default all.")
@click.option("--keep-last", type=click.IntRange(min=1), help="Keep the newest N.")
@click.option("--keep-every", type=click.IntRange(min=1),
              help="Keep every snapshot whose step is a multiple of K.")
@click.option("--keep-best", type=click.IntRange(min=0), help="Keep the M best by metric.")
@click.option("--best-mode", type=click.Choice(["min", "max"]),
              help="Whether a lower (min, the default) or higher metric is better.")
@click.option("--dry-run", is_flag=True, help="Print what would be deleted; delete nothing.")
@click.option("--collect-tmp", is_flag=True,
              help="Also remove abandoned .tmp- directories older than an hour (refused "
                   "while a daemon serves the root; runs a live client writes are "
                   "skipped).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def gc(root: Optional[str], runs: tuple, keep_last: Optional[int], keep_every: Optional[int],
       keep_best: Optional[int], best_mode: Optional[str], dry_run: bool, collect_tmp: bool,
       as_json: bool) -> None:
    """Delete the snapshots the retention rules do not keep. Never deletes the newest
    snapshot whose manifest verifies, the one LATEST names, or one whose manifest
    cannot be read. Rules not given come from SNAPD_KEEP_LAST, SNAPD_KEEP_EVERY,
    SNAPD_KEEP_BEST, SNAPD_BEST_MODE; with no rule at all nothing is deleted. The
    files of deleted snapshots that kept ones read are kept in RUN/shared/, and what
    no snapshot reads any more is swept from there. Refused (exit 1) while a daemon
    serves the root; runs a live client writes are left alone.

    Example: snapd gc --root checkpoints --keep-last 3 --keep-best 1 --dry-run
    """
    base = resolve_root(root)
    for run in runs:
        run_dir(base, run)
    try:
        opts = Options.resolve({"keep_last": keep_last, "keep_every": keep_every,
                                "keep_best": keep_best, "best_mode": best_mode})
    except ValueError as e:
        fail(f"{e}; fix the environment variable or pass the option", 2)
    names = list(runs) or list_runs(base)
    results = _retain(base, opts, names, dry_run)
    tmp = _collect(base, names) if collect_tmp and not dry_run else retention.Collected()
    no_rule = opts.keep_last is None and not opts.keep_every and not opts.keep_best
    if as_json:
        emit_json({"root": base, "dry_run": dry_run, "no_rule": no_rule,
                   "runs": {run: _as_json(r) for run, r in results.items()},
                   "tmp_removed": tmp.removed, "tmp_busy_runs": tmp.busy})
        return
    if no_rule:
        click.echo("no retention rule given (--keep-last, --keep-every, --keep-best or "
                   "SNAPD_KEEP_*): every snapshot is kept")
    report(results, dry_run)
    for path in tmp.removed:
        click.echo(f"removed abandoned {path}")
    for run in tmp.busy:
        click.echo(f"  {run}: tmp dirs left alone, a live client writes this run")
