"""Replicating the state log to the remote root (docs/remote.md, "Uploading").

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

from snapd.remote import transfer
from snapd.remote.layout import RemoteRoot
from snapd.store import RunStore, list_runs

log = logging.getLogger(__name__)

_RANK = re.compile(r"^rank-\d{5,}$")
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
