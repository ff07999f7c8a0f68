"""A run's progress, read from the state log and the pointers without a tensor file.

A restarting trainer, ``snapd status`` and ``snapd watch`` all ask the same questions:
how far did training get, what is the last committed snapshot, how many updates (and
seconds of training) are at risk, what happened at the last resume, what interval the
snapshot cadence aims at. The answers come from the tail of each
rank's log (bounded reads, see statelog), from LATEST and from the names of the
committed snapshot directories, so they cost milliseconds whatever the length of the
run. What is committed is the directories' and LATEST's answer, not the log's: a
client killed right after a commit never logged it. Nor does the log's commit record
count for a snapshot a later "set_aside" record names (its optimizer state failed
verification after restore(overlap=True) returned: it is no longer committed).

Why reading progress never fails on the log: resuming needs a snapshot, and the
snapshot is chosen from the snapshot directories and LATEST. The log only adds how far
training got and the records the replay check compares, so a damaged log yields a
report from its valid records, with the damage listed in ``log_damage`` (and warned
about by the readers), never an error. It is a report, not a plan: restore decides.
"""

from __future__ import annotations

import os
from contextlib import closing, suppress
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

from snapd import statelog
from snapd.store import RunStore, SnapshotId


def _number(value: Any) -> Optional[float]:
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


