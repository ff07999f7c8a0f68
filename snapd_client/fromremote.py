"""Restore on a new node: the remote tier's newer snapshots brought down first.

With ``Options.remote`` set, restore() of one rank (:func:`pull_newer`) asks the remote
root for its commits before it chooses a snapshot. The newest remote commit newer
than the newest local committed snapshot is pulled (snapd/remote/pull.py: every
checksum verified, committed locally by the same rename, LATEST moved to it);
restore then takes it through the usual order, LATEST first. A damaged remote
snapshot is warned of and the next older remote commit that is still newer than the
local ones is tried. A remote that cannot be reached is warned of, and restore goes on
from the local disk: a lost network never stops a job that has what it needs on the
node.

With ``later`` (``restore(overlap=True)``, snapd_client/remotearrival.py) the commit
chosen is pulled in two halves (snapd/remote/pendingpull.py): every file but those of
the objects ``later`` names, verified, is in a local tmp dir when :func:`pull_newer`
returns the PendingPull; restore reads from it, and the background thread finishes
the pull and commits it. A remote commit whose later files were found damaged on this
node is passed over by every later pull (its set-aside copy,
``.damaged-<name>-remote-<nonce>``, says so), as a damaged one is here.

The replicated state log is brought down too when the local log of this rank has no
segment, before the log is read: recovery planning and the replay check then see
what the lost node logged.

All of that is bounded by ``Options.remote_timeout`` (snapd/remote/deadline.py): a
store that accepts connections and never answers costs restore that many seconds
and one RemoteWarning, not botocore's minute and more, and the pull it leaves
behind can no longer commit a snapshot or move a log segment into the root. A pull
whose bytes keep arriving is not cut off: the bound is on silence.

A job of many ranks (:func:`pull_from_remote`, before their agreement on one
snapshot, snapd_client/distrestore.py) pulls on the lowest rank of each node-local
root, and warns with FallbackWarning: every rank then agrees as with one root. There
each S3 call is bounded by ``remote_timeout`` (connect and read, one attempt), not
the whole of the work. With overlap (:func:`pull_for_ranks` with ``later``) that rank
pulls in two halves, and the ranks of its root read the pending pull before it is
committed (snapd_client/remoteranks.py).

The remote is read as the operator commands read a root behind a URL: through
snapd/roots.py's ``open_root`` (a StoreRoot), never the remote layout directly.
"""

from __future__ import annotations

import json
import logging
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Set, Union

from snapd.errors import CorruptSnapshot, InsufficientSpace, RemoteUnavailable, SnapdError
from snapd.store import RunStore, SnapshotId
from snapd_client.ranks import Collective
from snapd_client.restore import FallbackWarning

if TYPE_CHECKING:   # the remote modules are imported only when a remote is set
    from snapd.remote.deadline import Deadline
    from snapd.remote.pendingpull import PendingPull
    from snapd.roots import StoreRoot


logger = logging.getLogger(__name__)


class RemoteWarning(UserWarning):
    """The remote tier could not be used for this restore (unreachable, or its
    snapshot damaged): restore went on with what else there is."""


def pull_newer(store: RunStore, url: str, *, min_free_bytes: int, threads: int = 4,
               timeout: Optional[float] = None, keys: Any = None,
               later: Optional[Callable[[Any], Any]] = None
               ) -> Union[SnapshotId, "PendingPull", None]:
    """Pull the newest remote commit newer than every local committed snapshot, and
    the log when the local one is empty; returns the snapshot pulled, or None. With
    ``later`` (the objects whose files may come last, from a manifest), a one-rank
    commit is left pending: the PendingPull is returned, its finish() to be called.

    ``timeout`` (``Options.remote_timeout``) bounds all of it, pushed out only while
    a pull's bytes keep arriving: past it, one RemoteWarning, and restore goes on from
    the local disk; the pull left behind publishes nothing (snapd/remote/deadline.py)."""
    from snapd.remote.deadline import Deadline
    from snapd.remote.layout import redact
    from snapd.remote.pull import refuse_credentials
    from snapd.roots import StoreRoot
    refuse_credentials(url, where="Client(remote=...)")
    job = _Pull(store, url, min_free_bytes, threads, Deadline(timeout, redact(url)), keys,
                later)
    outcome = job.deadline.run(job, name=f"snapd-remote-pull-{store.run}",   # a slow
                               progress=lambda: StoreRoot.arrived(store))  # pull goes on
    if outcome.timed_out:
        if job.pending is not None:   # handed over before the deadline stopped it
            job.pending.abandon()
        _warn(f"the remote tier {redact(url)} did not answer within remote_timeout="
              f"{timeout:g} s ({job.doing}); restoring from the local disk only. Raise "
              "remote_timeout if the store is slow rather than silent")
        return None
    pulled = outcome.result()
    for message in job.notes:   # said here, on the caller's thread, once each
        _warn(message)
    return pulled


