"""Restore with overlap on many ranks from the remote tier: one pull per root, its
optimizers' files downloaded while the first forward and backward run.

``restore(overlap=True)`` on many ranks with ``remote`` set pulls the newest remote
commit as restore without overlap does (snapd_client/fromremote.py
``pull_for_ranks``: the lowest rank of each node-local root pulls for it), but in two
halves (snapd/remote/pendingpull.py): every file but the deferred optimizers' is
brought down and verified into a tmp dir of each root before the agreement, and the
ranks agree on it as their first candidate, reading it from that dir
(:class:`RootPull`). Used only when the rank that pulls for every root has the same
snapshot pending (:func:`shared_pull`); else each such rank finishes its pull whole
now, and all meet once more before the agreement, as without overlap.

Agreed on it, each rank's background read (:class:`PulledRead`) goes:

1. the rank that pulled for the root downloads the later files into the tmp dir
   (under its own ``remote_timeout``); the others of the root do not read them yet;
2. every rank's background thread takes part in one all-gather over the private gloo
   group (JSON bytes): whether each root's download arrived. A rank learns it from its
   puller's entry; a failed download fails every rank of that root (not corrupt);
3. each rank reads its own piece of the optimizers' state from the tmp dir (a
   replicated tensor stored in another rank's part: read there), every byte verified;
   the puller also verifies the later files of every part, as a whole pull would.

At the first ``optimizer.step()`` the ranks join (:class:`PulledJoin`, the one
exchange of overlaprestore.RankJoin): every rank's read has ended, so the puller may
act on the dir. All arrived whole: it commits the snapshot on its root (the one
publish() rule, LATEST moved). Damage anywhere: every rank raises at that step, no
update applied, and every puller keeps its download set aside as
``.damaged-<name>-remote-<nonce>``, so the next start of every rank passes that remote
commit over. Any other failure: every rank raises, the downloads are removed, and
the next start pulls again. A kill leaves a ``.tmp-`` dir, never read: nothing
committed. The two collectives of a rank never overlap: its join waits for its read.
"""

from __future__ import annotations

import json
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional

from snapd.errors import CorruptSnapshot, RemoteUnavailable, SnapdError
from snapd.store import SnapshotId
from snapd_client.fromremote import RanksPulled, RemoteWarning
from snapd_client.overlaprestore import RankJoin
from snapd_client.ranks import Collective
from snapd_client.remotearrival import finish_whole, set_aside_pulled
from snapd_client.restore import Pending


@dataclass
class RootPull:
    """The snapshot every root has pending, as this rank sees it: its root's tmp dir,
    the rank that pulled for that root, and that rank's PendingPull (on it only)."""

    name: str
    tmp: str            # on this rank's root
    where: str          # the remote snapshot, for messages
    puller: int
    pending: Any = None

    @property
    def candidate(self) -> Pending:
        """The agreement's first candidate (rank 0's plan)."""
        return Pending(SnapshotId.parse(self.name), self.tmp, ())

    @contextmanager
    def named(self) -> Iterator[None]:
        """A CorruptSnapshot about a file in the tmp dir, raised again naming the
        remote file it came from (the tmp dir is renamed or removed afterwards)."""
        try:
            yield
        except CorruptSnapshot as e:
            path = e.path.replace(self.tmp, self.where) if e.path else self.where
            raise CorruptSnapshot(str(e).replace(self.tmp, self.where), path=path,
                                  field=e.field) from e

    def abandon(self) -> None:
        """Nothing committed: the puller removes its download."""
        if self.pending is not None:
            self.pending.abandon()

    def after_agreement(self, agreed: Optional[str], refused: Dict[str, str]) -> None:
        """Every rank has left the agreement (nobody reads the dir now). Refused as
        damaged: set aside; passed over for an older one (``verify_steps``): finished
        whole and committed, as a pull without overlap leaves it."""
        if self.pending is None or agreed == self.name:
            return
        if self.name in refused:
            warnings.warn(f"remote snapshot {self.where} refused: "
                          f"{set_aside_pulled(self.pending)}", RemoteWarning, stacklevel=3)
        else:
            finish_whole(self.pending)


