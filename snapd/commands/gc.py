"""``snapd gc``: apply retention to a root's runs, by hand.

The rules and the safe delete are snapd.retention's (the daemon applies the same after
each commit): keep the last N, every K-th step, the M best by metric; never the newest
snapshot whose manifest verifies; never one whose manifest cannot be read. On top of
that this command never deletes the snapshot LATEST names, even when a crash left it
behind a newer commit. A delete is one rename out of the committed namespace, then the
slow recursive removal, so an interrupted gc leaves no half snapshot.
"""

from __future__ import annotations

import os
import time
from typing import Any, Dict, List, Optional

import click

from snapd import retention
from snapd.commands.common import ROOT_HELP, emit_json, fail, resolve_root, run_dir
from snapd.options import Options
from snapd.store import RunStore, list_runs
from snapd.text import human_bytes

TMP_MIN_AGE_S = 3600.0  # a younger .tmp- directory may be a snapshot still being written


def _dir_bytes(path: str) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                continue
    return total


def plan_run(store: RunStore, opts: Options) -> Dict[str, Any]:
    """What retention keeps and deletes in one run (nothing is touched)."""
    infos, refused = retention.scan(store)
    plan = retention.plan_retention(infos, keep_last=opts.keep_last,
                                    keep_every=opts.keep_every, keep_best=opts.keep_best,
                                    best_mode=opts.best_mode)
    latest = store.read_pointer("LATEST")
    protected = [i for i in plan.delete if i.sid == latest]
    delete = [i for i in plan.delete if i.sid != latest]
    return {"keep": sorted(plan.keep + protected, key=lambda i: i.key), "delete": delete,
            "protected": [i.sid.name for i in protected], "refused": refused}


def apply_run(store: RunStore, plan: Dict[str, Any], opts: Options,
              dry_run: bool) -> Dict[str, Any]:
    sizes = {i.sid.name: _dir_bytes(store.snapshot_path(i.sid)) for i in plan["delete"]}
    if not dry_run:
        trash = [retention.trash_snapshot(store, i.sid) for i in plan["delete"]]
        retention.update_best(store, plan["keep"], opts.best_mode)
        retention.purge(trash)
    return {"deleted": [i.sid.name for i in plan["delete"]],
            "kept": [i.sid.name for i in plan["keep"]],
            "protected_latest": plan["protected"], "refused": plan["refused"],
            "bytes": sum(sizes.values())}


def collect_tmp(root: str, runs: List[str]) -> List[str]:
    """Remove .tmp- directories older than an hour, holding the root's daemon lock."""
    from snapd.daemon import AlreadyServing, RootLock

    lock = RootLock(root)
    try:
        lock.acquire()
    except AlreadyServing as e:
        fail(f"{e}\n  hint: --collect-tmp is refused while a daemon serves the root "
             "(a .tmp- directory may be its snapshot in progress); the daemon collects "
             "them itself when it starts", 1)
    removed = []
    try:
        now = time.time()
        for run in runs:
            store = RunStore(root, run)
            young = tuple(p for p in store.tmp_dirs()
                          if now - os.lstat(p).st_mtime < TMP_MIN_AGE_S)
            old = [p for p in store.tmp_dirs() if p not in young]
            store.collect_tmp(keep=young)
            removed += old
    finally:
        lock.release()
    return removed


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
                   "while a daemon serves the root).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def gc(root: Optional[str], runs: tuple, keep_last: Optional[int], keep_every: Optional[int],
       keep_best: Optional[int], best_mode: Optional[str], dry_run: bool, collect_tmp: bool,
       as_json: bool) -> None:
    """Delete the snapshots the retention rules do not keep. Never deletes the newest
    snapshot whose manifest verifies, the one LATEST names, or one whose manifest
    cannot be read. Rules not given come from SNAPD_KEEP_LAST, SNAPD_KEEP_EVERY,
    SNAPD_KEEP_BEST, SNAPD_BEST_MODE; with no rule at all nothing is deleted.

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
    results = {run: apply_run(RunStore(base, run), plan_run(RunStore(base, run), opts),
                              opts, dry_run) for run in names}
    tmp = collect_tmp(base, names) if collect_tmp and not dry_run else []
    no_rule = opts.keep_last is None and not opts.keep_every and not opts.keep_best
    if as_json:
        emit_json({"root": base, "dry_run": dry_run, "no_rule": no_rule, "runs": results,
                   "tmp_removed": tmp})
        return
    if no_rule:
        click.echo("no retention rule given (--keep-last, --keep-every, --keep-best or "
                   "SNAPD_KEEP_*): every snapshot is kept")
    verb = "would delete" if dry_run else "deleted"
    for run, r in results.items():
        line = f"{run}: {verb} {', '.join(r['deleted']) or 'nothing'}"
        if r["deleted"]:
            line += f" ({human_bytes(r['bytes'])})"
        click.echo(line + f"; keeps {', '.join(r['kept']) or 'nothing'}")
        if r["protected_latest"]:
            click.echo(f"  {run}: kept {r['protected_latest'][0]} because LATEST names it")
        if r["refused"]:
            click.echo(f"  {run}: left alone, manifest unreadable: {', '.join(r['refused'])} "
                       f"(snapd verify {run}/<name> says why)")
    for path in tmp:
        click.echo(f"removed abandoned {path}")
