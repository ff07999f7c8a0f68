"""The client's side of the state log: one record per step, lifecycle records, and the
replay proof after a resume. (``Client.journal`` is this object; the thing it writes is
the state log, docs/format.md: the format is :mod:`snapd.statelog`, the appending
:mod:`snapd.logwriter`.)

Replay proof: a resume from snapshot S of a run that had reached step R recomputes
the steps the interrupted run logged after S, up to R (step numbers need not be
contiguous: a loop that numbers its steps ``epoch * 1000 + batch`` recomputes the
steps it logged, not R - S of them). As the resumed run logs them again, each new
record is compared with the old one. The first difference names its
cause, checked in this order, because an earlier piece perturbs the later ones:

1. ``cursor``: the batch position differs (the data stream was not restored);
2. ``rng:<stream>``: that stream's digest differs (it was not restored, or the step
   drew a different number of values from it);
3. ``scalar:<name>``: the RNG streams and cursor match but a logged scalar (the loss)
   differs. The first suspect named is untracked state: a value the loop keeps
   outside every tracked object (a prefetched batch, a hidden state carried across
   batches, a learning rate set by hand, a best score), restored by nothing, so that
   the same batch and the same random draws meet another state. Numerical
   nondeterminism with identical inputs comes second: it is rarer on CPU, and the
   message must not send the user after kernels when a line of tracking fixes it.

Steps logged again in the range whose old record is damaged or missing cannot be
compared; the verdict counts them as ``missing`` rather than failing the replay.

Why the journal never raises a disk error once training runs: the log is a record of
training, not a condition of it. A record that cannot be written (a full disk) is
counted in ``dropped``, kept as ``last_error``, warned about once, and the next record
tries again; a snapshot's own failure reaches the user through its handle and close().
The start is the exception: the log's first segment (``ready``) and the resume record
(``resume``), written by restore(), raise InsufficientSpace when the disk is full. A
run started on a full disk could neither log nor snapshot, and learning that at its
first snapshot, hours later, would cost those hours.
"""

from __future__ import annotations

import threading
import time
import warnings
from typing import Any, Dict, List, Optional

from snapd.errors import InsufficientSpace, ReplayDivergence
from snapd.logwriter import LogWriter
from snapd.options import Options
from snapd.progress import expected_steps
from snapd.store import RunStore
from snapd_client.rng import RngStreams


# Resume times a resume record carries at most: enough for a mean time between
# failures, small enough for a record.
RESUME_HISTORY = 32
# The resume modes that continue the run after an interruption (a warm start does not).
CONTINUING = ("resume", "reshard")


def resume_times(record: Optional[Dict[str, Any]]) -> List[float]:
    """The times of a run's resumes up to ``record`` (a resume record), oldest first:
    its ``resumes``, or, from a record written before they were carried, its own
    time. A warm start begins a new lineage, and its history: none."""
    if not isinstance(record, dict) or record.get("mode") not in CONTINUING:
        return []
    carried = record.get("resumes")
    if isinstance(carried, list):
        return [float(t) for t in carried if _seconds(t)]
    return [float(record["time"])] if _seconds(record.get("time")) else []


