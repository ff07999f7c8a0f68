"""The live view of a root (``snapd watch``): a status model, a pure render, one loop.

After rich's ``live.py``: :func:`collect` builds the *status model* (plain, JSON-able
data on every run and rank, the snapshots in flight, the disk, the daemon);
:func:`render` turns a model into a renderable, purely (tests build a model by hand and
capture the text at a fixed width); :func:`refresh_loop`, the only loop, wakes on file
events under the root (watchdog, debounced) or every ``interval``, when it also asks
the daemon for its status (in-flight progress lives only there).

Read: the newest ``TAIL_BUDGET`` records of each rank's log, LATEST/BEST, the listing
of ``snapshots/``, the daemon's ``status`` and the pid in ``.snapd.lock``; for a
multi-rank run (:func:`job_model`) the newest snapshot's commit record and the
manifests of incomplete parts. Never a tensor file; never a daemon started.
"""

from __future__ import annotations

import math
import os
import statistics
import threading
import time
import warnings
from contextlib import closing, suppress
from typing import Any, Callable, Dict, List, Optional

import psutil
from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from snapd import pins, protocol as proto, statelog
from snapd.errors import CorruptSnapshot
from snapd.globalcommit import incomplete
from snapd.peer import Peer
from snapd.reader import read_summary
from snapd.progress import RunProgress, read_progress
from snapd.names import ROOT_LOCK_NAME as LOCK_NAME, SOCKET_NAME
from snapd.store import RunStore, list_runs
from snapd.humanize import age, count, number, si_bytes, span

TAIL_BUDGET = 1024     # records read per rank and refresh, newest first
SPARK_POINTS = 24      # losses in the sparkline
STALL_SAMPLES = 32     # staged records the stall statistics cover
BLOCKS = "▁▂▃▄▅▆▇█"
_QUERY = object()      # collect(): ask the daemon yourself
_PROCESSES: Dict[int, psutil.Process] = {}   # cpu_percent needs the same object


# --- the daemon --------------------------------------------------------------------

class DaemonProbe:
    """A status-only connection to the root's daemon, reopened when lost. Never starts
    a daemon; events on the connection are skipped."""

    def __init__(self, root: str, timeout: float = 2.0) -> None:
        self.root, self.timeout = root, timeout
        self._peer: Optional[Peer] = None

    def status(self) -> Optional[Dict[str, Any]]:
        """The daemon's status map, or None when no daemon answers."""
        try:
            if self._peer is None:   # DaemonUnavailable (none listens) is an OSError
                self._peer = Peer.open(self.root, timeout=self.timeout, keep_events=False)
            reply = self._peer.request(proto.Status())
            return reply.get("status") if reply.get("op") == "status_reply" else None
        except (OSError, EOFError, proto.ProtocolError):
            self.close()
            return None

    def close(self) -> None:
        self._peer, peer = None, self._peer
        if peer is not None:
            peer.close()


def _lock_holder(root: str) -> Optional[Dict[str, Any]]:
    """Pid, CPU and RSS of the live process whose pid ``.snapd.lock`` holds."""
    try:
        with open(os.path.join(root, LOCK_NAME), "r", encoding="ascii") as f:
            pid = int(f.read(32).strip() or 0)
        if pid <= 0:
            return None
        proc = _PROCESSES.get(pid) or _PROCESSES.setdefault(pid, psutil.Process(pid))
        cmd = proc.cmdline()   # `snapd serve` or `python -m snapd serve`
        if proc.status() == psutil.STATUS_ZOMBIE or "serve" not in cmd or \
                not any(os.path.basename(arg) == "snapd" for arg in cmd):
            return None   # a dead daemon's pid, maybe reused by another process
        with proc.oneshot():
            return {"pid": pid, "cpu_percent": proc.cpu_percent(interval=None),
                    "rss": proc.memory_info().rss}
    except (OSError, ValueError, UnicodeDecodeError, psutil.Error):
        return None


