"""A run's progress, read from the state log and the pointers without a tensor file.

A restarting trainer, ``snapd status`` and ``snapd watch`` all ask the same questions:
how far did training get, what is the last committed snapshot, how many updates are
at risk, what happened at the last resume. The answers come from the tail of each
rank's log (bounded reads, see statelog), from LATEST and from the names of the
committed snapshot directories, so they cost milliseconds whatever the length of the
run. What is committed is the directories' and LATEST's answer, not the log's: a
client killed right after a commit never logged it.

Why reading progress never fails on the log: resuming needs a snapshot, and the
snapshot is chosen from the snapshot directories and LATEST. The log only adds how far
training got and the records the replay check compares, so a damaged log yields a
report from its valid records, with the damage listed in ``log_damage`` (and warned
about by the readers), never an error. It is a report, not a plan: restore decides.
"""

from __future__ import annotations

import os
from contextlib import suppress
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
    last_scalars: Dict[str, Any] = field(default_factory=dict)
    bytes_read: int = 0
    log_damage: List[str] = field(default_factory=list)  # what the readers skipped

    @property
    def committed(self) -> Optional[SnapshotId]:
        """The newest committed snapshot: the directories and LATEST win over the log,
        whose record of a commit is lost when the client dies right after it (and a
        damaged log may have lost it too); the log's record counts when retention has
        deleted the directory since. Ordered as snapshots are, by (lineage, step)."""
        logged = (self.last_committed or {}).get("name")
        found = [SnapshotId.parse(n) for n in (self.newest_dir, self.latest, logged)
                 if isinstance(n, str) and n not in self.refused]
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

    def to_json(self) -> Dict[str, Any]:
        out = asdict(self)
        if out["last_committed"]:
            out["last_committed"] = {k: v for k, v in out["last_committed"].items()
                                     if k not in ("rng", "cursor")}
        committed = self.committed
        out.update(committed=committed.name if committed else None,
                   committed_step=self.committed_step, committed_time=self.committed_time,
                   at_risk=self.at_risk)
        return out


def _rate(records: List[Dict[str, Any]]) -> Optional[float]:
    steps = [r for r in records if _number(r.get("time")) is not None]
    if len(steps) < 2 or steps[-1]["time"] <= steps[0]["time"]:
        return None
    return (steps[-1]["step"] - steps[0]["step"]) / (steps[-1]["time"] - steps[0]["time"])


def read_progress(store: RunStore, rank: int = 0) -> RunProgress:
    """Read the log tail and LATEST of one rank; never opens a tensor file.

    One backward pass, which stops at the newest committed-snapshot record: that record
    carries the resume and replay records that preceded it, so the bytes read are those
    logged since the last commit (plus a short tail for the step rate), never the log.
    """
    stats = statelog.IOStats()
    progress = RunProgress(store.run, rank)
    latest = store.read_pointer("LATEST")
    progress.latest = latest.name if latest else None
    steps: List[Dict[str, Any]] = []
    for i, record in enumerate(statelog.newest_first(store.path, rank, stats)):
        kind = record.get("kind")
        if statelog.is_step(record) and len(steps) < 64:
            steps.append(record)
        elif kind == "resume" and progress.last_resume is None:
            progress.last_resume = record
        elif kind == "replay" and progress.last_replay is None:
            progress.last_replay = record
        elif kind == "snapshot" and record.get("event") == "committed" \
                and progress.last_committed is None:
            progress.last_committed = record
            progress.last_resume = progress.last_resume or _map(record.get("last_resume"))
            progress.last_replay = progress.last_replay or _map(record.get("last_replay"))
        if progress.last_committed is not None and (len(steps) >= 64 or i > 256):
            break
    if steps:
        progress.reached, progress.reached_time = steps[0]["step"], _number(steps[0].get("time"))
        progress.last_scalars = _map(steps[0].get("scalars")) or {}
    progress.steps_per_s = _rate(steps[::-1])
    _newest_dir(store, progress)
    progress.bytes_read, progress.log_damage = stats.bytes_read, list(stats.damage)
    return progress


def _newest_dir(store: RunStore, progress: RunProgress) -> None:
    """The newest committed directory the last resume did not refuse, and its mtime."""
    refused = progress.refused
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
