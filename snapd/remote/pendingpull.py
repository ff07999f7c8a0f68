"""A pull in two halves: what a restore applies now, then the files it can wait for.

``restore(overlap=True)`` on a new node (snapd_client/fromremote.py) needs, before it
returns, every file of the newest remote commit but those of the objects it leaves
to the background (an optimizer's per-parameter state: most of the bytes). So the
pull of snapd/remote/pull.py is done in two halves over one tmp dir:

:func:`begin_pull` (on restore's thread, under its ``remote_timeout``)
  1-3. as a pull: the record, the listing, the free space for all of it;
  4a.  the top file (``manifest.snapd``), checked against the record; ``later``
       names, from its manifest, the objects whose files may come last;
  4b.  every other file (and the shared files), downloaded;
  5a.  the objects that are here read and verified, the manifest's identity checked.

:meth:`PendingPull.finish` (on the background thread, before the first update)
  4c.  the later files downloaded;
  5b.  the caller's ``read`` of them from the tmp dir, which verifies every checksum
       as it reads (snapd_client/restore.py ``read_step_state``): the bytes are read
       once, and nothing unverified is ever committed;
  6.   fsync, then the one publish() rule (snapd/commit.py), as every pull.

Until step 6 the snapshot is not committed: a process killed in between leaves a
``.tmp-`` dir, never read and collected as any (``snapd gc --collect-tmp``), and the
next start pulls again. A failure of either half removes the tmp dir, except damage
found in 5b: that dir is kept, set aside as ``.damaged-<name>-remote-<nonce>``
(:meth:`PendingPull.set_aside`), and :func:`set_aside_remotely` lists it so that the
next pull of the run passes that remote commit over (a remote snapshot found damaged
once is not resumed from again; removing the set-aside copy lifts that).

A commit of many ranks is split the same way for a restore on many ranks (``parts``;
a restore of one rank pulls it whole): 4a brings down the commit record and
every part's manifest, the later objects are those ``later`` names in every part, and
5a verifies every other object of every part. On many ranks the background half is
taken apart (:meth:`PendingPull.fetch`, :meth:`PendingPull.verify_later`,
:meth:`PendingPull.commit`), so that the commit waits until every rank has read its
own part (snapd_client/remoteranks.py).
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
from typing import Any, Callable, Dict, Iterable, List, Optional, Set, TypeVar

from snapd import diskguard, fsio
from snapd import format as fmt
from snapd.commit import enospc_of
from snapd.errors import CorruptSnapshot
from snapd.globalsnap import GlobalSnapshot
from snapd.reader import SnapshotReader
from snapd.remote.deadline import NO_DEADLINE, Deadline
from snapd.remote.layout import RemoteRoot, record_files
from snapd.remote.pull import (Progress, check_before_download, download, fsync_tree,
                               named_remotely, publish_pulled, pull_shared,
                               verify_pulled)
from snapd.store import DAMAGED_PREFIX, RunStore, SnapshotId

log = logging.getLogger(__name__)

T = TypeVar("T")

# Which objects' files may come last, from the snapshot's manifest (a reader of the
# tmp dir holding only the top file): chosen by the client, named here by object.
Later = Callable[[SnapshotReader], Iterable[str]]

REMOTE_MARK = "-remote-"   # in a set-aside name: the copy came from the remote tier


class PendingPull:
    """A remote snapshot in a local tmp dir, all but the files of ``later`` verified;
    :meth:`finish` commits it, :meth:`set_aside` or :meth:`abandon` do not."""

    def __init__(self, remote: RemoteRoot, store: RunStore, sid: SnapshotId,
                 record: Dict[str, Any], tmp: str, later: List[str],
                 files: List[Any], need: int) -> None:
        self.remote, self.store, self.sid, self.record = remote, store, sid, record
        self.tmp = tmp
        self.later = later            # the objects whose files are still remote
        self._files = files           # those files (layout.RemoteFile)
        self._need = need
        self.where = remote.where(remote.snapshot_path(store.run, sid.name))

    @property
    def final(self) -> str:
        return self.store.snapshot_path(self.sid)

    def finish(self, read: Callable[[str], T], *, threads: int = 4,
               progress: Progress = None, deadline: Deadline = NO_DEADLINE) -> T:
        """Steps 4c, 5b, 6: the later files downloaded, ``read(tmp)`` (which verifies
        them; its CorruptSnapshot names the remote file), then the commit. Returns what
        ``read`` returned. On damage the tmp dir is left for :meth:`set_aside`; on any
        other failure it is removed."""
        self.fetch(threads=threads, progress=progress)                          # 4c.
        result = self._settled(lambda: self._read_named(read, deadline))        # 5b.
        self.commit(deadline=deadline)                                          # 6.
        return result

    def fetch(self, *, threads: int = 4, progress: Progress = None) -> None:
        """Step 4c alone: the later files downloaded into the tmp dir (on many ranks,
        before the ranks of this root read them; the commit waits for their join)."""
        self._settled(lambda: download(self.remote, self.store.run, self.sid.name,
                                       self.record, self.tmp, threads, progress,
                                       files=self._files))

    def verify_later(self) -> None:
        """Step 5b for files no caller reads: every later object of every part read
        and verified, one at a time (on many ranks, the rank that pulled for a root
        checks them all, as a whole pull would; each rank also reads its own)."""
        def each(tmp: str) -> None:
            for reader in _readers(tmp, self.record):
                for name in [n for n in self.later if n in reader.objects]:
                    reader.load_object(name)
        self._read_named(each, NO_DEADLINE)   # the dir stays: the caller decides

    def commit(self, *, deadline: Deadline = NO_DEADLINE) -> None:
        """Step 6 alone: fsync, then the one publish() rule (snapd/commit.py)."""
        run, name = self.store.run, self.sid.name

        def publish() -> None:
            with deadline.local_work():
                fsync_tree(self.tmp)
            with deadline.publishing(f"committing {run}/{name} locally"):
                publish_pulled(self.store, self.tmp, self.sid)
        self._settled(publish)
        log.debug("run %r: pulled %s from %s, its later files too", run, name,
                  self.remote.url)

    def _read_named(self, read: Callable[[str], T], deadline: Deadline) -> T:
        with deadline.local_work():
            with named_remotely(self.remote, self.store.run, self.sid, self.tmp):
                return read(self.tmp)

    def _settled(self, work: Callable[[], T]) -> T:
        """``work`` on the tmp dir: on damage the dir stays, for :meth:`set_aside`; on
        any other failure it is removed (a full disk said as InsufficientSpace)."""
        try:
            return work()
        except CorruptSnapshot:
            raise   # the dir stays, for set_aside()
        except BaseException as e:
            self.abandon()
            space = enospc_of(e)
            if space is not None:
                raise diskguard.from_enospc(space, self.store.root, self._need) from e
            raise

    def set_aside(self) -> str:
        """Damage found in the later files: the tmp dir kept as
        ``.damaged-<name>-remote-<nonce>`` (durably), which the next pull passes over;
        returns that path."""
        away = os.path.join(self.store.snapshots_path, f"{DAMAGED_PREFIX}{self.sid.name}"
                            f"{REMOTE_MARK}{secrets.token_hex(4)}")
        os.rename(self.tmp, away)
        fsio.fsync_dir(self.store.snapshots_path)
        return away

    def abandon(self) -> None:
        """Nothing committed: the tmp dir removed (a crash leaves it to gc)."""
        shutil.rmtree(self.tmp, ignore_errors=True)


def begin_pull(remote: RemoteRoot, store: RunStore, name: str, later: Later, *,
               threads: int = 4, progress: Progress = None,
               min_free_bytes: Optional[int] = None, deadline: Deadline = NO_DEADLINE,
               keys: Any = None, parts: bool = False) -> Optional[PendingPull]:
    """Steps 1-5a of remote snapshot ``name`` of ``store.run``; the pending pull, or
    None when it cannot be split (one committed locally already, or no object
    ``later`` names has a file of its own): then the caller pulls it whole
    (snapd/remote/pull.py). A commit of many ranks is split only with ``parts`` (a
    restore on many ranks, which reads it part by part), by the objects ``later``
    names in every part (each part's manifest is brought down with the top file)."""
    sid = SnapshotId.parse(name)
    if sid is None or os.path.isdir(store.snapshot_path(sid)):
        return None
    checked = check_before_download(                                       # 1-3.
        remote, store, name, keys, progress, deadline, min_free_bytes,
        accept=lambda record: record["world_size"] == 1 or parts)
    if checked is None:
        return None
    record, wanted, need = checked
    tmp = store.new_tmp_dir(sid)
    try:
        files = record_files(record)
        heads = [f for f in files if f.relpath == record["top"]
                 or os.path.basename(f.relpath) == fmt.MANIFEST_NAME]
        download(remote, store.run, name, record, tmp, threads, progress, keys,
                 files=heads)                                              # 4a.
        with named_remotely(remote, store.run, sid, tmp):
            readers = _readers(tmp, record)
        later_objects = sorted(set.intersection(*[set(later(r)) for r in readers]))
        late_files = {os.path.relpath(os.path.join(r.path, f), tmp) for r in readers
                      for f in _own_files(r, later_objects)}
        if not late_files:
            shutil.rmtree(tmp, ignore_errors=True)
            return None
        download(remote, store.run, name, record, tmp, threads, progress,   # 4b.
                 files=[f for f in files if f.relpath not in late_files
                        and f.relpath not in {h.relpath for h in heads}])
        brought = pull_shared(remote, store, wanted, threads, progress)
        now = sorted({n for r in readers for n in r.objects} - set(later_objects))
        with deadline.local_work():
            verify_pulled(remote, store.run, sid, record, tmp, brought,     # 5a.
                          objects=now)
        deadline.check(f"pulling {store.run}/{name}")
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        space = enospc_of(e)
        if space is not None:
            raise diskguard.from_enospc(space, store.root, need) from e
        raise
    return PendingPull(remote, store, sid, record, tmp, later_objects,
                       [f for f in files if f.relpath in late_files], need)


def _readers(tmp: str, record: Dict[str, Any]) -> List[SnapshotReader]:
    """The snapshot in ``tmp`` as its parts' readers (one for a one-rank snapshot),
    each checked against the record or commit record, no tensor file stat'ed."""
    if record["world_size"] == 1:
        return [SnapshotReader(tmp, objects=[])]
    return GlobalSnapshot(tmp, check_files=False).parts()


def _own_files(reader: SnapshotReader, objects: List[str]) -> Set[str]:
    """The files that hold only ``objects``' tensors (one file per object: a file
    another object also reads is not left for later)."""
    def file_of(n: str) -> Optional[str]:
        return reader.objects[n].get("file")
    theirs = {file_of(n) for n in objects if n in reader.objects} - {None}
    others = {file_of(n) for n in reader.objects if n not in objects}
    return theirs - others


def set_aside_remotely(store: RunStore) -> Set[str]:
    """The names of the remote commits whose later files were found damaged on this
    node (:meth:`PendingPull.set_aside`): a pull passes them over."""
    try:
        names = os.listdir(store.snapshots_path)
    except FileNotFoundError:
        return set()
    found = set()
    for n in names:
        if n.startswith(DAMAGED_PREFIX) and REMOTE_MARK in n:
            name = n[len(DAMAGED_PREFIX):].rsplit(REMOTE_MARK, 1)[0]
            if SnapshotId.parse(name) is not None:
                found.add(name)
    return found