@dataclass
class RunProgress:
    """What the log and pointers say about one (run, rank): how far it got, what is
    committed, what is at risk, the last resume and replay."""

    run: str
    rank: int
    reached: Optional[int] = None             # last step logged (see ``furthest``)
    reached_time: Optional[float] = None
    steps_per_s: Optional[float] = None
    last_committed: Optional[Dict[str, Any]] = None   # the log's last committed record
    latest: Optional[str] = None              # the LATEST pointer
    newest_dir: Optional[str] = None          # the newest committed snapshot directory
    newest_dir_time: Optional[float] = None   # (not refused at the last resume), its mtime
    last_resume: Optional[Dict[str, Any]] = None
    last_replay: Optional[Dict[str, Any]] = None
    # The newest "anomaly" record among those read (snapd_client/anomaly.py); the
    # pins (snapd/pins.py) keep every anomaly that pinned a snapshot.
    last_anomaly: Optional[Dict[str, Any]] = None
    last_scalars: Dict[str, Any] = field(default_factory=dict)
    at_risk_seconds: Optional[float] = None   # training since the committed step
    cadence: Optional[Dict[str, Any]] = None  # the newest cadence record's decision
    # The "restored" record of the last resume (restore(overlap=True): its optimizer
    # state applied), and the snapshots the log says were set aside since the newest
    # commit record that counts: their commit records do not.
    last_restored: Optional[Dict[str, Any]] = None
    set_aside: List[str] = field(default_factory=list)
    bytes_read: int = 0
    log_damage: List[str] = field(default_factory=list)  # what the readers skipped

    @property
    def committed(self) -> Optional[SnapshotId]:
        """The newest committed snapshot: the directories and LATEST win over the log,
        whose record of a commit is lost when the client dies right after it (and a
        damaged log may have lost it too); the log's record counts when retention has
        deleted the directory since. Ordered as snapshots are, by (lineage, step)."""
        logged = (self.last_committed or {}).get("name")
        gone = self.refused | set(self.set_aside)
        found = [SnapshotId.parse(n) for n in (self.newest_dir, self.latest, logged)
                 if isinstance(n, str) and n not in gone]
        return max((sid for sid in found if sid is not None), default=None)

    @property
    def refused(self) -> set:
        """Snapshots the last resume refused as damaged: they stay on disk until a
        new snapshot needs the name, and are not what a restore would load."""
        refused = (self.last_resume or {}).get("refused")
        return {n for n in refused if isinstance(n, str)} \
            if isinstance(refused, (dict, list)) else set()

    @property
    def committed_step(self) -> Optional[int]:
        committed = self.committed
        if committed is not None:
            return committed.step
        step = (self.last_committed or {}).get("step")   # a record without a name
        return step if type(step) is int else None

    @property
    def committed_time(self) -> Optional[float]:
        """When the newest committed snapshot was committed: the log's record of it,
        else its directory's modification time (its manifest was written last)."""
        record = self.last_committed or {}
        if self.committed is not None and record.get("name") == self.committed.name:
            return _number(record.get("time"))
        if self.committed is not None and self.committed.name == self.newest_dir:
            return self.newest_dir_time
        return _number(record.get("time"))

    @property
    def furthest(self) -> Optional[int]:
        """The furthest step this run has logged: what a resume recomputes up to and
        checks against, and what its resume line says training had reached.

        ``reached`` (the last step logged) is less after a resume that was itself
        killed during its recompute: the log then ends at a recomputed step, while
        the run had got further before the first kill. The resume record keeps that
        step (its ``reached``, computed the same way, so it holds across any number
        of kills); a warm start begins a new lineage at step 0 and carries none.
        """
        resume = self.last_resume or {}
        carried = resume.get("reached") if resume.get("mode") == "resume" else None
        steps = [s for s in (self.reached, carried) if type(s) is int]
        return max(steps, default=None)

    @property
    def at_risk(self) -> Optional[int]:
        """Updates done since the newest committed snapshot: lost if the run died now."""
        if self.reached is None:
            return None
        return max(0, self.reached - (self.committed_step or 0))

    @property
    def resume_phases(self) -> Optional[Dict[str, Any]]:
        """The last resume's phases (docs/operations.md, "Restore with overlap"):
        ``started`` (restore() called), ``ready`` (it returned: training may run),
        ``optimizer_state`` (every optimizer's state applied: at ``ready`` without
        overlap), each a time, with ``state`` "complete", "pending" (not applied yet, or
        the process ended before its first step) or "failed" (set aside)."""
        resume = self.last_resume
        if not resume or resume.get("mode") not in ("resume", "reshard"):
            return None
        overlap = resume.get("overlap") is True
        started, ready = _number(resume.get("called")), _number(resume.get("time"))
        complete = ready if not overlap else _number(resume.get("restored"))
        restored = self.last_restored or {}
        if complete is None and restored.get("snapshot") == resume.get("snapshot"):
            complete = _number(restored.get("time"))
        state = "complete" if complete is not None else \
            "failed" if resume.get("snapshot") in self.set_aside else "pending"
        return {"overlap": overlap, "started": started, "ready": ready,
                "optimizer_state": complete, "state": state,
                "ready_s": _since(started, ready), "complete_s": _since(started, complete)}

    def to_json(self) -> Dict[str, Any]:
        out = asdict(self)
        if out["last_committed"]:
            out["last_committed"] = {k: v for k, v in out["last_committed"].items()
                                     if k not in ("rng", "cursor")}
        committed = self.committed
        out.update(committed=committed.name if committed else None,
                   committed_step=self.committed_step, committed_time=self.committed_time,
                   at_risk=self.at_risk, resume_phases=self.resume_phases)
        return out


def _since(start: Optional[float], end: Optional[float]) -> Optional[float]:
    return None if start is None or end is None else max(0.0, end - start)


def _rate(records: List[Dict[str, Any]]) -> Optional[float]:
    steps = [r for r in records if _number(r.get("time")) is not None]
    if len(steps) < 2 or steps[-1]["time"] <= steps[0]["time"]:
        return None
    return (steps[-1]["step"] - steps[0]["step"]) / (steps[-1]["time"] - steps[0]["time"])


# The fields of a "cadence" record that say what the cadence decided (docs/operations.md,
# "Snapshot cadence"): what status and watch show of it.
CADENCE_FIELDS = ("interval_s", "interval_steps", "bound", "expected_loss_s", "mtbf_s",
                  "mtbf_from")
STEP_SAMPLES = 64        # step records the step rate is measured over
PAST_COMMIT = 4096       # records read past the newest commit record, at most, to find
#                          the committed step's own records


