"""Restore with overlap: the optimizer's per-parameter state arrives while training runs.

Nothing reads an optimizer's moments before the first ``optimizer.step()``, a whole
forward and backward after a restart. ``restore(overlap=True)`` therefore returns
once everything else is read, verified and applied (snapd_client/restore.py: checks
1-3 cover the deferred optimizers too, and their param_groups are applied with the
rest), and :class:`StepStateArrival` reads the rest on a background thread:

1. the thread reads the deferred optimizers' state into new memory and verifies it
   (``restore.read_step_state``), from the daemon's copy where it serves (a restart
   on the same node: snapd_client/hotrestore.py; the copy is kept open until then),
   else from the files (after a pull from the remote tier, downloaded first and
   committed after: snapd_client/remotearrival.py); it touches nothing live;
2. a step pre-hook on each deferred optimizer waits for the thread and, on the
   trainer's thread, loads every deferred optimizer's state (keeping the
   param_groups as they are now: a learning rate set since restore() stays), then
   removes the hooks (but its own, which torch is calling: a no-op until the next
   capture or close). ``Client.capture()`` (so snapshot()) does the same first;
3. a failure is sticky: every later ``optimizer.step()`` raises before any update,
   so no update ever runs on partly restored state. A verification failure
   (CorruptSnapshot, naming the file) also sets the snapshot aside at once
   (:func:`set_aside`; the caller logs a "set_aside" record), so the next start
   resumes from an older one.

On many ranks (snapd_client/distrestore.py) each rank reads its own part (after a
reshard, its piece assembled from the saved shards that overlap it), and step 2
ends with one exchange (:class:`RankJoin`): a rank whose read failed makes every rank
raise at that same step, before any update. Then (every rank's read has ended, so
none is reading the files it moves) the lowest rank that found damage sets the whole
global snapshot aside (one directory), so every rank's next start falls back past it
together; the others log "set_aside" too, so that status counts it on no rank. Applied on every rank, the state is logged as a "restored" record: the last
phase of the resume that status and watch show.

Until step 2 an optimizer holds its param_groups and an empty ``state``: that is what
``optimizer.state_dict()`` returns when called directly before the first step.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any, Callable, Dict, List, Optional

from snapd.commit import uncommit
from snapd.errors import CorruptSnapshot, SnapdError
from snapd.store import DAMAGED_PREFIX, POINTERS, RunStore, SnapshotId, remove_pointer
from snapd_client.ranks import Collective
from snapd_client.restore import Loaded, read_step_state

# The one background read; tests substitute a gated one to hold the thread.
READ = read_step_state


def set_aside(store: RunStore, sid: SnapshotId) -> str:
    """Take a snapshot found damaged out of the committed namespace (kept, as
    ``.damaged-<name>-<nonce>``: snapd/commit.py, the one place that un-commits) and
    drop the pointers naming it; the sentence that says what was done."""
    try:
        away = uncommit(store, sid, DAMAGED_PREFIX)
    except FileNotFoundError:   # set aside or deleted meanwhile: not committed either way
        return f"{sid.name} is no longer committed"
    except (OSError, SnapdError) as e:   # the error to raise is the damage, not this
        return (f"setting {sid.name} aside failed ({e}): move "
                f"{store.snapshot_path(sid)} out of the way by hand before restarting")
    for which in POINTERS:
        if store.read_pointer(which) == sid:
            remove_pointer(store, which)
    return (f"{sid.name} is set aside as {away} (kept for inspection), so the next "
            "start resumes from an older snapshot")


class StepStateArrival:
    """The deferred optimizers' state of one restore: read in the background,
    applied before the first update. ``mark``: called with the snapshot's id when
    its files fail verification, returns what it did (:func:`set_aside`); None when
    nothing may be written (a read-only client). ``read``: the background read (by
    default :data:`READ` of ``loaded.reader``, from ``source`` where it serves: the
    daemon's copy, hotrestore.HotSource, closed when the read ends). ``join``: on
    many ranks, the one exchange before the first update (:class:`RankJoin`).
    ``journal``: where the "restored" and "set_aside" records go (None: read-only)."""

    def __init__(self, loaded: Loaded, tracked: Dict[str, Any],
                 mark: Optional[Callable[[SnapshotId], str]],
                 source: Any = None, *,
                 read: Optional[Callable[[], Dict[str, Any]]] = None,
                 join: Optional["RankJoin"] = None, journal: Any = None) -> None:
        self.loaded = loaded
        self._source = source
        self.names = loaded.deferred
        self.optimizers = {n: tracked[n] for n in self.names}
        self._read_all = read or (lambda: READ(loaded.reader, self.names, tracked,
                                               source))
        self._mark = mark
        self._join = join
        self._journal = journal
        self._read_done = threading.Event()
        self._states: Optional[Dict[str, Any]] = None
        self._error: Optional[BaseException] = None
        self._marked: Optional[str] = None
        self._failure: Optional[SnapdError] = None   # sticky, once known
        self.complete = False   # every deferred state is applied (on every rank)
        self._hooks = {n: opt.register_step_pre_hook(self._before_step)
                       for n, opt in self.optimizers.items()}
        self._thread = threading.Thread(target=self._read, daemon=True,
                                        name="snapd-restore-overlap")
        self._thread.start()

    def _read(self) -> None:
        try:
            self._states = self._read_all()
        except Exception as e:   # raised on the trainer's thread, at its next step
            self._error = e
            if isinstance(e, CorruptSnapshot) and self._mark is not None \
                    and self._join is None:
                # marked now, not at the step: the process may die before it. On many
                # ranks, after the exchange (_settle_damage): not while others read
                self._marked = self._mark(self.loaded.sid)
        finally:
            self._read_all = None   # nor what it holds (on many ranks, the parts)
            if self._source is not None:
                self._source.close()
            self._read_done.set()

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        # torch is iterating over this optimizer's pre-hooks: its own hook may not be
        # removed now (the dict would change under the loop); it stays, a no-op.
        self.finish(running=optimizer)

    def finish(self, running: Any = None) -> None:
        """Wait for the background read and apply it, once; on many ranks, learn
        whether every rank did (one exchange); raises (every time) when any failed,
        before any update. ``running``: the optimizer whose step pre-hooks torch is
        calling (its hook is left in place, as a no-op)."""
        if self.complete:
            if running is None:
                self._remove_hooks()   # outside a step: the no-op hook left goes too
            return
        if self._failure is None:
            began = time.monotonic()
            self._read_done.wait()
            mine = self._apply_here()
            self._failure = self._verdict(mine)
            if self._failure is None:
                self._complete(time.monotonic() - began, running)
        if self._failure is not None:
            raise self._failure

    def _apply_here(self) -> Optional[BaseException]:
        """This rank's part: its read's failure, or the state loaded into its
        optimizers (before the ranks compare: no update runs until they have)."""
        try:
            if self._error is not None:
                raise self._error
            for name, opt in self.optimizers.items():
                _load_state_only(opt, self._states[name])
        except Exception as e:
            return e
        finally:
            self._states = None   # the optimizers hold the tensors now, or nothing will
        return None

    def _verdict(self, mine: Optional[BaseException]) -> Optional[SnapdError]:
        """The error every step raises from now on, or None: this rank's own failure
        first, else another rank's (each rank raises at the same step)."""
        others: List[Dict[str, Any]] = []
        if self._join is not None:
            try:
                others = self._join.exchange(mine, self.loaded.path)
            except Exception as e:   # a rank gone: nothing says the others are whole
                failure = SnapdError(
                    f"restore(overlap=True): the ranks could not agree that every rank's "
                    f"optimizer state arrived ({e!r}). No update was applied: "
                    "optimizer.step() refuses to run. Restart the job",
                    path=self.loaded.path, field="objects")
                failure.__cause__ = e
                return failure
            self._settle_damage(mine, others)
        if mine is not None:
            failure = self._describe(mine)
            failure.__cause__ = mine
            return failure
        if others:
            return self._from_others(others)
        return None

    def _settle_damage(self, mine: Optional[BaseException],
                       others: List[Dict[str, Any]]) -> None:
        """Many ranks, once every rank's read has ended (the exchange): the lowest
        rank that found damage sets the snapshot aside; every other rank logs that it
        did, so that status counts the snapshot on no rank. A read-only client does
        neither (its message says so)."""
        damaged = sorted([o["rank"] for o in others if o["corrupt"]] +
                         ([self._join.coll.rank] if isinstance(mine, CorruptSnapshot)
                          else []))
        if not damaged or self._mark is None:
            return
        name, by = self.loaded.sid.name, damaged[0]
        if by == self._join.coll.rank:
            self._marked = self._mark(self.loaded.sid)
            return
        self._marked = (f"Rank {by} sets {name} aside, so the next start of every rank "
                        "resumes from an older snapshot")
        if self._journal is not None:
            self._journal.set_aside(snapshot=name, by=by, said=self._marked)

    def _complete(self, waited_s: float, running: Any = None) -> None:
        self.complete = True
        self._remove_hooks(keep=running)
        if self._journal is not None:
            self._journal.restored(objects=list(self.names), waited_s=waited_s)

    def _describe(self, e: BaseException) -> SnapdError:
        """This rank's failure: what failed, that no update was applied, what became
        of the snapshot, and to restart."""
        names = ", ".join(repr(n) for n in self.names)
        what = (f"the per-parameter state of {names}, read after restore(overlap=True) "
                f"returned, from {self.loaded.path}")
        where, who = (" on any rank", "job") if self._join is not None else ("", "process")
        if isinstance(e, CorruptSnapshot):
            marked = self._marked or (f"{self.loaded.sid.name} is left as it is "
                                      "(read-only client)")
            return CorruptSnapshot(
                f"{e} ({what}). No update was applied{where}: optimizer.step() refuses "
                f"to run on partly restored state. {marked}. Restart the {who}",
                path=e.path, field=e.field)
        return SnapdError(f"{what} could not be used: {e!r}. No update was applied"
                          f"{where}: optimizer.step() refuses to run on partly restored "
                          f"state. Restart the {who}", path=self.loaded.path,
                          field="objects")

    def _from_others(self, others: List[Dict[str, Any]]) -> SnapdError:
        """Another rank's failure, as this rank raises it at the same step."""
        first = next((o for o in others if o["corrupt"]), others[0])
        told = "; ".join(f"rank {o['rank']}: {o['message']}" for o in others)
        marked = f" {self._marked}." if self._marked else ""
        text = (f"restore(overlap=True): the optimizer state of snapshot "
                f"{self.loaded.sid.name} failed on another rank ({told}). No update was "
                "applied on any rank: optimizer.step() refuses to run on partly restored "
                f"state.{marked} Restart the job")
        cls = CorruptSnapshot if first["corrupt"] else SnapdError
        return cls(text, path=first["path"] or self.loaded.path,
                   field=first["field"] or "objects")

    def discard(self) -> None:
        """Stop waiting for this restore's state (another restore replaces it): the
        read is joined, nothing is applied, the hooks go."""
        self._read_done.wait()
        self._remove_hooks()

    def _remove_hooks(self, keep: Any = None) -> None:
        """Every hook, but the one on ``keep`` (an optimizer torch is stepping)."""
        for name in [n for n in self._hooks if self.optimizers[n] is not keep]:
            self._hooks.pop(name).remove()


class RankJoin:
    """The one exchange of a restore with overlap on many ranks, before the first
    update: each rank sends whether its optimizers' state arrived whole (and, if not,
    the file and field that failed, and the message) over the
    client's private gloo group (snapd_client/ranks.py), as JSON bytes; each gets the
    others' failures. Every rank's first step (or snapshot(), or close()) takes part,
    so every rank raises, or none, at the same step."""

    def __init__(self, coll: Collective) -> None:
        self.coll = coll

    def exchange(self, mine: Optional[BaseException], path: str) -> List[Dict[str, Any]]:
        sent = {"ok": mine is None}
        if mine is not None:
            sent.update(corrupt=isinstance(mine, CorruptSnapshot), message=str(mine),
                        path=getattr(mine, "path", None) or path,
                        field=getattr(mine, "field", None))
        gathered = [json.loads(b) for b in self.coll.allgather_bytes(
            json.dumps(sent).encode())]
        return [dict(v, rank=r) for r, v in enumerate(gathered)
                if not v["ok"] and r != self.coll.rank]


def _load_state_only(opt: Any, saved: Dict[str, Any]) -> None:
    """Load the per-parameter state of ``saved`` into ``opt`` through its own
    load_state_dict (which casts each value as that optimizer class wants), with the
    param_groups it holds now, as they are: the same dicts, their values as the
    trainer may have set them since restore()."""
    groups = opt.param_groups
    opt.load_state_dict(dict(saved, param_groups=opt.state_dict()["param_groups"]))
    for kept, loaded in zip(groups, opt.param_groups):
        kept.update(loaded)   # the same values and params; the caller's dicts stay
    opt.param_groups = groups
