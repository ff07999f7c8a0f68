"""Replicating the state log to the remote root (docs/remote.md, "Uploading"), and
bringing it down onto a new node (:func:`pull_log`; docs/remote.md, "Reading").

The log is small and appended all the time; object stores cannot append, so a
segment whose size changed since it was last sent is uploaded whole again, to
``<url>/<run>/log/rank-NNNNN/<segment>``. A segment is read as it is at that moment:
a record being appended may be cut short, which the log's readers already skip as a
torn tail (the next pass sends the rest). Nothing here is a commit: a reader after a
node loss gets the log as of the last pass (every ``remote_log_interval`` seconds
and after each remote commit).
"""

from __future__ import annotations

import logging
import os
import re
import threading
from typing import Dict, List, Set, Tuple

from snapd import diskguard, fsio
from snapd.commit import enospc_of
from snapd.remote import transfer
from snapd.remote.deadline import NO_DEADLINE, Deadline
from snapd.remote.layout import RemoteRoot
from snapd.remote.pull import reaching
from snapd.store import DIR_MODE, RunStore, list_runs

log = logging.getLogger(__name__)

# The names the log's readers list (snapd/statelog.py): anything else under the
# remote log is ignored, never written locally.
_RANK = re.compile(r"^rank-(\d{5,})$")
_SEGMENT = re.compile(r"^\d{12}\.log$")


def log_segments(store: RunStore) -> Dict[str, int]:
    """The run's local log: ``rank-NNNNN/<segment>`` -> size."""
    found: Dict[str, int] = {}
    try:
        ranks = [e for e in os.scandir(store.log_path)
                 if _RANK.match(e.name) and e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return found
    for rank in ranks:
        for seg in os.scandir(rank.path):
            if _SEGMENT.match(seg.name) and seg.is_file(follow_symlinks=False):
                found[f"{rank.name}/{seg.name}"] = seg.stat(follow_symlinks=False).st_size
    return found


class LogSync:
    """What of each run's log is up, and sending what changed."""

    def __init__(self, remote: RemoteRoot, root: str, *, threads: int = 4) -> None:
        self.remote, self.root, self.threads = remote, root, threads
        self._sent: Dict[Tuple[str, str], int] = {}   # (run, relpath) -> size sent
        self._seeded: Set[str] = set()                  # runs whose remote log was listed
        self._lock = threading.Lock()                   # one pass at a time

    def sync(self, run: str) -> int:
        """Upload the run's segments whose size changed; returns how many. Raises
        RemoteUnavailable when the remote fails (the next pass tries again)."""
        with self._lock:
            store = RunStore(self.root, run)
            local = log_segments(store)
            if not local:
                return 0
            if run not in self._seeded:
                self._seed(run)
            todo = sorted(rel for rel, size in local.items()
                          if self._sent.get((run, rel)) != size)
            base = self.remote.log_path(run)
            pairs = [(os.path.join(store.log_path, rel), f"{base}/{rel}") for rel in todo]
            transfer.put_files(self.remote.fs, pairs, threads=self.threads,
                               where=self.remote.where(base))
            for rel in todo:   # the size seen before the put: a later append is resent
                self._sent[(run, rel)] = local[rel]
            return len(todo)

    def _seed(self, run: str) -> None:
        """A restarted daemon does not send again what an earlier one sent."""
        base = self.remote.log_path(run) + "/"
        self.remote.fs.invalidate_cache()
        try:
            found = self.remote.fs.find(base, detail=True)
        except FileNotFoundError:
            found = {}
        for path, info in found.items():
            rel = path[len(base):] if path.startswith(base) else ""
            if rel.count("/") == 1 and _RANK.match(rel.split("/")[0]):
                self._sent[(run, rel)] = int(info.get("size") or 0)
        self._seeded.add(run)

    def runs_with_log(self) -> List[str]:
        return [r for r in list_runs(self.root)
                if os.path.isdir(os.path.join(self.root, r, "log"))]


# --- bringing it down ---------------------------------------------------------------

def pull_log(remote: RemoteRoot, store: RunStore,
             deadline: Deadline = NO_DEADLINE) -> List[int]:
    """The replicated state log of ``store.run``, for each rank whose local log has no
    segment (a new node): so that recovery planning and the replay check see what
    the lost node logged. Returns the ranks brought down; a local log is never
    replaced or mixed with the remote one, and none is moved in past ``deadline``."""
    from snapd import statelog   # the log's naming rules, one place
    pulled = []
    with reaching(remote, f"listing the log of {store.run}"):
        ranks = _remote_log(remote, store.run)
    for rank, segments in sorted(ranks.items()):
        local = statelog.rank_dir(store.path, rank)
        if statelog.list_segments(store.path, rank):
            continue
        deadline.check(f"pulling the log of {store.run} rank {rank}")
        with diskguard.space_for(store.root, str(local), "pulling the state log"):
            store.ensure()
            os.makedirs(local, mode=DIR_MODE, exist_ok=True)
        tmp_pairs = [(src, os.path.join(local, f".pull-{leaf}")) for leaf, src in segments]
        try:
            with reaching(remote, f"downloading the log of {store.run} rank {rank}"):
                transfer.get_files(remote.fs, tmp_pairs, where=remote.url)
            with deadline.publishing(f"moving in the log of {store.run} rank {rank}"):
                for (_, tmp), (leaf, _) in zip(tmp_pairs, segments):
                    os.chmod(tmp, fsio.FILE_MODE)
                    os.replace(tmp, os.path.join(local, leaf))
                fsio.fsync_dir(str(local))
        except BaseException as e:
            space = enospc_of(e)
            if space is None:
                raise
            raise diskguard.out_of_space(space, store.root, str(local),
                                         "pulling the state log") from e
        finally:
            for _, tmp in tmp_pairs:
                if os.path.lexists(tmp):
                    os.unlink(tmp)
        pulled.append(rank)
    if pulled:
        log.debug("run %r: state log of rank(s) %s pulled from %s", store.run,
                 ", ".join(map(str, pulled)), remote.url)
    return pulled


def _remote_log(remote: RemoteRoot, run: str) -> Dict[int, List[tuple]]:
    """rank -> [(segment name, remote path)] of the run's replicated log."""
    from snapd import statelog
    out: Dict[int, List[tuple]] = {}
    for path in remote._ls(remote.log_path(run)):
        leaf = path.rstrip("/").rsplit("/", 1)[-1]
        match = _RANK.match(leaf)
        if match is None or statelog.rank_dir("", int(match.group(1))).name != leaf:
            continue
        rank = int(match.group(1))
        segs = sorted((p.rstrip("/").rsplit("/", 1)[-1], p) for p in remote._ls(path))
        segs = [(n, p) for n, p in segs if _SEGMENT.match(n)]
        if segs:
            out[rank] = segs
    return out
