"""Client: what a training script holds to snapshot and resume one run exactly.

::

    ckpt = Client("checkpoints", run="gpt-small", data_version="wikitext-v3")
    ckpt.track(model=model, optimizer=opt, scheduler=sched, scaler=scaler)
    batches = ckpt.batches(loader)
    step = ckpt.restore()
    ...
    ckpt.snapshot(step, metric=val_loss)
    ckpt.close()

The client captures state at the step boundary (tracked objects, every RNG stream,
the data cursor) into a frozen :class:`~snapd_client.capture.Capture` and hands it to
the writer: by default the daemon serving
the root (started when none runs; see handoff.py), or, with ``daemon=False``, the
writer in this process, synchronously.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import sys
import time
import warnings
import weakref
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import torch

from snapd import pins
from snapd.commit import CommitService
from snapd.diskguard import space_for
from snapd.errors import InvalidOption, SnapdError
from snapd.options import Options, given_daemon_options
from snapd.logdigests import LoggedDigests
from snapd.signing import load_keys, signer_id
from snapd.progress import RunProgress, read_progress
from snapd.retention import apply_retention
from snapd.runlock import RunLock
from snapd.store import RunStore, SnapshotId
from snapd.writer import write_snapshot
from snapd_client.anomaly import Anomaly, AnomalyDetector, AnomalyWarning
from snapd_client.basemodel import Base, LiveBase
from snapd_client.cadence import Cadence
from snapd_client.capture import Capture, capture_object, stepped_tensors
from snapd_client.cursor import BatchStream
from snapd_client.frozen import Unchanged, frozen_flags, trainable_ptrs
from snapd_client.distrestore import begin_reshard, restore_ranks
from snapd_client.fromremote import pull_newer
from snapd_client.handle import CloseSummary, SnapshotHandle, part_of
from snapd_client.handoff import Handoff
from snapd_client.hotrestore import hot_offer
from snapd_client.staging import layout
from snapd_client.lostdaemon import settle_writes
from snapd_client.journal import Journal
from snapd_client.overlaprestore import StepStateArrival, set_aside
from snapd_client import remotearrival
from snapd_client.snapshot_outcomes import Outcomes
from snapd_client.ranks import default_session, detect
from snapd_client.replicas import with_writers
from snapd_client.repro import requested
from snapd_client.restore import Loaded, load_for_resume, load_weights, overlappable
from snapd_client.rng import RngStreams
from snapd_client.schedule import CadenceWarning, Schedule, scope as cadence_scope
from snapd_client.values import Values, track_names, track_objects, values_home

MODES = ("resume", "warm_start")


# The operator's one-line decisions (what a restore chose); snapd/stderrlog.py prints them
# on stderr as "snapd: <message>".
logger = logging.getLogger(__name__)


def _as_metric(metric: Any) -> Optional[float]:
    """The metric as a float: scripts pass a loss tensor (``losses['val']``) as often
    as a number, and the log and the manifest keep plain numbers."""
    if metric is None:
        return None
    try:
        return float(metric)
    except (TypeError, ValueError, RuntimeError) as e:
        raise InvalidOption(f"snapshot(metric={metric!r}): the metric must be one number "
                            f"(a float, or a tensor of one element): {e}",
                            field="metric") from e


def _check_step(step: Any) -> None:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise InvalidOption(f"snapshot(step={step!r}): step counts completed "
                            "updates, a non-negative int", field="step")


class Client:
    """Snapshots and resumes the tracked state of one run (one rank) under a root.

    ``daemon`` (default ``Options.daemon``, True; env ``SNAPD_DAEMON``): hand
    snapshots to the daemon serving ``root``, started at the first snapshot() when
    none runs; False writes them in this process before snapshot() returns. Other
    keyword arguments override fields of :class:`snapd.options.Options`.

    ``rank``/``world_size`` (default: from ``torch.distributed`` when initialised,
    else ``RANK``/``WORLD_SIZE``, else 0 and 1; snapd_client/ranks.py): with more
    than one rank each snapshot is this rank's part, committed once every rank's is
    (docs/multirank.md); ``session`` names this attempt of the job (restore() agrees
    on a new one across ranks).

    One writer per run and rank: a client holds ``<run>/.writer-<rank>.lock`` from
    construction to close() (snapd/runlock.py); a second one raises RunInUse.
    ``read_only=True`` (evaluation beside a live run, inspection): restore() works,
    from the files or the daemon's hot copy, but no lock is taken, no log record
    written, no daemon started, and snapshot()/log() are refused.

    ``base`` (fine-tuning): the base model the tracked modules' frozen weights are,
    as :class:`~snapd_client.basemodel.Base` ``(name, revision)`` (or a dict or a tuple);
    same as ``track(..., base=...)``, whose docstring says what it does.
    """

    def __init__(self, root: str, run: str, data_version: Optional[str] = None, *,
                 rank: Optional[int] = None, world_size: Optional[int] = None,
                 options: Optional[Options] = None,
                 daemon: Optional[bool] = None, read_only: bool = False,
                 base: Any = None, **option_overrides: Any) -> None:
        # A typo (keep_lsat=3) is refused before anything is created on disk.
        Options.check_names(option_overrides, where="Client",
                            also=("data_version", "rank", "world_size", "options", "daemon",
                                  "read_only", "base"))
        # Under snapd repro: this run read-only, its STEP recomputed (repro.py).
        self._repro = requested(root, run)
        if self._repro is not None:
            read_only, daemon = True, False
        self.store = RunStore(root, run)
        self.read_only = bool(read_only)
        if not self.read_only:   # a full disk: InsufficientSpace naming the mount
            with space_for(self.store.root, self.store.path, f"creating run {run!r}"):
                self.store.ensure()
        self.run = run
        self.data_version = data_version
        ranks = detect(rank, world_size)
        self.rank, self.world_size, self.local_rank = \
            ranks.rank, ranks.world_size, ranks.local_rank
        if self._repro is not None:   # the run's own world size only
            self._repro.on_ranks(self.rank, self.world_size)
        # The attempt this client's parts belong to; restore() may replace it, and every
        # later capture takes the value current then.
        self.session = default_session()
        if daemon is not None:   # a parameter of its own, and an option: one value
            option_overrides["daemon"] = bool(daemon)
        self.options = (options or Options.resolve()).replace(**option_overrides) \
            if option_overrides else (options or Options.resolve())
        # The daemon-wide ones among them, which a running daemon must share (hello).
        given = given_daemon_options(self.options, option_overrides,
                                     handed=options is not None)
        # Signed commits (snapd/signing.py): with a key, restore refuses what no
        # accepted key signed. Loaded now, so that an unusable key fails here.
        self._keys = load_keys(self.options.signing_key_file)
        self.rng = RngStreams()
        self._tracked: Dict[str, Any] = {}
        self._unchanged = Unchanged()   # frozen leaves an earlier snapshot holds
        # The base model and its digest over the tracked modules (snapd_client/basemodel.py).
        self._base: Optional[LiveBase] = \
            None if base is None else LiveBase(Base.of(base), self._tracked)
        self._stream: Optional[BatchStream] = None
        self._summary: Optional[CloseSummary] = None
        self.lineage: Dict[str, Any] = {"id": 0, "mode": "fresh", "parent": None}
        self.restored: Optional[Loaded] = None
        self._restore_called: Optional[float] = None   # when restore() was last called
        # restore(overlap=True): the optimizers' state still arriving (overlaprestore.py)
        self._arrival: Optional[StepStateArrival] = None
        # "hot" (daemon memory), "disk", or "remote" (pulled from the remote tier)
        self.restored_from: Optional[str] = None
        # Why a restore that could have read the daemon's hot copy read the files
        self.not_hot: Optional[str] = None
        self.daemon = self.options.daemon
        self._handoff = Handoff(self.store, self.rank, self.options, self.world_size,
                                given, signer_id(self._keys)) if self.daemon else None
        self._outcomes = Outcomes(self.store, self._handoff,
                                  global_timeout=self.options.global_commit_timeout)
        # Which snapshot() calls take one (``every``; snapd_client/schedule.py).
        self._schedule = Schedule(self.options, rank=self.rank,
                                  world_size=self.world_size,
                                  history=self._resume_times,
                                  scope=cadence_scope(run, lambda: self.session),
                                  settled=self._staging_settled)
        self._hooks: Dict[int, Any] = {}  # id(optimizer) -> its step pre-hook
        self._warm_hooks: Dict[int, Any] = {}  # id(optimizer) -> its first step's hook
        self._stepped: set = set()   # optimizers whose first step has been seen
        self._journal: Optional[Journal] = None
        self.recovery: Optional[RunProgress] = None
        # Anomalies in the logged loss pin the newest snapshot before them (anomaly.py).
        self._anomalies = AnomalyDetector(self.options.anomaly_z,
                                          self.options.anomaly_window)
        self._handed: Optional[SnapshotId] = None   # the newest snapshot handed off
        self._closed = False
        self._lock: Optional[RunLock] = None
        if not self.read_only:
            self._lock = RunLock(self.store.path, run, self.rank)
            self._lock.acquire()   # RunInUse when another client writes this run/rank
            # A client dropped without close() must not keep the run locked.
            weakref.finalize(self, self._lock.release)

    @property
    def journal(self) -> Journal:
        """This rank's state log, opened at first use (its open repairs a torn tail)."""
        if self._journal is None:
            self._check_writable("the state log")
            self._journal = Journal(self.store, self.rank, self.rng, self.options)
            self._outcomes.journal = self._journal   # outcomes are logged from now on
        return self._journal

    def _resume_times(self) -> List[float]:
        """The run's resume times, as this client's restore() logged them (none
        before a restore, or on a fresh run): the cadence's history."""
        return self._journal.resume_times if self._journal is not None else []

    @property
    def cadence(self) -> Optional[Cadence]:
        """With ``every="auto"``, the :class:`~snapd_client.cadence.Cadence` deciding
        (made at the first snapshot() call; its ``step_s``, ``stall_s``, ``mtbf_s``);
        else None."""
        return self._schedule.cadence

    @property
    def skipped(self) -> List[int]:
        """Steps whose snapshot was skipped because the previous one was busy."""
        return self._handoff.skipped if self._handoff else []

    @property
    def daemon_pid(self) -> Optional[int]:
        conn = self._handoff.conn if self._handoff else None
        return conn.daemon_pid if conn is not None else None

    # --- what is tracked -----------------------------------------------------------

    def track(self, base: Any = None, **objects: Any) -> "Client":
        """Track objects with state_dict()/load_state_dict(), torch.Generators, tensors
        (restored in place, shape and dtype checked) and lists/dicts of plain values
        (restored in place). A number or string cannot be restored in place: keep it in
        :meth:`values` or name it with :meth:`track_globals`.

        ``None`` values are ignored, so optional objects need no ``if``. An optimizer
        wrapper that only forwards to the optimizer inside (accelerate's
        ``AcceleratedOptimizer``) is tracked as that optimizer.

        ``base`` is reserved (no object can be tracked under that name): the base model
        a fine-tuning run trains over, ``Base(name, revision)``, a ``{"name",
        "revision"}`` dict or a ``(name, revision)`` tuple, e.g.
        ``track(model=model, optimizer=opt, base=("llama-3-8b", "8cde5ca"))``. snapd
        digests the frozen tensors of the tracked modules (one pass over their bytes,
        here and again at restore(): load the base weights first), every snapshot
        carries ``{name, revision, digest}``, and restore() and warm starts refuse a
        snapshot whose base digest differs (docs/format.md, "Base model").
        """
        if base is not None:
            self._base = LiveBase(Base.of(base), self._tracked)
        track_objects(self._tracked, self.rng, objects)
        if self._base is not None:
            self._base.forget()
            self._base.record()   # the one pass over the base's bytes, here
        self._warm_up()
        return self

    def _warm_up(self) -> None:
        """The daemon and an arena for the tracked state, readied here, on the
        trainer's thread, the arena's pages faulted in in the background (handoff.py,
        "Warm-up"), so that the first snapshot() costs what later ones do."""
        if self._handoff is None or self._closed:
            return
        if self.read_only:   # no arena, no daemon started; one that serves is reached
            self._handoff.reach()   # now, as a writer's track() does, not in restore()
            return
        if self._before_first_step() or self.optimizer_state_pending:
            self._handoff.warm_up(None)   # the daemon now, the arena after the step
            return
        try:
            capture = self.capture(0)
        except Exception:   # snapshot() will say what is wrong, where it belongs
            return
        self._handoff.warm_up(layout(capture.tensors, capture.carried)[1])

    def _before_first_step(self) -> bool:
        """A tracked optimizer has no state yet (its moments appear at its first
        step): the arena is sized after that step, by a step post-hook on the
        trainer's thread, rather than made twice."""
        fresh = [o for o in self._tracked.values() if isinstance(o, torch.optim.Optimizer)
                 and not o.state and id(o) not in self._stepped]
        for opt in fresh:
            if id(opt) not in self._warm_hooks:
                self._warm_hooks[id(opt)] = opt.register_step_post_hook(self._first_step)
        return bool(fresh)

    def _first_step(self, optimizer, args, kwargs) -> None:
        self._stepped.add(id(optimizer))
        hook = self._warm_hooks.pop(id(optimizer), None)
        if hook is not None:
            hook.remove()
        self._warm_up()

    def values(self, *, name: str = "values", **initial: Any) -> Values:
        """Loop values with a home: ``loop = ckpt.values(best_val_loss=1e9, lr=0.1)``,
        then ``loop.lr /= 4``. Tracked under ``name``; restore() assigns the saved
        values back (see snapd_client/values.py for keys added or removed since). A
        second call with the same name adds its new keys to the same object."""
        return values_home(self._tracked, name, initial)

    def track_globals(self, *names: str, name: str = "globals") -> "Client":
        """Track the caller's module-level variables by name: ``X``, ``best_val_loss``.

        Each name is tracked as what it holds now: an object with state_dict() (a
        model, an optimizer) or a Generator as :meth:`track` would, under that name;
        anything else (numbers, tensors, None, lists, or no value yet) is read at each
        snapshot and assigned back by restore(), under ``name``.
        """
        track_names(self._tracked, self.rng, sys._getframe(1).f_globals, names, name,
                    "track_globals")
        return self

    def track_attrs(self, obj: Any, *names: str, name: Optional[str] = None) -> "Client":
        """Like :meth:`track_globals`, for attributes of ``obj`` (a trainer's
        ``top_score``); tracked under ``name``, by default its class name, lower case."""
        track_names(self._tracked, self.rng, vars(obj), names,
                    name or type(obj).__name__.lower(), "track_attrs")
        return self

    def batches(self, loader: Iterable, *, fast_forward: str = "skip") -> BatchStream:
        """The resumable batch stream over ``loader`` (see docs/cursor.md)."""
        if self._stream is not None:
            raise RuntimeError("batches() was already called; one data cursor per client")
        self._stream = BatchStream(loader, self.rng, fast_forward=fast_forward,
                                   world_size=self.world_size)
        return self._stream

    # --- snapshot ------------------------------------------------------------------

    def capture(self, step: int, metric: Optional[float] = None, *,
                share: bool = False) -> Capture:
        """The frozen capture of the tracked state at this step boundary (the live
        tensors, not copies: valid until the trainer next changes them). ``share``:
        frozen leaves unchanged since an earlier snapshot refer to it (not copied)."""
        _check_step(step)
        self._finish_arrival()   # a capture reads the optimizers' state: all of it
        # Overlap mode defers the copies only optimizer.step() changes (capture.py).
        defer = stepped_tensors(self._tracked) \
            if self._handoff is not None and self.options.mode == "overlap" else None
        objects = with_writers(self._tracked, [capture_object(n, o, defer, self.rank)
                                               for n, o in self._tracked.items()],
                               self.rank, self.world_size)
        objects = self._mark_frozen(objects, share)
        return Capture(
            run=self.run, step=step, rank=self.rank, lineage=self.lineage,
            data_version=self.data_version,
            metric=None if metric is None else float(metric),
            rng=self.rng.capture(),
            cursor=self._stream.state() if self._stream is not None else None,
            objects=objects,
            supersedes=tuple(self.restored.refused) if self.restored else (),
            world_size=self.world_size, session=self.session,
            base=self._base.record() if self._base is not None else None)

    def _mark_frozen(self, objects: Tuple[Any, ...], share: bool) -> Tuple[Any, ...]:
        """Each leaf's ``frozen`` flag, and with ``share`` (one rank, the option on) the
        earlier snapshot each unchanged frozen leaf refers to (snapd_client/frozen.py)."""
        trainable = trainable_ptrs(self._tracked)
        share = share and self.world_size == 1 and self.options.share_unchanged
        marked = []
        for obj in objects:
            flags = frozen_flags(self._tracked[obj.name], obj.tensors, trainable)
            reuse = self._unchanged.homes(obj.name, obj.paths, obj.tensors, flags) \
                if share else (None,) * len(flags)
            marked.append(dataclasses.replace(obj, frozen=flags, reuse=reuse))
        return tuple(marked)

    def snapshot(self, step: int, metric: Optional[float] = None) -> SnapshotHandle:
        """Snapshot the tracked state at this step boundary; returns a handle.

        Through the daemon it returns once every tensor is copied into the staging
        slot (``mode="wait"``), or once those the next forward may change are
        (``mode="overlap"``: the parameters and optimizer state follow in the
        background, and the next ``optimizer.step()`` waits for them); the daemon
        writes after. ``daemon=False`` writes here, synchronously. A snapshot that
        failed in the background since the last call is warned of first
        (``SnapshotWarning``), and one a lost daemon left staged is retried.

        With ``every`` set, only some calls take one (docs/operations.md, "Snapshot
        cadence"): the others return at once a handle whose ``taken`` is False,
        having copied, sent and logged nothing. ``every="auto"`` logs a ``cadence``
        record with each snapshot taken, and warns once (``CadenceWarning``) when
        ``max_loss`` cannot be met.
        """
        self._check_open()
        if self._repro is not None:   # snapd repro writes nothing to the run
            _check_step(step)
            return SnapshotHandle.not_taken(step)
        self._check_writable("snapshot()")
        _check_step(step)
        self._outcomes.report()
        take = self._schedule.decide(step)
        self._log_cadence(self._schedule.late_records())   # a follower's, one call late
        unreachable = self._schedule.warning()
        if unreachable is not None:   # once, at the trainer's line
            warnings.warn(CadenceWarning(unreachable), stacklevel=2)
        if not take:
            return SnapshotHandle.not_taken(step)
        # Many ranks under "auto": rank 0's interval from here, agreed before anything
        # that may raise, so that no rank is left out of step.
        self._schedule.publish(step)
        metric = _as_metric(metric)
        started, called_at = time.perf_counter(), self._schedule.clock()
        handle = self._hand_over(step, metric)
        # The stall: how long this call kept the loop from its next update.
        stall = time.perf_counter() - started
        self.journal.event("snapshot", event="staged", step=step, metric=metric,
                           stall=stall, staged_bytes=handle.staged_bytes,
                           waited=handle.stall_seconds, mode=self.options.mode
                           if self._handoff is not None else "in-process")
        self._log_cadence([self._schedule.taken(handle, stall, called_at)])
        self.journal.sync_soon()  # flushed now by the log's thread: no fsync here
        self._outcomes.add(handle)
        if handle.sid is not None and not handle.failed:
            self._handed = handle.sid
        return handle

    def _log_cadence(self, records) -> None:
        for fields in records:
            if fields is not None:
                self.journal.event("cadence", **fields)

    def _hand_over(self, step: int, metric: Optional[float]) -> SnapshotHandle:
        capture = self.capture(step, metric, share=True)
        handle = self._write_capture(capture)
        # The frozen leaves copied now are held by this snapshot from now on (their
        # bytes are still the live ones: nothing ran since the copy).
        for obj in capture.objects:
            self._unchanged.copied(obj.name, obj.paths, obj.tensors, obj.frozen, obj.reuse,
                                   capture.sid.name, handle)
        return handle

    def _write_capture(self, capture: Capture) -> SnapshotHandle:
        if self._handoff is not None:
            if self.options.mode == "overlap":
                self._hook_optimizers()
            return self._handoff.snapshot(capture)
        rng, cursor = capture.record_state()
        handle = SnapshotHandle(capture.step, sid=capture.sid, rng=rng, cursor=cursor,
                                part=part_of(capture))
        handle.staged_bytes = sum(t.numel() * t.element_size()
                                  for t, carried in zip(capture.tensors, capture.carried)
                                  if carried)
        # The daemon's commit path, here: space check, write, tmp cleanup, retention.
        commits = CommitService(self.store.root, self.options.min_free_bytes,
                                writer=write_snapshot, retain=apply_retention)
        try:
            # The plan lives for the write only: its buffers are the tensors' own bytes.
            done = commits.commit(self.store, capture.plan_in_memory(), self.options)
        except Exception as e:  # reported through the handle, as a daemon's would be
            handle.set_error(e)
        else:
            done.purge()
            handle.set_result(done.result)
        return handle

    def _hook_optimizers(self) -> None:
        for obj in self._tracked.values():
            if isinstance(obj, torch.optim.Optimizer) and id(obj) not in self._hooks:
                self._hooks[id(obj)] = obj.register_step_pre_hook(self._before_step)

    def _before_step(self, optimizer, args, kwargs) -> None:
        """No update may start before the overlap copy of the weights is done."""
        if self._handoff is not None:
            self._handoff.stager.synchronize()

    def log(self, step: int, *, samples: Optional[Iterable[int]] = None,
            unchecked: Optional[Dict[str, float]] = None, **scalars: float) -> None:
        """Append this step's record: time, cursor, RNG digests, ``scalars``.

        One write, no fsync (grouped by time; forced at snapshot() and close()). After
        a resume, each recomputed step is checked against the interrupted run's
        record (ReplayDivergence, or a warning with ``replay_check="warn"``).
        ``samples``: the dataset indices this step consumed, when the loop knows them;
        ``snapd batch RUN STEP`` prints them. ``unchecked``: values recorded but left
        out of the replay check because they differ between runs by nature (wall-clock
        time, throughput).
        """
        self._check_open()
        cursor = [self._stream.epoch, self._stream.index] if self._stream else None
        if self._repro is not None:   # checked against the run's log, not written
            self._repro.log(self, Journal.record(
                self.rng, step, cursor, scalars,
                None if samples is None else [int(i) for i in samples], unchecked))
            return
        self._check_writable("log()")
        self._outcomes.report()
        self.journal.step(step, cursor, scalars,
                          None if samples is None else [int(i) for i in samples],
                          unchecked)
        found = self._anomalies.observe(step, scalars)
        if found is not None:
            self._anomaly(found)

    def _anomaly(self, found: Anomaly) -> None:
        """Pin the newest snapshot before ``found``, log the anomaly, and warn once, at
        the caller's line of log(). A pin that cannot be written (a full disk) is said
        in the record and the warning; training goes on."""
        sid = self._snapshot_before(found.step)
        record = found.record()
        pin_error = None
        if sid is not None:
            try:
                pins.pin(self.store.path, sid, {"kind": "anomaly", **record})
            except OSError as e:
                pin_error = f"{type(e).__name__}: {e}"
        self.journal.event("anomaly", **record, pinned=None if sid is None or pin_error
                           else sid.name, **({"pin_error": pin_error} if pin_error else {}))
        self.journal.sync_soon()
        if sid is None:
            kept = "no snapshot before it to pin"
        elif pin_error:
            kept = f"pinning snapshot {sid.name} failed ({pin_error})"
        else:
            kept = (f"snapshot {sid.name} pinned: retention keeps it until snapd unpin "
                    f"{self.store.root} {self.run}@{sid.step}")
        warnings.warn(AnomalyWarning(
            f"run {self.run}: step {found.step}: {found.describe()}; {kept}. Reproduce "
            f"the step: snapd repro {self.store.root} {self.run}@anomaly -- <the training "
            "command>"), stacklevel=3)

    def _snapshot_before(self, step: int) -> Optional[SnapshotId]:
        """The newest snapshot of this lineage before ``step``: committed, or handed
        off and still being written (a pin holds from its commit on)."""
        lineage = int(self.lineage.get("id", 0))
        known = list(self.store.committed()) + [self._handed] + \
            [self.restored.sid if self.restored is not None else None]
        before = [sid for sid in known if sid is not None and sid.lineage == lineage
                  and sid.step < step]
        return max(before, default=None)

    # --- restore -------------------------------------------------------------------

    def restore(self, mode: str = "resume", *, overlap: bool = False,
                _omit: Iterable[str] = ()) -> int:
        """Put back the newest good snapshot; returns the step to continue from.

        ``mode="resume"`` continues the same run exactly; ``"warm_start"`` loads module
        weights only and starts a new lineage at step 0. ``_omit`` (tests, diagnosis)
        leaves named pieces out: an object name, ``rng:<stream>`` or ``cursor``.

        ``overlap=True`` (resume): return once everything the next forward and
        backward read is in place and verified; each tracked optimizer's per-parameter
        state is read and verified in the background, and its first ``step()`` (or
        the next snapshot()) waits for it; on many ranks, every rank's, joined there
        (docs/operations.md, "Restore with overlap"; snapd_client/overlaprestore.py).
        The same after a reshard and for a pull from the remote tier, one rank or many.
        """
        self._check_open()
        self._restore_called = time.time()   # the resume record's "called" (its phases)
        if mode not in MODES:
            raise InvalidOption(f"restore(mode={mode!r}): choose 'resume' or 'warm_start'",
                                field="mode")
        self._check_overlap(mode, overlap)
        if self._base is not None:   # digested again, as it is now, when a snapshot
            self._base.forget()      # names a base to compare with (or at the next capture)
        if mode == "warm_start":   # a resume's optimizer state not wanted any more
            with self._replacing_arrival():
                return self._warm_start()
        world = self.world_size
        if world > 1:  # every rank agrees on one snapshot (snapd_client/distrestore.py)
            loaded = restore_ranks(self, set(_omit), world, self._deferred(overlap))
            if loaded is None:
                return self._nothing_to_resume()
            self.restored = loaded   # restore_ranks set restored_from: disk or remote
            self.lineage = dict(loaded.manifest["lineage"])
            if loaded.mode == "reshard":
                return begin_reshard(self, loaded, sorted(_omit), world)
            return self._begin_resume(loaded, sorted(_omit))
        with self._paused_warm_up():   # the restore has the machine to itself
            if self._repro is None:   # a repro reads what is committed, at or before STEP
                self._settle_daemon_writes()
            pulled, pending = remotearrival.split(
                self._pull_from_remote(self._deferred(overlap), _omit))
            hot, self.not_hot = None, None
            if self._handoff is not None and self.options.hot_restore:
                hot, self.not_hot = hot_offer(lambda: self._handoff.connect(spawn=False),
                                              self.run, self.rank)  # never starts one
            logged = None
            try:
                self.recovery = read_progress(self.store, self.rank)  # the log only
                logged = LoggedDigests(self.store.path, self.rank)
                loaded = load_for_resume(self.store, self._tracked, self.rng,
                                         data_version=self.data_version,
                                         need_cursor=self._stream is not None,
                                         tensor_source=hot, omit=set(_omit),
                                         reached=self.recovery.furthest,
                                         verify_steps=self.options.verify_steps,
                                         base=self._base,
                                         defer=self._deferred(overlap),
                                         at_most=self._repro and self._repro.step,
                                         logged=logged, keys=self._keys,
                                         first=remotearrival.candidate(pending))
            except BaseException:
                if hot is not None:
                    hot.close()
                if pending is not None:   # nothing committed: the next start pulls again
                    pending.abandon()
                raise
            finally:
                if logged is not None:
                    logged.close()
            if hot is not None and not (loaded is not None and loaded.deferred):
                hot.close()   # else the background read closes it when it ends
            if pending is not None and (loaded is None or loaded.sid != pending.sid):
                remotearrival.settle_unused(pending, loaded)
                pending = None
            if loaded is None:
                return self._nothing_to_resume()
            self.restored_from = "remote" if loaded.sid == pulled else \
                "hot" if hot is not None and hot.used else "disk"
            if hot is not None:
                self.not_hot = hot.why_not_used(loaded.sid.name)
            if self.restored_from != "disk":
                self.not_hot = None
            with self._replacing_arrival():
                # read from now (a pull's rest too), applied at the first step
                self._start_arrival(loaded, hot, pending)
                self._apply(loaded, set(_omit))
            if hot is not None and not self.read_only:   # the old arena may go now,
                self._handoff.release_hot()              # before this one's is made
        self._warm_up()   # sized for the restored state (an optimizer's moments)
        self.restored = loaded
        self.lineage = dict(loaded.manifest["lineage"])
        return self._begin_resume(loaded, sorted(_omit))

    def _staging_settled(self) -> bool:
        return self._handoff is None or self._handoff.staging_settled

    def _check_overlap(self, mode: str, overlap: Any) -> None:
        if not isinstance(overlap, bool):
            raise InvalidOption(f"restore(overlap={overlap!r}): True or False",
                                field="overlap")
        if overlap and mode != "resume":
            raise InvalidOption(f"restore(mode={mode!r}, overlap=True): a warm start reads "
                                "module weights only, there is nothing to overlap; drop "
                                "overlap=True", field="overlap")

    def _deferred(self, overlap: bool) -> List[str]:
        """The optimizers whose state a restore with overlap leaves to the background."""
        if not overlap:
            return []
        return [n for n, o in self._tracked.items() if overlappable(o)]

    @property
    def optimizer_state_pending(self) -> bool:
        """After restore(overlap=True): a tracked optimizer's per-parameter state is not
        applied yet (its first step(), or the next snapshot(), waits for it)."""
        return self._arrival is not None and not self._arrival.complete

    def _start_arrival(self, loaded: Loaded, hot: Any, pending: Any = None,
                       said: Optional[Callable[[], str]] = None, **many: Any) -> None:
        """The background read of ``loaded``'s deferred state (from the daemon's copy
        ``hot`` where it serves, which the read closes, else the files); called
        inside :meth:`_replacing_arrival`. ``pending``: a pull whose optimizers' files
        are still remote (remotearrival.py). ``many``: on many ranks, the read of this
        rank's part and the ranks' join (distrestore.py). ``said``: on many ranks
        after a pull, what the join did with the download (remoteranks.py), which is
        then all that setting the snapshot aside means here."""
        self._drop_arrival()
        if not loaded.deferred:
            return
        mark, journal = (None, None) if self.read_only else (self._set_aside, self.journal)
        if said is not None and mark is not None:
            mark = functools.partial(self._set_aside, said=said)
        if pending is not None:
            many["read"] = remotearrival.RemoteStepState(
                pending, loaded, self._tracked, threads=self.options.remote_upload_threads,
                timeout=self.options.remote_timeout)
            mark = functools.partial(self._set_aside, pending=pending)
        self._arrival = StepStateArrival(loaded, self._tracked, mark, source=hot,
                                         journal=journal, **many)

    def _set_aside(self, sid: SnapshotId, pending: Any = None,
                   said: Optional[Callable[[], str]] = None) -> str:
        """A snapshot whose optimizer state failed verification after restore returned:
        set aside (a pull's download, when ``pending``; done already when ``said``),
        and the log says so (status stops counting its commit record)."""
        said = said() if said is not None else \
            remotearrival.set_aside_pulled(pending) if pending is not None \
            else set_aside(self.store, sid)
        self.journal.set_aside(snapshot=sid.name, by=self.rank, said=said)
        return said

    def _finish_arrival(self) -> None:
        """Wait for the optimizers' state and apply it; raises, before anything reads
        the optimizers, when it failed (overlaprestore.py). Once applied, the no-op
        hook a step left behind goes."""
        if self._arrival is not None:
            self._arrival.finish()

    def _settle_arrival(self) -> None:
        """At close: the optimizers' state applied, so that they are whole after the
        client is gone. A failure is not raised here: the hooks stay, and each step
        raises it, where an update would have used the state."""
        if self._arrival is not None:
            try:
                self._arrival.finish()   # applied already: the no-op hook left goes
            except SnapdError:
                logger.info(f"run {self.run}: closed with the optimizer state of the "
                            "overlapped restore not applied; optimizer.step() refuses "
                            "to run")

    @contextmanager
    def _replacing_arrival(self) -> Iterator[None]:
        """An earlier restore(overlap=True)'s state, still arriving, stays in force
        (its hooks guard the optimizers) until the restore in this block has put
        everything in place: restore is all or nothing, and one that fails leaves the
        optimizers as they were, the earlier state still to be applied at their first
        step; not empty, where a step would start the moments from zero."""
        previous, self._arrival = self._arrival, None
        try:
            yield
        except BaseException:
            self._drop_arrival()   # this restore's own background read, if it began one
            self._arrival = previous
            raise
        if previous is not None:
            previous.discard()

    def _drop_arrival(self) -> None:
        if self._arrival is not None:
            self._arrival.discard()
            self._arrival = None

    def _pull_from_remote(self, defer: List[str], omit: Iterable[str]) -> Any:
        """With ``remote`` set, a newer remote commit (and an empty log's replica)
        brought down first (snapd_client/fromremote.py); with ``defer``
        (restore(overlap=True)), left pending without those optimizers' files
        (remotearrival.py). A read-only client writes nothing, so it restores from
        what is local."""
        if not self.options.remote or self.read_only:
            return None
        later = remotearrival.later_objects(defer, omit) if defer else None
        return pull_newer(self.store, self.options.remote,
                          min_free_bytes=self.options.min_free_bytes,
                          timeout=self.options.remote_timeout, keys=self._keys,
                          later=later)

    def _paused_warm_up(self):
        return self._handoff.paused() if self._handoff is not None else nullcontext()

    def _nothing_to_resume(self) -> int:
        if self._repro is not None:   # no snapshot at or before STEP: from the start
            return self._begin_repro(None, 0)
        if not self.read_only:
            # A fresh run's log segment, made now (after any pull of a replicated log)
            # rather than at the loop's first record: its fsyncs are not a step's.
            self.journal.ready()
        if self.recovery.furthest:
            logger.info(f"run {self.run}: no snapshot to resume from; training had "
                        f"reached step {self.recovery.furthest}; starting at step 0")
        return 0

    def _settle_daemon_writes(self) -> None:
        """Let a daemon serving the root finish this run and rank's writes first.

        A trainer killed right after snapshot(k) returned leaves step k being written;
        choosing a snapshot before it commits would resume at an older step (and
        lose k). Bounded by Options.timeout; never starts a daemon.
        """
        if self._handoff is not None:
            self._handoff.stager.synchronize()
            waited, seconds = self._handoff.settle_writes()
        else:
            waited, seconds = settle_writes(self.store, self.rank, self.options.timeout)
        if waited:
            logger.info(f"run {self.run}: waited {seconds:.1f} s for the daemon to finish "
                        f"step(s) {', '.join(map(str, waited))} before choosing a snapshot")

    def _begin_resume(self, loaded: Loaded, omitted: List[str]) -> int:
        """Log the resume, arm the replay check, and say what will happen."""
        # The furthest step, not the last logged: a resume killed during its
        # recompute logged less than the run had reached (RunProgress.furthest).
        step, reached = loaded.manifest["step"], self.recovery.furthest
        source = self.restored_from + (f"; not hot: {self.not_hot}" if self.not_hot else "")
        if loaded.deferred:   # restore(overlap=True): read meanwhile
            source += f"; the state of {', '.join(loaded.deferred)} arrives before the " \
                      "first step"
        if self._repro is not None:
            return self._begin_repro(loaded.sid.name, step)
        if self.read_only:
            logger.info(f"run {self.run}: restored step {step} ({source}), "
                        "read-only: nothing is written to the run")
            return step
        # Counted from the log's records: step numbers need not be contiguous.
        recompute = self.journal.begin_replay(step, reached)
        self.journal.resume(previous=self.recovery.last_resume,
                            step=step, snapshot=loaded.sid.name, mode="resume",
                            lineage=self.lineage, reached=reached, recompute=recompute,
                            restored_from=self.restored_from, refused=loaded.refused,
                            omitted=omitted, called=self._restore_called,
                            **({"overlap": True} if loaded.deferred else {}),
                            **({"passed_over": loaded.passed_over}
                               if loaded.passed_over else {}),
                            **({"not_hot": self.not_hot} if self.not_hot else {}))
        logger.info(f"run {self.run}: resuming from step {step} ({source})"
                    + self._resume_outlook(loaded, step, reached, recompute))
        return step

    def _begin_repro(self, snapshot: Optional[str], step: int) -> int:
        """snapd repro: the steps to recompute armed, or, at STEP already, the end."""
        logger.info(f"run {self.run}: repro of step {self._repro.step} from "
                    f"{snapshot or 'the start (no snapshot at or before it)'}, read-only: "
                    f"{self._repro.last - step} steps to recompute and check")
        self._repro.begin(self, snapshot, step)
        return step

    def _resume_outlook(self, loaded: Loaded, step: int, reached: Optional[int],
                        recompute: int) -> str:
        """The resume line's second half: how far training had got and what will be
        recomputed and checked. Facts only, except where verify_steps=k was asked
        for and could not be honoured (the user can act on that)."""
        if reached is None:
            return ("; the log holds no step record (log() is never called, or the log "
                    "was lost), so nothing is checked")
        if reached < step:
            return f"; the log's last step is {reached}, before this snapshot, so " \
                   "nothing is checked"
        if reached > step:
            return f"; training had reached {reached}; " + self._recompute_text(
                loaded, step, recompute)
        k = self.options.verify_steps
        if k and self.options.replay_check != "off":
            return (f"; training had reached {reached}; nothing to recompute, so nothing "
                    f"is checked: no snapshot of the run lies at most {k} steps before "
                    f"it (verify_steps={k}). Fix: snapshots at most {k} steps apart "
                    "with keep_last of 2 or more, or a larger verify_steps")
        return f"; training had reached {reached}; nothing to recompute"

    def _recompute_text(self, loaded: Loaded, step: int, recompute: int) -> str:
        if not recompute:
            return (f"the log holds no step after {step} to check the recomputed ones "
                    "against")
        text = (f"{recompute} logged {'step' if recompute == 1 else 'steps'} will be "
                "recomputed" + (" and checked" if self.journal.checking else ""))
        if loaded.passed_over:
            text += (f" (verify_steps={self.options.verify_steps}: resumed before the "
                     f"newest snapshot, {loaded.passed_over}, to check them)")
        return text

    def _apply(self, loaded: Loaded, omit: set) -> None:
        from snapd_client.restore import apply  # all or nothing: puts back on failure
        self._unchanged.forget()   # the tensors are written: every leaf is copied next
        apply(loaded, self._tracked, self.rng, self._stream, omit)

    def _warm_start(self) -> int:
        modules = {n: o for n, o in self._tracked.items() if isinstance(o, torch.nn.Module)}
        self._unchanged.forget()
        loaded = load_weights(self.store, modules, base=self._base, keys=self._keys)
        committed = self.store.committed()
        new_id = max((s.lineage for s in committed), default=-1) + 1
        parent = None
        if loaded is not None:
            for name, state in loaded.states.items():
                modules[name].load_state_dict(state)
            parent = {"run": self.run, "snapshot": loaded.sid.name,
                      "step": loaded.manifest["step"]}
        else:
            warnings.warn(f"warm_start: no snapshot in {self.store.path}; starting fresh")
        self.lineage = {"id": new_id, "mode": "warm_start", "parent": parent}
        self.restored = loaded
        if not self.read_only:
            self.journal.resume(step=0, snapshot=parent and parent["snapshot"],
                                mode="warm_start", lineage=self.lineage)
        logger.info(f"run {self.run}: warm start (lineage {new_id}) from "
                    f"{parent['snapshot'] if parent else 'nothing'}: weights only, step 0")
        return 0

    # --- shutdown ------------------------------------------------------------------

    def close(self) -> CloseSummary:
        """Wait for every snapshot handed off (retrying those a lost daemon left
        staged); returns what became of them, and logs it in one line.

        Raises only when the newest snapshot asked for (not skipped) did not commit,
        unless its wait() already raised that; older failures are warned of
        (``SnapshotWarning``), a later commit superseding them. With many ranks, the
        newest snapshot's global commit is waited for at most
        ``Options.global_commit_timeout`` seconds, then ``IncompleteSnapshot`` names
        the ranks whose parts are missing (no collective: the parts are on disk).
        """
        return self._close(stacklevel=4)

    def _close(self, stacklevel: int) -> CloseSummary:
        if self._summary is not None or self._closed:
            return self._summary or CloseSummary()
        self._closed = True
        newest = self._outcomes.newest
        incomplete = None
        try:
            self._settle_arrival()
            self._outcomes.settle()
            self._log_cadence(self._schedule.close())
            if newest is not None and newest.failed:
                newest.warned = True   # raised below instead
            # Many ranks: the newest part waits (bounded) for the other ranks' parts.
            incomplete = self._outcomes.await_global_commit(newest)
            self._outcomes.report(stacklevel)
        finally:
            for hook in [*self._hooks.values(), *self._warm_hooks.values()]:
                hook.remove()
            if self._handoff is not None:
                self._handoff.close()
            if self._journal is not None:
                self._journal.close()
            if self._lock is not None:
                self._lock.release()   # last: the log is closed, the handles resolved
        self._summary = summary = self._outcomes.summary()
        if len(self._outcomes):
            logger.info(f"run {self.run}: closed; snapshots: {summary}")
        if newest is not None and newest.failed and not newest.raised:
            raise newest.failure()
        if incomplete is not None:
            raise incomplete
        return summary

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"Client for run {self.run!r} is closed")

    def _check_writable(self, what: str) -> None:
        if self.read_only:
            raise RuntimeError(
                f"Client for run {self.run!r} rank {self.rank} is read-only "
                f"(read_only=True): {what} would write to {self.store.path}. Restore "
                "and evaluate with it; to train on, open Client(...) without read_only "
                "once no other process writes this run and rank")

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self._close(stacklevel=4)