class _Walk:
    """What one backward pass over a rank's log collects, and when it may stop.

    It stops once it has the newest committed-snapshot record, a short tail of step
    records for the rate, and has gone past that snapshot's step: the records logged
    when the snapshot was taken (its step record, its "staged" and "cadence" records)
    lie just before the commit record, behind the steps trained while it was written.
    """

    def __init__(self, progress: RunProgress) -> None:
        self.progress = progress
        self.steps: List[Dict[str, Any]] = []     # newest first
        self.step_time: Dict[int, float] = {}     # step -> when training was there
        self.committed_at: Optional[int] = None   # index of the commit record
        self.passed = False                       # a step before the committed one seen
        self.oldest_time: Optional[float] = None  # of the oldest record read
        self.exhausted = False                    # the whole log was read

    def take(self, i: int, record: Dict[str, Any]) -> None:
        progress, kind = self.progress, record.get("kind")
        at = _number(record.get("time"))
        self.oldest_time = self.oldest_time if at is None else at
        self._note_step_time(record)
        if statelog.is_step(record) and len(self.steps) < STEP_SAMPLES:
            self.steps.append(record)
        elif kind == "resume" and progress.last_resume is None:
            progress.last_resume = record
        elif kind == "replay" and progress.last_replay is None:
            progress.last_replay = record
        elif kind == "anomaly" and progress.last_anomaly is None:
            progress.last_anomaly = record
        elif kind == "cadence" and progress.cadence is None:
            progress.cadence = _cadence(record)
        elif kind == "restored" and progress.last_resume is None \
                and progress.last_restored is None:   # after the resume it completes
            progress.last_restored = record
        elif kind == "set_aside" and progress.last_committed is None \
                and isinstance(record.get("snapshot"), str):
            progress.set_aside.append(record["snapshot"])
        elif kind == "snapshot" and record.get("event") == "committed" \
                and progress.last_committed is None \
                and record.get("name") not in progress.set_aside:
            progress.last_committed, self.committed_at = record, i
            progress.last_resume = progress.last_resume or _map(record.get("last_resume"))
            progress.last_replay = progress.last_replay or _map(record.get("last_replay"))
        committed_step = (progress.last_committed or {}).get("step")
        if statelog.is_step(record) and type(committed_step) is int \
                and record["step"] < committed_step:
            self.passed = True

    def _note_step_time(self, record: Dict[str, Any]) -> None:
        """When training was at a step: its step record, or the "staged" record of a
        snapshot taken there; the newest wins (a replayed step's, the run that went
        on). Only the records near the tail, where the committed step's are."""
        step, at = record.get("step"), _number(record.get("time"))
        staged = record.get("kind") == "snapshot" and record.get("event") == "staged"
        if type(step) is int and at is not None and (statelog.is_step(record) or staged) \
                and len(self.step_time) < PAST_COMMIT:
            self.step_time.setdefault(step, at)

    def done(self, i: int) -> bool:
        if self.committed_at is None or (len(self.steps) < STEP_SAMPLES and i <= 256):
            return False
        return self.passed or i > self.committed_at + PAST_COMMIT


def read_progress(store: RunStore, rank: int = 0) -> RunProgress:
    """Read the log tail and LATEST of one rank; never opens a tensor file.

    One backward pass, which stops just past the newest committed-snapshot record (see
    _Walk): that record carries the resume and replay records that preceded it, so the
    bytes read are those logged since the snapshot was taken (plus a short tail for the
    step rate), never the log.
    """
    stats = statelog.IOStats()
    progress = RunProgress(store.run, rank)
    latest = store.read_pointer("LATEST")
    progress.latest = latest.name if latest else None
    walk = _Walk(progress)
    with closing(statelog.newest_first(store.path, rank, stats)) as records:
        for i, record in enumerate(records):
            walk.take(i, record)
            if walk.done(i):
                break
        else:
            walk.exhausted = True
    if walk.steps:
        newest = walk.steps[0]
        progress.reached, progress.reached_time = newest["step"], _number(newest.get("time"))
        progress.last_scalars = _map(newest.get("scalars")) or {}
    progress.steps_per_s = _rate(walk.steps[::-1])
    _newest_dir(store, progress)
    progress.at_risk_seconds = _at_risk_seconds(store, progress, walk, stats)
    progress.bytes_read, progress.log_damage = stats.bytes_read, list(stats.damage)
    return progress


