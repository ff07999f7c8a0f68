"""``snapd watch [ROOT]``: the live view on a terminal, one line per event on a pipe.

On a terminal the view (snapd/liveview.py: collect, render) is redrawn by rich's Live on
every change under the root and every ``--interval`` seconds. With stdout piped it
prints, like ``tail -f``, one line per new log record: the last few events first, then
snapshot events, cadence decisions, resumes and replay verdicts as they happen, and
step lines at most once per second per run. Both read only logs, pointers, listings
and the daemon's status; neither starts a daemon.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import sys
import time
import warnings
from contextlib import closing
from typing import Any, Dict, List, Optional, Tuple

import click
from rich.console import Console
from rich.live import Live

from snapd import statelog
from snapd import liveview as view
from snapd.commands.common import emit_json, given_root, resolve_root
from snapd.progress import CADENCE_FIELDS
from snapd.store import list_runs

BACKLOG = 10          # events printed at start, per (run, rank)
NEW_BUDGET = 5000     # records read per (run, rank) and poll, newest first
BACKLOG_SCAN = 512    # records the backlog is chosen from
TIME_SLACK = 5.0      # records are stamped before their write: order is only roughly by time
Item = Tuple[str, int, Dict[str, Any]]   # (run, rank, record)


# --- piped mode: one line per record -------------------------------------------------

def stamp(t: Optional[float]) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t if t else time.time()))


def _fields(record: Dict[str, Any], *names: str) -> str:
    out = []
    for name in names:
        value = record.get(name)
        if value is None:
            continue
        if isinstance(value, float):
            value = f"{value:.4g}"
        elif isinstance(value, str) and (not value or any(c.isspace() or c in '"='
                                                          for c in value)):
            value = json.dumps(value)
        out.append(f"{name}={value}")
    return " ".join(out)


def format_record(run: str, rank: int, record: Dict[str, Any]) -> Optional[str]:
    """One line for one log record; None for kinds the view does not report."""
    kind, head = record.get("kind"), f"{stamp(record.get('time'))} run={run} rank={rank}"
    if kind == "step":
        scalars = record.get("scalars") or {}
        names = sorted(scalars, key=lambda k: (k != "loss", k))
        return f"{head} step={record.get('step')} " + _fields(scalars, *names)
    if kind == "snapshot":
        extra = {"committed": ("name", "bytes", "seconds"), "staged": ("stall",),
                 "failed": ("error",)}.get(record.get("event"), ())
        return f"{head} snapshot {record.get('event')} " + \
            _fields(record, "step", *extra)
    if kind == "resume":
        return f"{head} resume " + _fields(record, "step", "snapshot", "mode", "reached",
                                           "recompute", "restored_from")
    if kind == "replay":
        return f"{head} replay " + _fields(record, "verdict", "from", "to", "checked",
                                           "step", "cause")
    if kind == "cadence":
        return f"{head} cadence " + _fields(record, "step", *CADENCE_FIELDS)
    if kind == "restored":   # restore(overlap=True): the optimizer state applied
        objects = record.get("objects")
        named = ",".join(map(str, objects)) if isinstance(objects, list) else objects
        return f"{head} restored " + _fields({**record, "objects": named}, "objects",
                                             "waited_s")
    if kind == "set_aside":
        return f"{head} set_aside " + _fields(record, "snapshot", "by")
    if kind == "anomaly":
        return f"{head} anomaly " + _fields(record, "step", "cause", "value", "pinned")
    return None


class StepLimiter:
    """At most one step line per run per ``every`` seconds; the newest held back is
    printed once its turn comes (``flush``), so the last step is not lost."""

    def __init__(self, every: float = 1.0) -> None:
        self.every = every
        self.last: Dict[str, float] = {}
        self.pending: Dict[str, Tuple[float, str]] = {}

    def offer(self, run: str, t: float, line: str) -> Optional[str]:
        if t - self.last.get(run, -math.inf) >= self.every:
            self.last[run] = t
            self.pending.pop(run, None)
            return line
        self.pending[run] = (t, line)
        return None

    def flush(self, now: float) -> List[str]:
        due = [run for run in self.pending if now - self.last[run] >= self.every]
        for run in due:
            self.last[run] = now
        return [self.pending.pop(run)[1] for run in due]


def lines_for_new_records(items: List[Item], limiter: StepLimiter) -> List[str]:
    """The lines for new records (oldest first); step lines go through the limiter."""
    lines = []
    for run, rank, record in items:
        line = format_record(run, rank, record)
        if line is None:
            continue
        if record.get("kind") == "step":
            line = limiter.offer(run, record.get("time") or 0.0, line)
        if line is not None:
            lines.append(line)
    return lines


def _key(record: Dict[str, Any]) -> tuple:
    return (record.get("kind"), record.get("event"), record.get("step"), record.get("time"))


class LogFollower:
    """The records appended to every (run, rank) log since the previous poll."""

    def __init__(self, root: str, backlog: int = BACKLOG) -> None:
        self.root, self.backlog = root, backlog
        self.seen: Dict[Tuple[str, int], Optional[Dict[str, Any]]] = {}
        self.started = False

    def poll(self) -> List[Item]:
        items: List[Item] = []
        for run in list_runs(self.root):
            run_dir = os.path.join(self.root, run)
            try:
                for rank in statelog.list_ranks(run_dir):
                    items += [(run, rank, r) for r in self._new(run_dir, run, rank)]
            except (OSError, ValueError):   # a race with rotation, a bad segment: next time
                continue
        self.started = True
        return sorted(items, key=lambda item: item[2].get("time") or 0.0)

    def _new(self, run_dir: str, run: str, rank: int) -> List[Dict[str, Any]]:
        first = not self.started and (run, rank) not in self.seen
        last = self.seen.get((run, rank))
        fresh: List[Dict[str, Any]] = []
        with closing(statelog.newest_first(run_dir, rank)) as records:
            for record in records:
                if last is not None and (_key(record) == _key(last) or (
                        record.get("time") or 0) < (last.get("time") or 0) - TIME_SLACK):
                    break
                fresh.append(record)
                if len(fresh) >= (BACKLOG_SCAN if first else NEW_BUDGET):
                    break
        self.seen[(run, rank)] = fresh[0] if fresh else last
        if first:   # the backlog: the last few events and the newest step
            events = [r for r in fresh if r.get("kind") != "step"][:self.backlog]
            fresh = events + [r for r in fresh if r.get("kind") == "step"][:1]
        return fresh[::-1]


def follow_lines(root: str, interval: float) -> None:
    """Piped mode: the lines of new records, and a line when the daemon comes or goes."""
    follower, limiter = LogFollower(root), StepLimiter()
    warnings.simplefilter("ignore", statelog.TornTailWarning)   # a trainer mid-write
    warnings.simplefilter("once", statelog.LogDamageWarning)    # each place said once
    said: List[Optional[str]] = [None]

    def tick(status: Optional[Dict[str, Any]], _mode: str) -> bool:
        lines = lines_for_new_records(follower.poll(), limiter) + limiter.flush(time.time())
        daemon = "not running" if status is None else f"running pid={status.get('pid')}"
        if daemon != said[0]:
            said[0] = daemon
            lines.insert(0, f"{stamp(None)} daemon {daemon}")
        for line in lines:
            sys.stdout.write(line + "\n")
        sys.stdout.flush()
        return True

    view.refresh_loop(root, tick, interval=interval)


# --- terminal mode --------------------------------------------------------------------

def live_view(root: str, interval: float, console: Console) -> None:
    def model(status: Any, mode: str) -> Dict[str, Any]:
        m = view.collect(root, status)
        m["refresh"] = (f"refresh: file events + daemon every {interval:g}s" if
                        mode == "events" else f"refresh: polling every {interval:g}s")
        return m

    with Live(console=console, auto_refresh=False, redirect_stdout=False,
              vertical_overflow="crop") as live:
        def tick(status: Optional[Dict[str, Any]], mode: str) -> bool:
            try:
                live.update(view.render(model(status, mode), console.width), refresh=True)
            except OSError:   # a run removed while read: the next refresh shows it
                pass
            return True

        view.refresh_loop(root, tick, interval=interval)


@click.command()
@click.argument("root", required=False)
@click.option("--interval", type=click.FloatRange(min=0.05), default=1.0,
              show_default=True, metavar="SECONDS",
              help="Refresh at least this often; the daemon is asked this often.")
@click.option("--once", is_flag=True, help="Show the current state once and exit.")
@click.option("--json", "as_json", is_flag=True,
              help="Print the status model as JSON (implies --once).")
def watch(root: Optional[str], interval: float, once: bool, as_json: bool) -> None:
    """Watch a checkpoint root live: per run and rank the step, steps/s, loss with a
    sparkline, last committed snapshot and its age, updates and seconds of training at
    risk, the snapshot cadence (interval, bound, expected loss per failure, MTBF), the
    snapshot in flight (progress, MB/s, ETA), stall per snapshot, skips, retention,
    disk free and the daemon's pid, CPU and memory. Refreshes on file changes and every --interval.

    With stdout piped, prints one line per event instead, like tail -f. Reads only
    logs, pointers and the daemon's status; never starts a daemon. ROOT: the checkpoint
    root (default: $SNAPD_ROOT, else the current directory); one that does not exist
    yet is waited for (with --once or --json it is an error, exit 2).

    \b
    Examples:
      snapd watch /data/ckpt                 live view, Ctrl-C to quit
      snapd watch /data/ckpt | grep committed
      snapd watch /data/ckpt --once --json   the status model, for scripts
    """
    if as_json or once:   # a snapshot of now: a root that is not there is an error
        root = resolve_root(root)
        if as_json:
            emit_json(view.collect(root))
            return
        console = Console()
        console.print(view.render(view.collect(root), console.width))
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    logging.getLogger("watchdog").addHandler(logging.NullHandler())   # its stop warnings
    try:
        root = await_root(root, interval)
        if sys.stdout.isatty():
            live_view(root, interval, Console())
        else:
            follow_lines(root, interval)
    except KeyboardInterrupt:
        pass
    except BrokenPipeError:   # `snapd watch | head`: the reader left; exit quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def await_root(root: Optional[str], interval: float) -> str:
    """The root, once it is there: a watch started before the trainer that creates
    the root waits for it, saying so once on stderr (stdout stays the event lines)."""
    path = given_root(root)
    if not os.path.exists(path):
        click.echo(f"snapd: waiting for {path} to appear (Ctrl-C to quit)", err=True)
        while not os.path.exists(path):
            time.sleep(interval)
    return resolve_root(path)   # a file, not a directory: still an error