class _Pull:
    """The remote work of one restore, run under a deadline. It says nothing itself:
    its warnings are ``notes`` the caller gives only when the work finished in time
    (a late one would warn after restore went on without it)."""

    def __init__(self, store: RunStore, url: str, min_free_bytes: int, threads: int,
                 deadline: "Deadline", keys: Any = None,
                 later: Optional[Callable[[Any], Any]] = None) -> None:
        self.store, self.url, self.deadline = store, url, deadline
        self.later = later
        self.pending: Optional["PendingPull"] = None   # a pull left for the background
        self.keys = keys   # snapd/signing.py: a record no accepted key signed is refused
        self.min_free_bytes, self.threads = min_free_bytes, threads
        self.doing = "connecting"   # for the timeout's message
        self.notes: List[str] = []

    def __call__(self) -> Union[SnapshotId, "PendingPull", None]:
        from snapd.remote.pendingpull import set_aside_remotely
        from snapd.roots import open_root   # opened here: opening may wait on the store
        store = self.store
        try:
            root = open_root(self.url, timeout=self.deadline.seconds)
            self._next(f"listing the commits of {store.run}")
            commits = root.commits(store.run)
            self._next(f"pulling the state log of {store.run}")
            if root.pull_log(store, deadline=self.deadline):
                logger.info(f"run {store.run}: state log brought down from {root.where}")
        except RemoteUnavailable as e:
            self.notes.append("the remote tier is not reachable, restoring from the "
                              f"local disk only: {e}")
            return None
        local = store.committed()
        newer = [sid for sid in reversed(commits) if not local or sid > local[-1]]
        aside = set_aside_remotely(store)
        for sid in newer:
            if sid.name in aside:
                self.notes.append(f"remote snapshot {store.run}/{sid.name} passed over: "
                                  "a restore on this node found it damaged (its copy is "
                                  f"set aside in {store.snapshots_path}); trying an "
                                  "older one")
                continue
            self._next(f"pulling {store.run}/{sid.name}")
            verdict = self._pull(root, sid)
            if verdict == "pending":
                return self.pending
            if verdict == "pulled":
                return sid
            if verdict == "failed":   # unreachable or no space: no older one either
                return None
        return None   # none newer, or every newer one damaged

    def _next(self, doing: str) -> None:
        """The next phase, not begun once the caller went on (RemoteUnavailable)."""
        self.deadline.check(doing)
        self.doing = doing

    def _pull(self, root: "StoreRoot", sid: SnapshotId) -> str:
        """One remote commit pulled: "pulled", "pending" (its later files still to come:
        ``self.pending``), "damaged" (an older one may do) or "failed"."""
        store = self.store
        try:
            if self.later is not None and self._begin(root, sid):
                return "pending"
            root.pull(root.snap(store.run, sid), store, threads=self.threads,
                      min_free_bytes=self.min_free_bytes, deadline=self.deadline,
                      keys=self.keys)
            logger.info(f"run {store.run}: pulled {sid.name} from {root.where}, verified")
            return "pulled"
        except CorruptSnapshot as e:
            self.notes.append(f"remote snapshot {store.run}/{sid.name} refused: {e}; "
                              "trying an older one (the remote snapshot is left as it is)")
            return "damaged"
        except (RemoteUnavailable, InsufficientSpace) as e:
            self.notes.append(f"remote snapshot {store.run}/{sid.name} could not be "
                              f"pulled, restoring from the local disk only: {e}")
            return "failed"


    def _begin(self, root: "StoreRoot", sid: SnapshotId) -> bool:
        """The first half of a pull in two (snapd/remote/pendingpull.py), handed over
        under the deadline's lock: a caller that went on never gets it, and it is
        abandoned. False when the snapshot is to be pulled whole."""
        pending = root.begin_pull(root.snap(self.store.run, sid), self.store, self.later,
                                  threads=self.threads, min_free_bytes=self.min_free_bytes,
                                  deadline=self.deadline, keys=self.keys)
        if pending is None:
            return False
        try:
            with self.deadline.publishing(f"handing over {self.store.run}/{sid.name}"):
                self.pending = pending
        except BaseException:
            pending.abandon()
            raise
        logger.info(f"run {self.store.run}: pulled {sid.name} from {root.where} but for "
                    f"the files of {', '.join(pending.later)}, verified; those follow")
        return True


def _warn(message: str) -> None:
    warnings.warn(message, RemoteWarning, stacklevel=4)


# --- many ranks on node-local roots: the remote commit brought down onto each root ----

def pull_from_remote(coll: Collective, client: Any) -> set:
    """Before the agreement: rank 0 lists the remote commits and broadcasts them; the
    lowest rank of each root (host and directory) pulls the newest one newer than its
    root's newest local snapshot (snapd/remote/pull.py), trying older ones still newer
    on damage (with the client's signing key: on a record or ``commit.snapd`` no
    accepted key signed, too); a barrier; then every root holds it, and the agreement
    goes on as with one root. Returns the names pulled anywhere. An unreachable remote
    is warned of, and restore goes on from the local roots."""
    return pull_for_ranks(coll, client).names