def shared_pull(coll: Collective, pulled: RanksPulled) -> Optional[RootPull]:
    """The snapshot pending on every root, or None. When only some roots have one
    pending, each of their pullers finishes its pull whole now, and every rank meets
    once more, so that no rank reads a root whose pull is still committing."""
    pullers = sorted(set(pulled.pullers))
    reports = pulled.reports
    first = reports[pullers[0]]
    if all(reports[p]["tmp"] and reports[p]["name"] == first["name"] for p in pullers):
        mine = reports[pulled.pullers[coll.rank]]
        return RootPull(first["name"], mine["tmp"], mine["where"],
                        pulled.pullers[coll.rank], pulled.pending)
    if any(reports[p]["tmp"] for p in pullers):
        if pulled.pending is not None:
            finish_whole(pulled.pending)
        coll.allgather_bytes(b"")   # every root's pull is settled before any reads
    return None


class PulledRead:
    """The background read of one rank (steps 1-3 of the module docstring): returns
    its deferred optimizers' states, read by ``read`` from the tmp dir."""

    def __init__(self, pull: RootPull, coll: Collective, read: Callable[[], Dict[str, Any]],
                 *, names: List[str], threads: int, timeout: Optional[float]) -> None:
        self.pull, self.coll, self.read = pull, coll, read
        self.names, self.threads, self.timeout = names, threads, timeout

    def __call__(self) -> Dict[str, Any]:
        error: Optional[Exception] = None
        if self.pull.pending is not None:
            try:
                self._fetch()                                                   # 1.
            except Exception as e:   # the others of this root hear of it: no escape
                error = e
        told = [json.loads(b) for b in self.coll.allgather_bytes(json.dumps(   # 2.
            {"ok": error is None, "message": "" if error is None else str(error)}
        ).encode())]
        if error is not None:
            raise error
        root = told[self.pull.puller]
        if not root["ok"]:
            raise RemoteUnavailable(
                f"{self.pull.where}: rank {self.pull.puller}, which pulls for this "
                f"root, could not download the files of {', '.join(self.names)} "
                f"({root['message']}); nothing was committed locally, and the next start "
                "pulls the snapshot again", path=self.pull.where, field="remote")
        with self.pull.named():                                                 # 3.
            states = self.read()
        if self.pull.pending is not None:
            self.pull.pending.verify_later()
        return states

    def _fetch(self) -> None:
        """The later files downloaded, bounded by ``remote_timeout`` of silence."""
        from snapd.remote.deadline import Deadline
        from snapd.remote.layout import redact
        from snapd.remote.pull import arrived
        pending = self.pull.pending
        deadline = Deadline(self.timeout, redact(pending.remote.url))
        outcome = deadline.run(lambda: pending.fetch(threads=self.threads),
                               name=f"snapd-remote-pull-{pending.store.run}",
                               progress=lambda: arrived(pending.store))
        if outcome.timed_out:   # the download left behind commits nothing
            raise RemoteUnavailable(
                f"{self.pull.where}: the files of {', '.join(self.names)} did not "
                f"arrive: the remote tier was silent for remote_timeout={self.timeout:g} "
                "s, and nothing was committed locally. Restart (the next start pulls "
                "again), or raise remote_timeout if the store is slow rather than silent",
                path=self.pull.where, field="remote_timeout")
        outcome.result()


class PulledJoin(RankJoin):
    """The ranks' join before the first update (overlaprestore.RankJoin), then the
    puller's part: commit when every rank's state arrived whole, set aside on damage
    anywhere, remove otherwise. ``said``: what became of the download, for messages."""

    def __init__(self, coll: Collective, pull: RootPull, loaded: Any, final: str) -> None:
        super().__init__(coll)
        self.pull, self.loaded, self.final = pull, loaded, final
        self.said = (f"{pull.name} is not committed locally: rank {pull.puller} sets its "
                     "download aside, so the next start of every rank passes that remote "
                     "snapshot over and resumes from an older one")

    def exchange(self, mine: Optional[BaseException], path: str) -> List[Dict[str, Any]]:
        try:
            others = super().exchange(mine, path)
        except BaseException:   # a rank gone: nothing says the others are whole
            self.pull.abandon()
            raise
        if mine is None and not others:
            self.loaded.path = self.final
        if self.pull.pending is not None:
            self._settle(mine, others)
        return others

    def _settle(self, mine: Optional[BaseException], others: List[Dict[str, Any]]) -> None:
        pending = self.pull.pending
        if mine is None and not others:
            try:
                pending.commit()
            except (OSError, SnapdError) as e:   # the state is whole: training goes on
                warnings.warn(f"remote snapshot {self.pull.where}: every rank's state "
                              f"arrived whole, but committing it in {self.final} failed "
                              f"({e}); the next start pulls it again", RemoteWarning,
                              stacklevel=2)
        elif isinstance(mine, CorruptSnapshot) or any(o["corrupt"] for o in others):
            self.said = set_aside_pulled(pending)
        else:
            pending.abandon()
