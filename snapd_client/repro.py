"""The training process's side of ``snapd repro``: recompute one logged step of a run,
read-only, check every recomputed step against the run's log, and write the state
after it as a snapshot of a new run.

``snapd repro ROOT RUN@STEP -- <command>`` (snapd/commands/repro.py) runs the user's
own command with ``SNAPD_REPRO`` in its environment: a JSON map with ``root``, ``run``,
``step`` (the step after which the state is written: STEP, or STEP - 1 with
``--before``), ``count`` (``--steps K``: the states after K steps from there),
``out`` (the run written to) and ``report`` (a file outside the root for the
outcome). The
:class:`~snapd_client.client.Client` of that root and run then

1. opens the run read-only (``read_only=True``, ``daemon=False``): no writer lock, no
   log record, no daemon, no pull; snapshot() takes nothing. The run may be training
   beside it;
2. restore() puts back the newest snapshot of a step at or before STEP (LATEST
   aside), or nothing when there is none (a recompute from the script's start);
3. each log() of a step after the snapshot is compared with the run's record of that
   step, as a resume's replay check does (snapd_client/journal.py's ``compare``:
   cursor, then each RNG stream's digest, then each scalar). The first difference
   raises :class:`~snapd.errors.ReplayDivergence` naming the step and the field, and
   nothing is written;
4. at log(STEP), once it matched, the full tracked state (objects, every RNG stream,
   the cursor) is written as a snapshot of run ``out`` (``RUN.repro-STEP``), lineage mode
   "repro" with the start snapshot as parent (with ``count`` K, at each of the K steps
   from STEP, each checked first); after the last, the outcome goes to the report file
   and the process ends at once (``os._exit(0)``): the command's own code after the
   loop (its saves, its exports) never runs, so it writes nothing either.

A STEP that is the start snapshot's own step needs no recompute: restore() writes the
state (and, with nothing after it to write, ends the process).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any, Dict, List, Optional

from snapd.commit import CommitService
from snapd.errors import InvalidOption, ReplayDivergence
from snapd.options import Options
from snapd.progress import expected_steps
from snapd.retention import apply_retention
from snapd.store import RunStore
from snapd.writer import write_snapshot
from snapd_client.journal import compare

VARIABLE = "SNAPD_REPRO"




def requested(root: str, run: str, environ=None) -> Optional["Repro"]:
    """The reproduction ``SNAPD_REPRO`` asks of the client of ``root`` and ``run``, or
    None (not set, or set for another root or run)."""
    raw = (os.environ if environ is None else environ).get(VARIABLE)
    if not raw:
        return None
    try:
        asked = json.loads(raw)
        target = (os.path.realpath(asked["root"]), asked["run"], int(asked["step"]),
                  str(asked["out"]), asked["report"], int(asked.get("count", 1)))
    except (ValueError, KeyError, TypeError) as e:
        raise InvalidOption(f"environment variable {VARIABLE}={raw!r}: not the map snapd "
                            f"repro sets ({e}); unset it to train", field=VARIABLE) from e
    if target[:2] != (os.path.realpath(root), run):
        return None
    return Repro(*target)


class Repro:
    """One reproduction: where it started, what it checked, and its end."""

    def __init__(self, root: str, run: str, step: int, out: str, report: str,
                 count: int = 1) -> None:
        self.root, self.run, self.step, self.out, self.report = root, run, step, out, report
        self.last = step + count - 1   # --steps K: every step from STEP to STEP+K-1
        self.store = RunStore(root, run)
        self.start: Optional[Dict[str, Any]] = None   # {snapshot, step} or None: fresh
        self.start_step = 0
        self._expected: Dict[int, Dict[str, Any]] = {}
        self.checked = 0
        self.missing = 0
        self.written: List[str] = []   # the snapshots of the new run, in order
        self._commits: Optional[CommitService] = None

    def begin(self, client: Any, snapshot: Optional[str], step: int) -> None:
        """Restore chose ``snapshot`` (of ``step``; None: nothing, step 0): load the
        run's records of the steps to recompute; at STEP already, write (and, with
        nothing after it to write, end)."""
        self.start = {"snapshot": snapshot, "step": step} if snapshot else None
        self.start_step = step
        self._expected = expected_steps(self.store, client.rank, step, self.last)
        if self.last not in self._expected and step != self.last:
            self._fail(f"{self.store.path}/log: the run's log holds no record of step "
                       f"{self.last} (rank {client.rank}) to check it against; choose a "
                       "logged step (snapd batch RUN STEP tells)", step=self.last,
                       cause="log")
        if step == self.step:
            self._reached(client, step)

    def log(self, client: Any, record: Dict[str, Any]) -> None:
        """A recomputed step's record: checked; from STEP on, its state written."""
        step = record["step"]
        if step > self.last or (step > self.step and not self.written):
            self._fail(f"repro of run {self.run}: the command logged step {step} without "
                       f"logging step {self.step if not self.written else self.last}",
                       step=step, cause="step")
        old = self._expected.pop(step, None)
        if old is None:
            self.missing += 1   # logged now, but the run's record of it is damaged
        else:
            self.checked += 1
            found = compare(old, record)
            if found is not None:
                self._fail(f"repro of run {self.run}: step {step} differs from the run's "
                           f"log: {found[1]} (cause {found[0]}); {self._kept()}. "
                           "The command, its data or its environment is not the one "
                           "that ran (docs/operations.md, 'Reproducing a step')",
                           step=step, cause=found[0])
        if step >= self.step:
            self._reached(client, step)

    def _kept(self) -> str:
        if not self.written:
            return "nothing was written"
        return (f"the states of the steps before it matched and are in run {self.out}: "
                + ", ".join(os.path.basename(p) for p in self.written))

    def _reached(self, client: Any, step: int) -> None:
        self.write(client, step)
        if step >= self.last:
            self.finish()

    def write(self, client: Any, step: int) -> None:
        """The state as it is now (after ``step``), committed as a snapshot of the new
        run, lineage mode "repro", parent the start snapshot."""
        parent = None if self.start is None else {"run": self.run, **self.start}
        capture = dataclasses.replace(
            client.capture(step), run=self.out,
            lineage={"id": 0, "mode": "repro", "parent": parent})
        store = RunStore(self.root, self.out)
        store.ensure()
        options = Options.resolve({"daemon": False}).replace(
            keep_last=None, keep_every=None, keep_best=0)
        if self._commits is None:
            self._commits = CommitService(self.root, options.min_free_bytes,
                                          writer=write_snapshot, retain=apply_retention)
        done = self._commits.commit(store, capture.plan_in_memory(), options)
        done.purge()
        self.written.append(store.snapshot_path(capture.sid))

    def finish(self) -> None:
        """Report and end the process: the command's code after the loop never runs."""
        self._report({"ok": True, "run": self.run, "step": self.step, "last": self.last,
                      "start": self.start, "recomputed": self.checked + self.missing,
                      "checked": self.checked, "missing": self.missing,
                      "repro_run": self.out, "snapshot": self.written[0],
                      "snapshots": self.written})
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    def _fail(self, message: str, *, step: int, cause: str) -> None:
        self._report({"ok": False, "run": self.run, "step": step, "cause": cause,
                      "error": message, "checked": self.checked})
        raise ReplayDivergence(message, step=step, cause=cause)

    def _report(self, outcome: Dict[str, Any]) -> None:
        tmp = f"{self.report}.tmp"
        with open(tmp, "w") as f:
            json.dump(outcome, f)
        os.replace(tmp, self.report)