def _resumed(record: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """The snapshot and step a record that follows a resume refers to."""
    return {k: record[k] for k in ("snapshot", "step") if record and k in record}


def _seconds(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class ReplayWarning(UserWarning):
    """A recomputed step differs from the interrupted run (replay_check='warn')."""


class LogWriteWarning(RuntimeWarning):
    """State-log records could not be written (a full disk); training went on."""


def compare(old: Dict[str, Any], new: Dict[str, Any]) -> Optional[tuple]:
    """(cause, detail) of the first difference between two step records, or None."""
    if old.get("cursor") != new.get("cursor"):
        return "cursor", f"cursor (epoch, batch) was {old.get('cursor')}, now {new.get('cursor')}"
    old_rng, new_rng = old.get("rng") or {}, new.get("rng") or {}
    for stream in sorted(set(old_rng) | set(new_rng)):
        if old_rng.get(stream) != new_rng.get(stream):
            return f"rng:{stream}", f"the {stream!r} random stream's digest differs"
    old_s, new_s = old.get("scalars") or {}, new.get("scalars") or {}
    for name in sorted(set(old_s) | set(new_s)):
        if old_s.get(name) != new_s.get(name):
            return (f"scalar:{name}", f"{name} was {old_s.get(name)!r}, now "
                    f"{new_s.get(name)!r} with identical RNG streams and cursor. "
                    + UNTRACKED_HINT)
    return None


# What a scalar difference with equal inputs most likely means, and the fix; then the
# rarer cause. The names are Client's ways to track what has no state_dict().
UNTRACKED_HINT = (
    "First suspect: untracked state, a value the loop keeps outside every tracked "
    "object (a prefetched batch, a hidden state carried across batches, a learning "
    "rate set by hand, a best score), which the resume did not restore. Track it: "
    "ckpt.values(name=...) for loop variables, ckpt.track_globals('X', ...) for a "
    "module-level script's globals, ckpt.track(name=tensor) for a tensor. If every "
    "such value is tracked: numerical nondeterminism (nondeterministic kernels, "
    "another thread or device count)")


class Journal:
    """Writes one rank's log records; checks replayed steps against the old ones."""

    def __init__(self, store: RunStore, rank: int, rng: RngStreams, opts: Options) -> None:
        self.store, self.rank, self.rng, self.opts = store, rank, rng, opts
        self.writer: Optional[LogWriter] = None  # opened at the first record, retried
        # Opened once: a restore with overlap may log from its background read
        # ("set_aside") while restore() logs the resume.
        self._opening = threading.Lock()
        self.dropped = 0  # records not written because the log's disk failed
        self.last_error: Optional[OSError] = None
        self._warned = False
        self._expected: Dict[int, Dict[str, Any]] = {}
        self._replay: Optional[Dict[str, Any]] = None
        self.verdict: Optional[Dict[str, Any]] = None
        self.last_resume: Optional[Dict[str, Any]] = None
        self.closed = False
        # Set by a multi-rank restore: a divergence then names the rank it is on.
        self.world_size = 1

    @staticmethod
    def record(rng: RngStreams, step: int, cursor: Optional[list], scalars: Dict[str, Any],
               samples: Optional[list] = None,
               unchecked: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        """One step's record (docs/format.md, "step"): what log() appends, and what
        snapd repro compares with the run's."""
        record = {"kind": "step", "step": step, "time": time.time(), "cursor": cursor,
                  "rng": rng.live_digests(),
                  "scalars": {k: float(v) for k, v in scalars.items()}}
        if samples is not None:
            record["samples"] = samples
        if unchecked:
            record["unchecked"] = {k: float(v) for k, v in unchecked.items()}
        return record

    def step(self, step: int, cursor: Optional[list], scalars: Dict[str, Any],
             samples: Optional[list] = None,
             unchecked: Optional[Dict[str, Any]] = None) -> None:
        record = self.record(self.rng, step, cursor, scalars, samples, unchecked)
        self._append(record)
        if self._replay is not None:
            self._check(record)

    def event(self, kind: str, **fields: Any) -> Dict[str, Any]:
        record = {"kind": kind, "time": time.time(), **fields}
        self._append(record)
        return record

    def ready(self) -> None:
        """Open the log and its segment now (directories and segment created and
        fsynced), so that the first record costs one write. A full disk raises
        InsufficientSpace (the run's start, see above); another disk error is left for
        the first record to meet and report."""
        try:
            self._writer().ready()
        except InsufficientSpace:
            raise
        except OSError:
            pass

    def _writer(self) -> LogWriter:
        with self._opening:
            if self.writer is None:
                self.writer = LogWriter(self.store.path, self.rank,
                                        segment_bytes=self.opts.log_segment_bytes,
                                        flush_interval=self.opts.log_flush_interval)
            return self.writer

    def _append(self, record: Dict[str, Any], at_start: bool = False) -> bool:
        """Write one record; a disk error drops it (counted, warned once), never raises,
        except a full disk ``at_start`` (see above)."""
        try:
            self._writer().append(record)
        except OSError as e:
            if at_start and isinstance(e, InsufficientSpace):
                raise
            self._dropped(e)
            return False
        return True

    def _dropped(self, error: OSError, records: int = 1) -> None:
        self.dropped, self.last_error = self.dropped + records, error
        if not self._warned:  # once, not at every step
            self._warned = True
            warnings.warn(LogWriteWarning(
                f"{self.store.path}/log: state-log record not written ({error}); training "
                "goes on and each later record tries again. Free space on that disk; "
                "Client.journal.dropped counts the records lost"), stacklevel=4)

    # --- replay proof ----------------------------------------------------------------

    def begin_replay(self, snapshot_step: int, reached: Optional[int]) -> int:
        """Load the old records of the steps to recompute (the logged steps after
        ``snapshot_step``, up to ``reached``); returns how many there are. They are
        checked as they are logged again, unless replay_check is "off"."""
        if reached is None or reached <= snapshot_step:
            return 0
        expected = expected_steps(self.store, self.rank, snapshot_step, reached)
        if self.opts.replay_check != "off":
            self._expected = expected
            self._replay = {"from": snapshot_step, "to": reached, "checked": 0,
                            "missing": 0}
        return len(expected)

    @property
    def checking(self) -> bool:
        """A replay check is armed: recomputed steps are being compared."""
        return self._replay is not None

    def _check(self, record: Dict[str, Any]) -> None:
        replay, step = self._replay, record["step"]
        old = self._expected.pop(step, None)
        if old is None and replay["from"] < step <= replay["to"]:
            replay["missing"] += 1   # logged again, but its old record is not valid
        if old is not None:
            replay["checked"] += 1
            found = compare(old, record)
            if found is not None:
                self._finish("diverged", step=step, cause=found[0], detail=found[1])
                where = f" on rank {self.rank}" if self.world_size > 1 else ""
                message = (f"replay check{where}: step {step} differs from the "
                           "interrupted run: "
                           f"{found[1]} (cause {found[0]}); the resumed run is not the "
                           "same run. See docs/operations.md, 'replay divergence'")
                if self.opts.replay_check == "raise":
                    raise ReplayDivergence(message, step=step, cause=found[0])
                warnings.warn(message, ReplayWarning, stacklevel=3)
                return
        if step >= replay["to"] or not self._expected:
            self._finish("match", step=step)

    def _finish(self, verdict: str, **fields: Any) -> None:
        replay, self._replay, self._expected = self._replay, None, {}
        self.verdict = self.event("replay", verdict=verdict, **{
            "from": replay["from"], "to": replay["to"], "checked": replay["checked"],
            **({"missing": replay["missing"]} if replay["missing"] else {}), **fields})

    def sync_soon(self) -> None:
        """Make the log durable promptly, without the caller waiting for the disk."""
        try:
            if self.writer is not None:
                self.writer.sync_soon()
        except OSError as e:  # a failed fsync: the records stay, their durability is late
            self._dropped(e, records=0)

    def resume(self, *, previous: Optional[Dict[str, Any]] = None,
               **fields: Any) -> Dict[str, Any]:
        """The resume record; kept, so that later committed records can carry it.
        Written at the run's start: a full disk raises InsufficientSpace (see above).

        A resume that continues the run (``mode`` "resume" or "reshard") also carries
        ``resumes``:
        the times of the run's resumes, ``previous``' (the run's last resume record,
        as read_progress found it) and this one's, the newest RESUME_HISTORY. The
        cadence learns the run's time between failures from them (resume_times) in
        one record, without reading the log back to its start."""
        now = time.time()
        record = {"kind": "resume", "time": now, **fields}
        if fields.get("mode") in CONTINUING:
            record["resumes"] = (resume_times(previous) + [now])[-RESUME_HISTORY:]
        self._append(record, at_start=True)
        self.last_resume = record
        return record

    def restored(self, *, objects: List[str], waited_s: float) -> None:
        """The "restored" record: the state a restore with overlap left to the
        background (``objects``, optimizers) is applied, before their first update;
        ``waited_s``: how long that update waited for it. The resume record kept for
        later commit records gets its time as ``restored``, so that status finds the
        phase in the commit record it stops at (snapd/progress.py)."""
        record = self.event("restored", objects=objects, waited_s=round(waited_s, 6),
                            **_resumed(self.last_resume))
        if self.last_resume is not None:
            self.last_resume = {**self.last_resume, "restored": record["time"]}

    def set_aside(self, *, snapshot: str, by: int, said: str) -> None:
        """The "set_aside" record: snapshot ``snapshot`` failed verification after
        restore(overlap=True) returned (on rank ``by``) and is out of the committed
        namespace; status no longer counts the log's commit record of it."""
        self.event("set_aside", snapshot=snapshot, by=by, said=said)

    @property
    def resume_times(self) -> List[float]:
        """The times of the run's resumes, oldest first, as this client's restore()
        logged them; empty on a fresh run or a warm start."""
        return resume_times(self.last_resume)

    def close(self) -> None:
        """Seal the log; a disk error here is kept in ``last_error``, not raised."""
        self.closed = True
        try:
            if self.writer is not None:
                self.writer.close()
        except OSError as e:
            self._dropped(e, records=0)
        if self.dropped:  # the one warning was long ago: the total, where it ends
            warnings.warn(LogWriteWarning(
                f"{self.store.path}/log: {self.dropped} state-log record(s) were not "
                f"written (last error: {self.last_error}); snapshots are unaffected, "
                "but the replay check after a resume cannot cover those steps"),
                stacklevel=3)