def daemon_model(root: str, status: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """What the view shows of the daemon: from its status reply, else the lock's pid."""
    if status is not None:
        return {"running": True, "answering": True, "pid": status.get("pid"),
                "cpu_percent": status.get("cpu_percent"), "rss": status.get("rss"),
                "started": status.get("started"), "stopping": bool(status.get("stopping")),
                "clients": sum(1 for c in status.get("clients") or [] if c.get("run"))}
    holder = _lock_holder(root)
    if holder is None:
        return {"running": False, "answering": False, "pid": None}
    return {"running": True, "answering": False, **holder, "started": None,
            "clients": None, "stopping": False}


def flight_model(entry: Dict[str, Any], now: float) -> Dict[str, Any]:
    """One in-flight snapshot with its progress: fraction, MB/s and ETA."""
    total, written = entry.get("bytes_total") or 0, entry.get("bytes_written") or 0
    started = entry.get("started")
    rate = written / max(now - started, 1e-3) if started else None
    eta = max(total - written, 0) / rate if rate else None
    return {"run": entry.get("run"), "rank": entry.get("rank"), "step": entry.get("step"),
            "state": "writing" if started else "queued", "bytes_written": written,
            "bytes_total": total, "fraction": min(1.0, written / total) if total else None,
            "mb_s": None if rate is None else rate / 1e6, "eta_s": eta,
            "queued_s": None if started or not entry.get("accepted")
            else max(0.0, now - entry["accepted"])}


# --- the runs ----------------------------------------------------------------------

def _scan_tail(run_dir: str, rank: int) -> Dict[str, Any]:
    """Losses, stalls, skips and failures from the newest TAIL_BUDGET records."""
    losses: List[float] = []   # newest first, as are stalls
    stalls: List[float] = []
    skipped, failed, seen, committed = 0, 0, 0, None
    with closing(statelog.newest_first(run_dir, rank)) as records:
        for seen, record in enumerate(records, 1):
            kind, event = record.get("kind"), record.get("event")
            loss = (record.get("scalars") or {}).get("loss") if kind == "step" else None
            if isinstance(loss, (int, float)) and len(losses) < SPARK_POINTS:
                losses.append(float(loss))
            elif kind == "snapshot" and event == "staged" and len(stalls) < STALL_SAMPLES \
                    and isinstance(record.get("stall"), (int, float)):
                stalls.append(float(record["stall"]))
            if kind == "snapshot" and event == "committed" and committed is None:
                committed = record
            skipped += kind == "snapshot" and event == "skipped"
            failed += kind == "snapshot" and event == "failed"
            if seen >= TAIL_BUDGET:
                break
    stall = {"last": stalls[0], "p50": statistics.median(stalls), "max": max(stalls),
             "count": len(stalls)} if stalls else None
    return {"losses": losses[::-1], "loss": losses[0] if losses else None, "stall": stall,
            "skipped": skipped, "failed": failed, "records_read": seen,
            "_committed": committed}


def _retention(store: RunStore) -> Dict[str, Any]:
    latest, best = store.read_pointer("LATEST"), store.read_pointer("BEST")
    return {"committed": len(store.committed()), "tmp": len(store.tmp_dirs()),
            "latest": latest.name if latest else None, "best": best.name if best else None,
            "pinned": [sid.name for sid in pins.pinned(store.path)]}


def _progress(prog: RunProgress, committed: Optional[Dict[str, Any]], now: float
              ) -> Dict[str, Any]:
    last = _pick(committed, "name", "step", "bytes", "seconds", "time")
    truth = prog.committed
    if truth is not None and (last is None or last.get("name") != truth.name):
        # The directories and LATEST win: a client killed right after a commit never
        # logged it. What only the log knew (bytes, seconds) is unknown then.
        last = {"name": truth.name, "step": truth.step, "bytes": None, "seconds": None,
                "time": prog.committed_time}
    return {
        "step": prog.reached, "steps_per_s": prog.steps_per_s,
        "step_age_s": None if prog.reached_time is None else now - prog.reached_time,
        "at_risk": prog.at_risk, "at_risk_seconds": prog.at_risk_seconds,
        "cadence": prog.cadence,
        "last_committed": last,
        "committed_age_s": now - last["time"] if last and last.get("time") else None,
        "last_resume": _pick(prog.last_resume, "snapshot", "step", "mode", "recompute",
                        "time"),
        "resume_phases": prog.resume_phases,
        "last_replay": _pick(prog.last_replay, "verdict", "checked", "step", "cause"),
        "last_anomaly": _pick(prog.last_anomaly, "step", "cause", "value", "pinned")}


def rank_model(store: RunStore, rank: int, now: float) -> Dict[str, Any]:
    """One (run, rank): progress, work at risk (updates and seconds), the cadence's
    decision, loss, last commit, stall, skips, retention."""
    row: Dict[str, Any] = {"run": store.run, "rank": rank, "error": None, "log_damage": []}
    try:
        with warnings.catch_warnings():  # a live view shows damage in its rows instead
            warnings.simplefilter("ignore", statelog.TornTailWarning)
            warnings.simplefilter("ignore", statelog.LogDamageWarning)
            progress = read_progress(store, rank)
            row["log_damage"] = progress.log_damage
            row.update(_scan_tail(store.path, rank))
    except (OSError, ValueError) as e:   # CorruptLog is a ValueError; rotation races
        row["error"] = f"{type(e).__name__}: {e}"
        progress = RunProgress(store.run, rank)
    # The newest committed record: the tail's, else the report's (from further back).
    row.update(_progress(progress, row.pop("_committed", None) or progress.last_committed, now))
    with suppress(OSError):   # no commit in the log: the age of the LATEST pointer
        if row["committed_age_s"] is None:
            row["committed_age_s"] = now - os.stat(f"{store.path}/LATEST").st_mtime
    row["retention"] = _retention(store)
    return row


def _world_size(store: RunStore, name: Optional[str]) -> Optional[int]:
    """The world size a committed snapshot records (commit record or manifest)."""
    if name is None:
        return None
    try:
        return read_summary(os.path.join(store.snapshots_path, name)).get("world_size")
    except (CorruptSnapshot, OSError):   # damaged, or deleted by retention meanwhile
        return None


def job_model(store: RunStore, steps: Dict[int, Optional[int]]) -> Dict[str, Any]:
    """One run as a job of ranks: its world size, each rank's last logged step
    (``steps``, from the rank rows), the last global commit, the incomplete parts.

    The world size is the largest the newest snapshot, the incomplete parts and the
    logs (one directory per rank) show. Reads a commit record and part manifests."""
    committed = store.committed()
    last = committed[-1].name if committed else None
    try:
        waiting = incomplete(store)
    except OSError:   # removed by gc or committed while listed
        waiting = []
    sizes = [_world_size(store, last), len(steps)] + [w["world_size"] for w in waiting]
    world = max((n for n in sizes if isinstance(n, int)), default=1)
    return {"run": store.run, "world_size": world,
            "ranks": [{"rank": r, "step": steps.get(r)}
                      for r in sorted(set(range(world)) | set(steps))],
            "last_global_commit": last,
            "incomplete": [{k: w[k] for k in ("name", "path", "ranks", "missing",
                                                "world_size")} for w in waiting]}


def job_lines(job: Dict[str, Any]) -> List[str]:
    """What a person reads of a job: nothing for a one-rank run with no incomplete
    parts, else its ranks' steps, the last global commit, each incomplete snapshot."""
    if job["world_size"] <= 1 and not job["incomplete"]:
        return []
    steps = ", ".join(f"r{r['rank']} {'-' if r['step'] is None else r['step']}"
                      for r in job["ranks"])
    lines = [f"{job['run']}: {job['world_size']} ranks, last step {steps}; last global "
             f"commit {job['last_global_commit'] or 'none'}"]
    for w in job["incomplete"]:
        lines.append(f"{job['run']}: {w['name']} INCOMPLETE, ranks "
                     f"{', '.join(map(str, w['ranks'])) or 'none'} present, missing "
                     f"{', '.join(map(str, w['missing'])) or 'unknown'} (never restored; "
                     "gc removes it once a newer snapshot is committed)")
    return lines


def jobs_of(root: str, rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """A job model per run of ``rows``: rank rows with ``run``, ``rank`` and the last
    logged step (``step`` in the view's rows, ``reached`` in status's)."""
    steps: Dict[str, Dict[int, Optional[int]]] = {}
    for r in rows:
        steps.setdefault(r["run"], {})[r["rank"]] = r.get("step", r.get("reached"))
    return [job_model(RunStore(root, run), ranks) for run, ranks in steps.items()]


def _pick(record: Optional[Dict[str, Any]], *keys: str) -> Optional[Dict[str, Any]]:
    return {k: record.get(k) for k in keys} if record else None


def collect(root: str, status: Any = _QUERY, *, now: Optional[float] = None
            ) -> Dict[str, Any]:
    """The status model of ``root``. ``status``: the daemon's reply (None: no daemon);
    left out, the daemon is asked once here."""
    root, now = os.path.abspath(root), time.time() if now is None else now
    if status is _QUERY:
        probe = DaemonProbe(root)
        status, _ = probe.status(), probe.close()
    disk = None
    with suppress(OSError):
        usage = psutil.disk_usage(root)
        disk = {"free": usage.free, "total": usage.total}
    runs = [rank_model(RunStore(root, run), rank, now) for run in list_runs(root)
            for rank in statelog.list_ranks(os.path.join(root, run)) or [0]]
    flights = [flight_model(e, now) for e in (status or {}).get("in_flight") or []]
    return {"root": root, "time": now, "disk": disk, "daemon": daemon_model(root, status),
            "runs": runs, "jobs": jobs_of(root, runs), "in_flight": flights,
            "remote": (status or {}).get("remote")}


def at_risk_text(steps: Optional[int], seconds: Optional[float]) -> str:
    """``12 (3.4s)``: the updates and the seconds of training since the newest
    committed snapshot; ``12`` when the log has no times, ``-`` when nothing is known."""
    if steps is None:
        return "-"
    return str(steps) if seconds is None else f"{steps} ({span(seconds)})"


def phases_text(phases: Optional[Dict[str, Any]]) -> str:
    """A resume's phases from restore()'s call: ``ready 0.42s, optimizer state
    1.30s``; with overlap, the state may be ``pending`` or ``FAILED (set aside)``;
    empty when the log does not say (a resume logged before the phases were)."""
    if not phases or phases.get("ready_s") is None:
        return ""
    text = f"ready {phases['ready_s']:.2f}s"
    if not phases.get("overlap"):
        return text
    if phases.get("state") == "complete" and phases.get("complete_s") is not None:
        return text + f", optimizer state {phases['complete_s']:.2f}s"
    return text + (", optimizer state FAILED (set aside)" if phases.get("state") == "failed"
                   else ", optimizer state pending")


def cadence_text(cadence: Optional[Dict[str, Any]]) -> str:
    """``every 40 (12s, overhead)``: the cadence's interval in steps and seconds and
    the bound that sets it; ``-`` for a run without a cadence record."""
    if not cadence:
        return "-"
    steps = cadence.get("interval_steps")
    return (f"every {'-' if steps is None else steps} "
            f"({span(cadence.get('interval_s'))}, {cadence.get('bound') or '-'})")


def cadence_line(run: str, rank: int, cadence: Optional[Dict[str, Any]]) -> Optional[str]:
    """The whole decision in words, for the lines under the tables; None without one."""
    if not cadence:
        return None
    steps = cadence.get("interval_steps")
    every = "- steps" if steps is None else count(steps, "step")
    return (f"{run} r{rank}: cadence every {every} ({span(cadence.get('interval_s'))}), "
            f"set by the {cadence.get('bound') or '-'} bound; expected loss per failure "
            f"{span(cadence.get('expected_loss_s'))}; MTBF {age(cadence.get('mtbf_s'))} "
            f"({cadence.get('mtbf_from') or '-'})")


def remote_lines(remote: Optional[Dict[str, Any]], now: float) -> List[str]:
    """The remote tier's lag, one line per run (pure; ``remote`` is status_reply's)."""
    if not remote:
        return []
    head = f"remote {remote.get('url')}"
    lines = [head + (f": {remote['last_error']}" if remote.get("last_error") else "")]
    for run, r in sorted((remote.get("runs") or {}).items()):
        last = r.get("last") or {}
        at = last.get("at")
        said = [f"  {run}: last remote commit {last.get('name') or 'none'}"
                + (f" ({age(now - at)} ago)" if at else ""),
                f"{count(r.get('steps_behind') or 0, 'step')} and "
                f"{si_bytes(r.get('bytes_behind') or 0)} behind"]
        if r.get("uploading"):
            said.append(f"uploading {r['uploading']}")
        if r.get("pending"):
            said.append(f"next {r['pending']}")
        if r.get("last_error"):
            said.append(f"last error: {r['last_error']}")
        lines.append(", ".join(said))
    return lines


# --- the render (pure) ---------------------------------------------------------------

def sparkline(values: List[float], points: int = SPARK_POINTS) -> str:
    """Unicode blocks, lowest value ``▁``, highest ``█``; non-finite values skipped."""
    values = [v for v in values if math.isfinite(v)][-points:]
    if not values or min(values) == max(values):
        return BLOCKS[3] * len(values)   # flat: mid height ("" when there is none)
    lo, hi = min(values), max(values)
    return "".join(BLOCKS[round((v - lo) / (hi - lo) * (len(BLOCKS) - 1))] for v in values)


def _header(model: Dict[str, Any]) -> Text:
    d, disk = model["daemon"], model.get("disk")
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(model["time"]))
    text = Text.assemble(("snapd watch ", "bold"), model["root"], f"  {stamp}\n")
    if disk:
        text.append(f"disk free {si_bytes(disk['free'])} of {si_bytes(disk['total'])}   ")
    if not d["running"]:
        return text.append("daemon: not running", style="yellow")
    text.append(f"daemon pid {d['pid']}  cpu {number(d.get('cpu_percent'), '{:.1f}')}%  "
                f"rss {si_bytes(d.get('rss'))}")
    if not d["answering"]:
        return text.append("  (not answering on .snapd.sock)", style="red")
    text.append(f"  {count(d.get('clients') or 0, 'client')}")
    return text.append("  stopping" if d.get("stopping") else "", style="yellow")


def _table(title: str) -> Table:
    return Table(box=box.SIMPLE_HEAD, title=title, title_justify="left", pad_edge=False,
                 collapse_padding=True, title_style="bold", show_edge=False)


def _training_table(runs: List[Dict[str, Any]], points: int) -> Table:
    table = _table("training")
    for name in ("run", "rank", "step", "steps/s", "loss", "trend", "at risk", "cadence",
                 "last step"):
        table.add_column(name, justify="left" if name in ("run", "trend", "cadence")
                         else "right", no_wrap=name in ("run", "step", "trend"),
                         # a narrow terminal wraps the cadence, never cuts its bound
                         min_width=len("young-daly)") if name == "cadence" else None)
    for r in runs:
        table.add_row(r["run"], str(r["rank"]), number(r.get("step"), "{}"),
                      number(r.get("steps_per_s"), "{:.2f}"), number(r.get("loss")),
                      Text(sparkline(r.get("losses") or [], points), style="cyan"),
                      at_risk_text(r.get("at_risk"), r.get("at_risk_seconds")),
                      cadence_text(r.get("cadence")), age(r.get("step_age_s")) + " ago"
                      if r.get("step_age_s") is not None else "-")
    return table


def _stall(stall: Optional[Dict[str, float]]) -> str:
    if not stall:
        return "-"
    values = [stall[k] for k in ("last", "p50", "max")]
    if stall["max"] < 1:
        return "/".join(f"{v * 1000:.0f}" for v in values) + " ms"
    return "/".join(f"{v:.2f}" for v in values) + " s"


def _snapshot_table(runs: List[Dict[str, Any]]) -> Table:
    table = _table("snapshots")
    for name in ("run", "rank", "last committed", "stall last/p50/max", "skips/fails",
                 "kept", "LATEST", "BEST"):
        table.add_column(name, justify="right" if name in ("rank", "skips/fails", "kept")
                         else "left", no_wrap=name in ("run", "LATEST", "BEST"))
    for r in runs:
        last, ret = r.get("last_committed") or {}, r["retention"]
        when = f"{last.get('name') or ret['latest'] or '-'}"
        if r.get("committed_age_s") is not None:
            when += f"  {age(r['committed_age_s'])} ago"
        table.add_row(r["run"], str(r["rank"]), when, _stall(r.get("stall")),
                      f"{r.get('skipped', 0)}/{r.get('failed', 0)}", str(ret["committed"]),
                      ret["latest"] or "-", ret["best"] or "-")
    return table


def _flight_line(f: Dict[str, Any], width: int) -> Text:
    head = f"{f['run']} r{f['rank']} step {f['step']}  "
    if f["state"] == "queued":
        return Text(head + f"queued {age(f.get('queued_s'))} (waiting for the writer)")
    cells = max(10, min(40, width // 4))
    filled = round((f.get("fraction") or 0.0) * cells)
    bar = "█" * filled + "░" * (cells - filled)
    pct = "-" if f.get("fraction") is None else f"{f['fraction'] * 100:.0f}%"
    eta = "-" if f.get("eta_s") is None else age(f["eta_s"])
    rate = number(f.get("mb_s"), "{:.1f}")
    return Text.assemble(head, (bar, "green"), f" {pct}  {si_bytes(f['bytes_written'])} / "
                         f"{si_bytes(f['bytes_total'])}  {rate} MB/s  ETA {eta}")


def _history(runs: List[Dict[str, Any]]) -> List[Text]:
    lines = []
    for r in runs:
        who, resume, replay = f"{r['run']} r{r['rank']}: ", r["last_resume"], \
            r["last_replay"]
        if r.get("error"):
            lines.append(Text(who + "log unreadable: " + r["error"], style="red"))
        for damage in (r.get("log_damage") or [])[:1]:
            lines.append(Text(who + "log damaged, valid records shown: " + damage,
                              style="yellow"))
        cadence = cadence_line(r["run"], r["rank"], r.get("cadence"))
        if cadence:
            lines.append(Text(cadence))
        anomaly = r.get("last_anomaly")
        if anomaly:   # the newest in the log's tail; `snapd status` lists every pin
            lines.append(Text(f"{who}anomaly at step {anomaly['step']} ({anomaly['cause']}, "
                              f"value {anomaly['value']!r}); pinned "
                              f"{anomaly['pinned'] or 'nothing'}", style="yellow"))
        if resume:
            verdict = replay and f"; replay {replay['verdict']} at step {replay['step']}"
            phases = phases_text(r.get("resume_phases"))
            lines.append(Text(f"{who}resumed from {resume['snapshot']} ({resume['mode']}, "
                              f"{resume['recompute']} to recompute"
                              f"{'; ' + phases if phases else ''}){verdict or ''}"))
    return lines


def render(model: Dict[str, Any], width: int = 100) -> Group:
    """The whole view of one status model. Pure: same model, same text."""
    parts: List[Any] = [_header(model)]
    runs = model.get("runs") or []
    if not runs:
        parts.append(Text("no runs under this root yet"))
    else:
        # The training table's other columns take up to about 90 characters; the
        # trend gets what is left, so that a narrow terminal wraps the least.
        points = max(8, min(SPARK_POINTS, width - 90))
        parts += [Text(""), _training_table(runs, points), Text(""), _snapshot_table(runs)]
    jobs = [line for job in model.get("jobs") or [] for line in job_lines(job)]
    if jobs:
        parts += [Text(""), Text("ranks", style="bold")]
        parts += [Text(line, style="yellow" if "INCOMPLETE" in line else "")
                  for line in jobs]
    remote = remote_lines(model.get("remote"), model["time"])
    if remote:
        parts += [Text("")] + [Text(line, style="red" if "error" in line else "")
                               for line in remote]
    flights = model.get("in_flight") or []
    parts += [Text(""), Text("in flight" if flights else "in flight: none", style="bold")]
    parts += [_flight_line(f, width) for f in flights] + _history(runs)
    return Group(*parts, Text(model.get("refresh") or "", style="dim"))


# --- the refresh loop ----------------------------------------------------------------

def start_observer(root: str, wake: threading.Event) -> Any:
    """A watchdog observer setting ``wake`` on any change under root; None if it fails."""
    try:
        from watchdog.events import FileSystemEventHandler
        from watchdog.observers import Observer

        class _Wake(FileSystemEventHandler):
            def on_any_event(self, event: Any) -> None:
                if not str(event.src_path).endswith(SOCKET_NAME):
                    wake.set()

        observer = Observer()
        observer.schedule(_Wake(), root, recursive=True)
        observer.daemon = True
        observer.start()
        return observer
    except Exception:   # inotify limits, an unsupported filesystem: poll instead
        return None


def refresh_loop(root: str, tick: Callable[[Optional[Dict[str, Any]], str], bool], *,
                 interval: float = 1.0, debounce: float = 0.1, min_gap: float = 0.25
                 ) -> None:
    """Call ``tick(daemon_status, mode)`` on each change under root (debounced, and at
    most once per ``min_gap``) and at least every ``interval``, when the daemon is asked.
    ``mode`` is "events" or "polling" (watchdog failed). Stops when tick returns False."""
    probe, wake = DaemonProbe(root), threading.Event()
    observer = start_observer(root, wake)
    mode, status, polled = ("events" if observer else "polling"), None, -math.inf
    try:
        while True:
            if time.monotonic() - polled >= interval:
                status, polled = probe.status(), time.monotonic()
            if tick(status, mode) is False:
                return
            ticked = time.monotonic()
            remaining = max(0.0, interval - (ticked - polled))
            if wake.wait(remaining) if observer else time.sleep(remaining):
                # A burst of writes is one refresh; a busy log, one per min_gap at most.
                time.sleep(max(debounce, ticked + min_gap - time.monotonic()))
                wake.clear()
    finally:
        probe.close()
        if observer is not None:
            observer.stop()
            observer.join(timeout=2)