def _at_risk_seconds(store: RunStore, progress: RunProgress, walk: _Walk,
                     stats: statelog.IOStats) -> Optional[float]:
    if progress.committed_step is None:   # nothing committed: since the run's start
        start = walk.oldest_time if walk.exhausted else None
    else:
        start = walk.step_time.get(progress.committed_step)
    return at_risk_seconds(store, progress.rank, progress.at_risk, progress.committed_step,
                           progress.reached_time, progress.last_resume, start=start,
                           stats=stats)


def at_risk_seconds(store: RunStore, rank: int, at_risk: Optional[int],
                    since_step: Optional[int], reached_time: Optional[float],
                    last_resume: Optional[Dict[str, Any]], *, start: Optional[float] = None,
                    stats: Optional[statelog.IOStats] = None) -> Optional[float]:
    """Seconds of training at risk: from when training was at ``since_step`` (the
    committed snapshot's) to ``reached_time`` (the last step logged). ``start``: that
    moment when the caller read it; else the step's record, found by bisection
    (statelog.find_step: the write was long, or the directories know a snapshot the
    log's tail does not). A resume since restarts the count: the time the run was down
    is not training. None when the log does not say (no times, the records lost)."""
    if at_risk is None or reached_time is None:
        return None
    if at_risk == 0:
        return 0.0
    if start is None and since_step is not None:
        record = statelog.find_step(store.path, rank, since_step, stats=stats)
        start = _number(record.get("time")) if record else None
    if start is None:
        return None
    resumed = _number((last_resume or {}).get("time"))
    return max(0.0, reached_time - max(start, resumed or start))


def _cadence(record: Dict[str, Any]) -> Dict[str, Any]:
    """The decision a "cadence" record carries; a field of the wrong type (a hostile
    edit, another version) reads as unknown, never as an error."""
    out: Dict[str, Any] = {}
    for name in CADENCE_FIELDS:
        value = record.get(name)
        if name == "interval_steps":
            out[name] = value if type(value) is int else None
        elif name in ("bound", "mtbf_from"):
            out[name] = value if isinstance(value, str) else None
        else:
            out[name] = _number(value)
    return out


def _newest_dir(store: RunStore, progress: RunProgress) -> None:
    """The newest committed directory the last resume did not refuse (nor the log
    say was set aside), and its mtime."""
    refused = progress.refused | set(progress.set_aside)
    for sid in reversed(store.committed()):
        if sid.name in refused:
            continue
        progress.newest_dir = sid.name
        with suppress(OSError):   # deleted by retention meanwhile: the name still counts
            progress.newest_dir_time = os.stat(store.snapshot_path(sid)).st_mtime
        return


def _map(value: Any) -> Optional[Dict[str, Any]]:
    return dict(value) if isinstance(value, dict) else None


def expected_steps(store: RunStore, rank: int, after: int, upto: int) -> Dict[int, Dict]:
    """The newest step record of each step in (after, upto]: what a replay must match.

    Read newest first, so that where a step was logged twice (an earlier replay) the
    later record, from the run that actually continued, wins. Cost: the records since
    ``after``, not the log.
    """
    found: Dict[int, Dict] = {}
    for record in statelog.newest_first(store.path, rank):
        if not statelog.is_step(record):  # a step that is no int (a hostile edit) too
            continue
        step = record["step"]
        if step <= after:
            break
        if step <= upto:
            found.setdefault(step, record)
    return found
