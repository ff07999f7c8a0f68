"""The SHA-256 of each committed manifest as the state log recorded it at commit.

Why the log: a manifest's xxh3 digests only say that its files are as the manifest
describes them. Whoever can write the snapshot directory can replace a tensor file and
rewrite the manifest to match (its xxh3 digests, and its SHA-256s too). The log is a
second witness, written by the trainer when the daemon reported the commit: its
``committed`` record keeps ``manifest_sha256``, the SHA-256 of the manifest's bytes
(docs/format.md, "Records"). A manifest whose SHA-256 differs from that record was
rewritten after the commit, and restore refuses it like any damaged snapshot.

The log is walked newest first, lazily, only as far as the snapshots asked about: a
restore that takes the newest snapshot reads back to its commit record, no further.
A snapshot the log has no record of (committed by a process killed before it logged,
pulled from the remote tier, written with option ``sha256`` off, by an older snapd,
or a part of a multi-rank snapshot) has no logged SHA-256, and is checked by its own
manifest alone. The newest committed record of a name stands, even when a later
record says the snapshot was refused or set aside: a writer that commits that name
again logs a new record, and the one case where it does not (the trainer killed
between the commit and its record) costs a refusal and a fallback, where honouring
the refusal would let whoever damaged the snapshot once replace it unseen.
"""

from __future__ import annotations

import os
from typing import Dict, Iterator, Optional

from snapd import statelog


class LoggedDigests:
    """``get(name)``: the SHA-256 (hex) of snapshot ``name``'s manifest that the log
    of (run, rank) recorded at its commit, or None when it recorded none."""

    def __init__(self, run_dir: str | os.PathLike, rank: int) -> None:
        self.run_dir, self.rank = run_dir, rank
        self._found: Dict[str, Optional[str]] = {}
        self._records: Optional[Iterator[dict]] = None
        self._done = False

    def get(self, name: str) -> Optional[str]:
        while name not in self._found and not self._done:
            self._next()
        return self._found.get(name)

    def _next(self) -> None:
        if self._records is None:
            if not os.path.isdir(statelog.rank_dir(self.run_dir, self.rank)):
                self._done = True
                return
            self._records = statelog.newest_first(self.run_dir, self.rank)
        record = next(self._records, None)
        if record is None:
            self._done = True
            return
        if record.get("kind") == "snapshot" and record.get("event") == "committed" \
                and isinstance(record.get("name"), str):
            sha = record.get("manifest_sha256")
            # newest first: the first record of a name stands
            self._found.setdefault(record["name"], sha if isinstance(sha, str) else None)

    def close(self) -> None:
        if self._records is not None:
            self._records.close()   # a generator: closes the segment it reads