@dataclass
class RanksPulled:
    """What :func:`pull_for_ranks` did on every rank."""

    names: Set[str]                # the snapshots pulled (or pending) anywhere
    reports: List[Dict[str, Any]]  # per rank: name, tmp, where (set on pulling ranks)
    pullers: List[int]             # per rank: the rank that pulls for its root
    pending: Optional["PendingPull"] = None   # this rank's, when it pulled in two halves


def pull_for_ranks(coll: Collective, client: Any,
                   later: Optional[Callable[[Any], Any]] = None) -> RanksPulled:
    """:func:`pull_from_remote`'s work, every rank's outcome returned. With ``later``
    (restore(overlap=True), snapd_client/remoteranks.py) a commit is pulled in two
    halves (snapd/remote/pendingpull.py): the pulling rank's PendingPull is in
    ``pending``, its tmp dir in its report; nothing is committed yet."""
    listed = json.loads(coll.broadcast_bytes(
        _remote_listing(client) if coll.rank == 0 else None, src=0))
    if listed.get("error"):
        warnings.warn(f"restore(): the remote {listed['url']} could not be listed "
                      f"({listed['error']}); resuming from the local roots only",
                      FallbackWarning, stacklevel=4)
    keys = coll.allgather_bytes(_root_key(client).encode())
    mine: Any = None
    if keys.index(keys[coll.rank]) == coll.rank and listed.get("names"):
        try:   # the lowest rank on this root
            mine = _pull_newest(client, listed["names"], later)
        except Exception as e:   # the others wait at the barrier: nothing escapes
            warnings.warn(f"restore(): pulling from {listed['url']} failed ({e!r}); "
                          "going on from the local root", FallbackWarning, stacklevel=4)
    pending = None if mine is None or isinstance(mine, str) else mine
    report = {"name": mine, "tmp": None, "where": None} if pending is None else \
        {"name": pending.sid.name, "tmp": pending.tmp, "where": pending.where}
    got = coll.allgather_bytes(json.dumps(report).encode())   # also the barrier
    reports = [json.loads(g) for g in got]
    return RanksPulled({r["name"] for r in reports if r["name"]}, reports,
                       [keys.index(k) for k in keys], pending)


def _remote_listing(client: Any) -> bytes:
    url = client.options.remote
    try:
        root = _open_remote(client)
        names = [sid.name for sid in reversed(root.commits(client.store.run))]
        return json.dumps({"url": root.where, "names": names}).encode()
    except Exception as e:   # sent, so that the others go on from local too
        from snapd.remote.layout import redact
        return json.dumps({"url": redact(str(url)), "error": f"{type(e).__name__}: {e}",
                           "names": []}).encode()


def _open_remote(client: Any) -> "StoreRoot":
    """The client's remote, each S3 call bounded by ``remote_timeout`` (one attempt):
    a silent store costs each rank that many seconds a call, not botocore's minute."""
    from snapd.roots import open_root
    return open_root(client.options.remote, timeout=client.options.remote_timeout)


def _root_key(client: Any) -> str:
    """Which ranks share a root: a node's hostname and the root's path (two nodes
    may mount different disks at the same path)."""
    import socket
    return json.dumps([socket.gethostname(), client.store.root])


def _pull_newest(client: Any, names: List[str],
                 later: Optional[Callable[[Any], Any]] = None
                 ) -> Union[str, "PendingPull", None]:
    """The first of ``names`` (newest first) newer than this root's newest committed
    snapshot, pulled; None when the local one is as new, or none could be pulled.
    With ``later``, pulled in two halves where it splits: its PendingPull."""
    from snapd.remote.pendingpull import set_aside_remotely
    store = client.store
    local = store.committed()
    root = _open_remote(client)
    aside = set_aside_remotely(store)   # found damaged by a restore on this node
    for name in names:
        sid = SnapshotId.parse(name)
        if sid is None or (local and sid <= local[-1]):
            return None
        if name in aside:
            continue
        how = dict(threads=client.options.remote_upload_threads,
                   min_free_bytes=client.options.min_free_bytes, keys=client._keys)
        try:
            if later is not None:
                pending = root.begin_pull(root.snap(store.run, sid), store, later,
                                          parts=True, **how)
                if pending is not None:
                    logger.info(f"run {client.run}: rank {client.rank}: pulled {name} "
                                f"from {root.where} into {store.root} but for the files "
                                f"of {', '.join(pending.later)}, verified; those follow")
                    return pending
            root.pull(root.snap(store.run, sid), store, **how)
            logger.info(f"run {client.run}: rank {client.rank}: pulled {name} from "
                        f"{root.where} into {store.root}")
            return name
        except CorruptSnapshot as e:   # damaged, or (UntrustedSnapshot) not signed
            warnings.warn(f"remote snapshot {name} is refused ({e}); trying an older "
                          "one", FallbackWarning, stacklevel=5)
        except SnapdError as e:   # unreachable (RemoteUnavailable), no space
            warnings.warn(f"remote snapshot {name} could not be pulled ({e}); going on "
                          "from the local root", FallbackWarning, stacklevel=5)
            return None
    return None
