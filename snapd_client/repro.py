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

Many ranks (the command under ``torchrun``, the world size the run had at STEP: any
other is refused, field ``world_size``): every rank does the above against its own
rank's log, and restore() agrees on one snapshot at or before STEP
(snapd_client/distrestore.py). At each recomputed step the ranks exchange their
verdicts over a private gloo group before anything is written, so a divergence on one
rank stops every rank with the same ReplayDivergence naming that rank, and nothing is
written. At STEP each rank writes its part of one snapshot of run ``out`` (the
session restore agreed on), the part that completes the set commits it globally
(snapd/globalcommit.py), and the ranks meet once more so that none reports before
the snapshot is committed. Each rank writes its outcome to ``<report>.rank-R``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any, Dict, List, Optional

from snapd import statelog
from snapd.commit import CommitService
from snapd.errors import IncompleteSnapshot, InvalidOption, ReplayDivergence, SnapdError
from snapd.options import Options
from snapd.progress import expected_steps
from snapd.retention import apply_retention
from snapd.store import RunStore
from snapd.writer import write_snapshot
from snapd_client.journal import compare
from snapd_client.ranks import Collective, GlooGroup

VARIABLE = "SNAPD_REPRO"

Problem = Optional[Dict[str, Any]]   # {"message", "step", "cause"}: why a step stops


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
        self.rank, self.world_size = 0, 1
        self._ranks: Optional[Collective] = None   # many ranks: their verdicts, each step

    def on_ranks(self, rank: int, world_size: int,
                 ranks: Optional[Collective] = None) -> None:
        """The command's rank and world size, refused (InvalidOption, field
        ``world_size``) when the run did not log STEP on exactly that many ranks: a
        reproduction is exact at the run's own world size only. ``ranks``: what the
        ranks exchange their verdicts over (default: a private gloo group, made when
        the recompute begins)."""
        self.rank, self.world_size, self._ranks = rank, world_size, ranks
        logged = [r for r in statelog.list_ranks(self.store.path)
                  if statelog.find_step(self.store.path, r, self.step) is not None]
        if logged and logged != list(range(world_size)):
            self.refuse(f"snapd repro of run {self.run!r} at world size {world_size} "
                        f"(rank {rank}): the run logged step {self.step} on "
                        f"{len(logged)} rank(s) ({', '.join(map(str, logged))}), and a "
                        "step is reproduced exactly only at the run's own world size: "
                        f"run the command on {len(logged)} rank(s) (torchrun "
                        f"--nproc-per-node {len(logged)}, or without torchrun for one)",
                        field="world_size")

    def begin(self, client: Any, snapshot: Optional[str], step: int) -> None:
        """Restore chose ``snapshot`` (of ``step``; None: nothing, step 0): load the
        run's records of the steps to recompute; at STEP already, write (and, with
        nothing after it to write, end)."""
        self.start = {"snapshot": snapshot, "step": step} if snapshot else None
        self.start_step = step
        if self.world_size > 1 and self._ranks is None:
            self._ranks = GlooGroup()   # collective: every rank is here, after restore
        self._expected = expected_steps(self.store, self.rank, step, self.last)
        problem = None
        if self.last not in self._expected and step != self.last:
            problem = {"message": f"{statelog.rank_dir(self.store.path, self.rank)}: the "
                                  f"run's log holds no record of step {self.last} (rank "
                                  f"{self.rank}) to check it against; choose a logged step "
                                  "(snapd batch RUN STEP tells)",
                       "step": self.last, "cause": "log"}
        self._stop_if(self._agree(problem))
        if step == self.step:
            self._reached(client, step)

    def log(self, client: Any, record: Dict[str, Any]) -> None:
        """A recomputed step's record: checked (on many ranks, every rank's verdict
        heard first); from STEP on, its state written."""
        step = record["step"]
        self._stop_if(self._agree(self._check(step, record)))
        if step >= self.step:
            self._reached(client, step)

    def _check(self, step: int, record: Dict[str, Any]) -> Problem:
        """Why recomputed ``step`` stops the reproduction on this rank, or None."""
        if step > self.last or (step > self.step and not self.written):
            return {"message": f"repro of {self._who()}: the command logged step {step} "
                               "without logging step "
                               f"{self.step if not self.written else self.last}",
                    "step": step, "cause": "step"}
        old = self._expected.pop(step, None)
        if old is None:
            self.missing += 1   # logged now, but the run's record of it is damaged
            return None
        self.checked += 1
        found = compare(old, record)
        if found is None:
            return None
        return {"message": f"repro of {self._who()}: step {step} differs from the "
                           f"run's log{self._whose()}: {found[1]} (cause {found[0]}); "
                           f"{self._kept()}. The command, its data or its environment "
                           "is not the one that ran (docs/operations.md, 'Reproducing "
                           "a step')",
                "step": step, "cause": found[0]}

    def _who(self) -> str:
        return f"run {self.run}" + (f", rank {self.rank}" if self.world_size > 1 else "")

    def _whose(self) -> str:
        return f" (rank {self.rank}'s)" if self.world_size > 1 else ""

    def _agree(self, problem: Problem) -> Problem:
        """One rank: ``problem``. Many: the lowest rank's problem, on every rank (each
        rank's verdict exchanged), so that all stop together, before any writes."""
        if self._ranks is None:
            return problem
        heard = [json.loads(v) for v in
                 self._ranks.allgather_bytes(json.dumps(problem).encode())]
        return next((p for p in heard if p is not None), None)

    def _stop_if(self, problem: Problem) -> None:
        if problem is not None:
            self._fail(problem["message"], step=problem["step"], cause=problem["cause"])

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
        run, lineage mode "repro", parent the start snapshot; on many ranks this
        rank's part, and back only once every rank's is there and the snapshot is
        committed."""
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
        try:
            done = self._commits.commit(store, capture.plan_in_memory(), options)
            done.purge()
            failed = None
        except SnapdError as e:
            if self._ranks is None:
                raise
            failed = f"rank {self.rank}: {type(e).__name__}: {e}"
        self._all_written(store, capture.sid, failed)
        self.written.append(store.snapshot_path(capture.sid))

    def _all_written(self, store: RunStore, sid: Any, failed: Optional[str]) -> None:
        """Many ranks: wait for every rank's part; every rank raises when one failed,
        or when the snapshot is not committed after all (it never is without every
        part: snapd/globalcommit.py)."""
        if self._ranks is None:
            return
        heard = [json.loads(v) for v in
                 self._ranks.allgather_bytes(json.dumps(failed).encode())]
        errors = [h for h in heard if h is not None]
        final = store.snapshot_path(sid)
        if errors or not os.path.isdir(final):
            message = (f"{store.parts_path(sid)}: repro of {self._who()}: the state after "
                       f"step {sid.step} is not committed: "
                       + ("; ".join(errors) or "a part is missing") + "; the parts written "
                       f"are never restored (remove run {self.out} to try again)")
            self._report({"ok": False, "run": self.run, "step": sid.step,
                          "cause": "parts", "error": message, "type": "IncompleteSnapshot",
                          "checked": self.checked})
            raise IncompleteSnapshot(message, path=store.parts_path(sid), field="parts")

    def finish(self) -> None:
        """Report and end the process: the command's code after the loop never runs."""
        self._report({"ok": True, "run": self.run, "step": self.step, "last": self.last,
                      "start": self.start, "recomputed": self.checked + self.missing,
                      "checked": self.checked, "missing": self.missing,
                      "repro_run": self.out, "snapshot": self.written[0],
                      "snapshots": self.written, "rank": self.rank,
                      "world_size": self.world_size})
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    def refuse(self, message: str, *, field: str) -> None:
        """A reproduction that cannot be done: reported, and InvalidOption raised."""
        self._report({"ok": False, "run": self.run, "step": self.step, "cause": field,
                      "error": message, "type": "InvalidOption", "checked": self.checked})
        raise InvalidOption(message, field=field)

    def _fail(self, message: str, *, step: int, cause: str) -> None:
        self._report({"ok": False, "run": self.run, "step": step, "cause": cause,
                      "error": message, "type": "ReplayDivergence",
                      "checked": self.checked})
        raise ReplayDivergence(message, step=step, cause=cause)

    def _report(self, outcome: Dict[str, Any]) -> None:
        """The outcome for snapd repro: ``report``, or ``<report>.rank-R`` on many
        ranks (one file each)."""
        path = self.report if self.world_size == 1 else f"{self.report}.rank-{self.rank}"
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(outcome, f)
        os.replace(tmp, path)
