"""The daemon's side of shared memory: client staging arenas, and its hot copies.

A client stages tensor bytes in ``/dev/shm/snapd-<uid>-<pid>-<nonce>`` and attaches
it; the daemon maps the same file and writes snapshots straight out of it, so tensor
bytes never travel through the socket. Everything about that file is checked before
it is mapped: a plain name (no path) under the prefix of the connecting process (its
pid from SO_PEERCRED, so no peer attaches another's arena or the daemon's hot
copies), not a symlink, owned by the daemon's uid, and exactly the declared size.
Once mapped, the daemon unlinks the name: from then on the memory lives exactly as
long as the two mappings, and no death of either side leaves it in /dev/shm. An
arena whose creator died before attaching it is unlinked by the next daemon.

Slot ownership (docs/protocol.md): a slot is the daemon's from ``submit`` until the
``committed``/``failed`` event. An arena whose client is gone, or which a newer
attach replaced, is *retired*: it stays mapped until its last busy slot is released,
because the daemon finishes what was submitted even when the trainer died.

The hot copy: after a commit the daemon may copy the slot into a segment of its own,
so that a restarted trainer on the same node restores from memory instead of disk.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import stat
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Set, Tuple

import numpy as np
import psutil

from snapd import fsio
from snapd.errors import SnapdError
from snapd.names import SHM_DIR, arena_prefix, hot_prefix

PREPARE_WAIT = 30.0  # at most this long for a spare being made, then make another
_SHM_NAME = re.compile(r"^snapd-[A-Za-z0-9_.-]+$")
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")
_HOT_NONCE = re.compile(r"-(\d+)x[0-9a-f]+$")   # the pid of the daemon that made it
_ARENA_PID = re.compile(r"^snapd-(\d+)-(\d+)-[0-9a-f]+$")   # a client's: uid, pid


def validate_shm_name(name: Any) -> str:
    """A segment name the daemon may open: ``snapd-`` and plain characters only."""
    if not isinstance(name, str) or len(name) > 200 or not _SHM_NAME.match(name) \
            or name in (".", ".."):
        raise SnapdError(f"shared-memory name {name!r} refused: it must match "
                         "snapd-[A-Za-z0-9_.-]+ (a plain name under /dev/shm)")
    return name


def check_arena_owner(name: str, pid: int) -> str:
    """An arena name the connecting process ``pid`` created: its own prefix only."""
    validate_shm_name(name)
    if not name.startswith(arena_prefix(pid)):
        raise SnapdError(f"arena {name!r} refused: a client attaches only arenas it "
                         f"created, named {arena_prefix(pid)}<nonce> (its pid {pid})")
    return name


def reclaim_dead_arenas(shm_dir: str = SHM_DIR) -> int:
    """Unlink client arenas of this uid whose creator is dead; returns how many."""
    removed = 0
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return 0
    for name in names:
        match = _ARENA_PID.match(name)
        if match and int(match.group(1)) == os.getuid() and \
                not psutil.pid_exists(int(match.group(2))):
            _unlink_quietly(os.path.join(shm_dir, name))
            removed += 1
    return removed


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class MappedArena:
    """One client arena as the daemon maps it: ``slots`` equal slots and which of them
    are busy. (The client's side, which creates and fills the arena, is
    ``snapd_client.staging.Arena``.)"""

    def __init__(self, name: str, size: int, slots: int, *, shm_dir: str = SHM_DIR):
        self.name = validate_shm_name(name)
        if not isinstance(size, int) or not isinstance(slots, int) or slots < 1 \
                or size < slots or size % slots:
            raise SnapdError(f"arena {name}: size {size!r} is not {slots!r} equal slots")
        self.path = os.path.join(shm_dir, name)
        self.size, self.slots, self.slot_bytes = size, slots, size // slots
        self._map = self._open_and_map()
        self._busy: Set[int] = set()
        self._lock = threading.Lock()
        self._retired = False
        self._unlink = False
        self.closed = False

    def _open_and_map(self) -> mmap.mmap:
        try:  # O_NOFOLLOW: a symlink planted under the name is refused, not followed
            fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            raise SnapdError(f"arena {self.path}: cannot open ({e.strerror}); create it "
                             "in /dev/shm before attach") from e
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                raise SnapdError(f"arena {self.path}: not a regular file owned by uid "
                                 f"{os.getuid()} (the daemon's)")
            if st.st_size != self.size:
                raise SnapdError(f"arena {self.path}: {st.st_size} bytes, attach "
                                 f"declared {self.size}")
            return mmap.mmap(fd, self.size, mmap.MAP_SHARED,
                             mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            raise SnapdError(f"arena {self.path}: cannot map {self.size} bytes "
                             f"({e.strerror})") from e
        finally:
            os.close(fd)   # the mapping keeps the memory; the fd is not needed

    def unlink_name(self) -> None:
        """Remove the name once mapped: the memory now goes with the last mapping."""
        _unlink_quietly(self.path)

    def slot_view(self, slot: int) -> memoryview:
        start = slot * self.slot_bytes
        return memoryview(self._map)[start:start + self.slot_bytes]

    def acquire(self, slot: Any) -> None:
        """Hand a slot to the daemon (at submit); refuses a busy or unknown slot."""
        with self._lock:
            if self._retired:
                raise SnapdError(f"arena {self.name} was replaced; submit to the new one")
            if not isinstance(slot, int) or not 0 <= slot < self.slots:
                raise SnapdError(f"slot {slot!r} does not exist in arena {self.name} "
                                 f"({self.slots} slots)")
            if slot in self._busy:
                raise SnapdError(f"slot {slot} of arena {self.name} is busy: wait for "
                                 "the committed/failed event of the snapshot in it")
            self._busy.add(slot)

    def release(self, slot: int) -> None:
        """The slot is the client's again; a retired arena closes with its last slot."""
        with self._lock:
            self._busy.discard(slot)
            done = self._retired and not self._busy
        if done:
            self._close()

    @property
    def busy(self) -> Set[int]:
        with self._lock:
            return set(self._busy)

    def retire(self, *, unlink: bool) -> None:
        """No more submits; unmap (and unlink, when the client is gone) once idle."""
        with self._lock:
            self._retired = True
            self._unlink = self._unlink or unlink
            done = not self._busy
        if done:
            self._close()

    def _close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
        try:
            self._map.close()
        except BufferError:
            pass  # a view is still referenced somewhere; the GC unmaps it later
        if self._unlink:
            _unlink_quietly(self.path)   # the client may have unlinked it first


@dataclass
class HotEntry:
    shm: str
    snapshot: str
    plan: Dict[str, Any]
    nbytes: int
    last_seen: float = field(default_factory=time.monotonic)   # publish, or client left


class HotCache:
    """The latest committed snapshot of each (run, rank), in a daemon-owned segment.

    What is held is bounded twice: by ``max_bytes`` for all segments together (the
    copies least recently used by a client go first), and in time, by the daemon,
    which drops a copy once its client closed cleanly, or ``hot_linger_seconds``
    after it left without saying so (:meth:`expire`).
    """

    def __init__(self, *, shm_dir: str = SHM_DIR, max_bytes: int = 0) -> None:
        self.shm_dir = shm_dir
        self.max_bytes = max_bytes or psutil.virtual_memory().total // 4
        self._entries: Dict[Tuple[str, int], HotEntry] = {}
        # The segment a newer commit replaced, kept to be written over by the next
        # copy: its pages are already faulted in, and fresh pages cost this machine
        # several times a warm memcpy (docs/benchmarks.md). Two segments per (run,
        # rank) at most, which is what the copy-then-replace order needs anyway.
        self._spares: Dict[Tuple[str, int], str] = {}
        # Every segment stays mapped while it exists: the next copy into it is a
        # memcpy (~4x cheaper here than write() into tmpfs pages, which looks each
        # page up again), with the GIL released.
        self._mapped: Dict[str, mmap.mmap] = {}
        # After the first commit of a (run, rank) its spare is made in the background,
        # so that no later commit pays for new pages (the first commit does, beside
        # its disk write, like the client's first snapshot pays for its arena).
        self._preparing: Dict[Tuple[str, int], threading.Event] = {}
        self._lock = threading.Lock()

    def segment_name(self, run: str, rank: int) -> str:
        # The nonce starts with the daemon's pid, so that a later daemon can tell
        # the copies of a dead (SIGKILLed) one from a live one's: see reclaim_orphans.
        safe_run = _UNSAFE.sub("_", run)
        return (f"{hot_prefix()}{safe_run}-{rank}-"
                f"{os.getpid()}x{secrets.token_hex(4)}")

    def reclaim_orphans(self) -> int:
        """Unlink hot copies of this uid whose daemon is dead; returns how many."""
        prefix, removed = hot_prefix(), 0
        try:
            names = [n for n in os.listdir(self.shm_dir) if n.startswith(prefix)]
        except OSError:
            return 0
        for name in names:
            match = _HOT_NONCE.search(name)
            if match and not psutil.pid_exists(int(match.group(1))):
                _unlink_quietly(os.path.join(self.shm_dir, name))
                removed += 1
        return removed

    def copy(self, run: str, rank: int, data: memoryview) -> str:
        """Copy ``data`` into a segment (the spare, else a new one); returns its name,
        not yet published. A restore that still reads the spare sees changing bytes
        and falls back to the files: it verifies every tensor's checksum."""
        with self._lock:
            preparing = self._preparing.get((run, rank))
        if preparing is not None:  # its spare is on the way: cheaper than another
            preparing.wait(PREPARE_WAIT)
        with self._lock:
            name = self._spares.pop((run, rank), None)
        mapping = self._mapped.get(name) if name is not None else None
        try:
            if mapping is not None and len(mapping) == max(len(data), 1):
                if len(data):  # a memcpy into faulted-in pages, GIL released
                    np.copyto(np.frombuffer(mapping, dtype=np.uint8, count=len(data)),
                              np.frombuffer(data, dtype=np.uint8))
                return name
            if name is not None:
                self._forget(name)  # another size: the state grew or shrank
            name = self.segment_name(run, rank)
            self._create(name, len(data), data)
        except BaseException:
            if name is not None:
                self._forget(name)
            raise
        return name

    def _create(self, name: str, size: int, data: Optional[memoryview] = None) -> None:
        """A new segment of ``size`` bytes, ``data`` or zeros, kept mapped (populated)
        for the copies to come. New pages are filled by write() or fallocate(), which
        this machine does ~2-5x faster than faulting them in through a mapping."""
        size = max(size, 1)  # mmap refuses empty files
        path = os.path.join(self.shm_dir, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW |
                     os.O_CLOEXEC, 0o600)
        try:
            if data is not None:
                fsio.write_all(fd, data)
                os.ftruncate(fd, size)
            else:
                os.posix_fallocate(fd, 0, size)
            self._mapped[name] = mmap.mmap(
                fd, size, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)

    def _forget(self, name: str) -> None:
        """Unmap and unlink a segment."""
        mapping = self._mapped.pop(name, None)
        if mapping is not None:
            try:
                mapping.close()
            except BufferError:
                pass  # a view is still referenced; the GC unmaps it
        _unlink_quietly(os.path.join(self.shm_dir, name))

    def publish(self, run: str, rank: int, name: str, plan: Dict[str, Any],
                snapshot: str, size: int) -> HotEntry:
        """Make a copied segment the held snapshot of (run, rank); the one it replaces
        becomes the spare (an older spare is unlinked)."""
        entry = HotEntry(name, snapshot, plan, size)
        key = (run, rank)
        with self._lock:
            old = self._entries.get(key)
            self._entries[key] = entry
            extra = self._spares.pop(key, None)
            if old is not None:
                self._spares[key] = old.shm
            prepare = old is None and extra is None and key not in self._preparing
            if prepare:
                self._preparing[key] = threading.Event()
        if extra is not None:
            self._forget(extra)
        self._bound(key)
        if prepare:
            threading.Thread(target=self._prepare_spare, args=(key, size), daemon=True,
                             name=f"snapd-hot-spare-{run}-{rank}").start()
        return entry

    def _prepare_spare(self, key: Tuple[str, int], size: int) -> None:
        """Make a faulted-in segment of ``size`` bytes the spare of ``key``, unless a
        spare appeared meanwhile or the entry is gone. A hot copy is a hint: failure
        (memory short) only means the next commit makes its own segment."""
        name = self.segment_name(*key)
        try:
            if self.held_bytes() + max(size, 1) > self.max_bytes:
                return   # no room for a spare: the next commit makes its own segment
            self._create(name, size)
            with self._lock:
                if key in self._entries and key not in self._spares:
                    self._spares[key], name = name, None
        except OSError:
            pass
        finally:
            if name is not None:
                self._forget(name)
            with self._lock:
                done = self._preparing.pop(key, None)
            if done is not None:
                done.set()

    def discard(self, name: str) -> None:
        """Unlink a copied segment that will not be published (its write failed)."""
        self._forget(name)

    def get(self, run: str, rank: int) -> Optional[HotEntry]:
        with self._lock:
            return self._entries.get((run, rank))

    def drop(self, run: str, rank: int) -> bool:
        """Unlink the held copy of (run, rank) and its spare; False if none was held."""
        with self._lock:
            old = self._entries.pop((run, rank), None)
            spare = self._spares.pop((run, rank), None)
        for name in ([old.shm] if old is not None else []) + ([spare] if spare else []):
            self._forget(name)
        return old is not None

    def fits(self, nbytes: int) -> bool:
        """A copy of ``nbytes`` may be held at all (the bound is for all together)."""
        return max(nbytes, 1) <= self.max_bytes

    def held_bytes(self) -> int:
        return sum(len(m) for m in list(self._mapped.values()))

    def touch(self, run: str, rank: int) -> None:
        """A client of (run, rank) was just seen (it left): its linger starts now."""
        with self._lock:
            entry = self._entries.get((run, rank))
            if entry is not None:
                entry.last_seen = time.monotonic()

    def expire(self, in_use: Iterable[Tuple[str, int]], linger: float) -> List[Tuple[str, int]]:
        """Drop the copies no client in ``in_use`` holds, unseen for over ``linger`` s."""
        keep, now = set(in_use), time.monotonic()
        with self._lock:
            old = [key for key, e in self._entries.items()
                   if key not in keep and now - e.last_seen > linger]
        return [key for key in old if self.drop(*key)]

    def _bound(self, newest: Tuple[str, int]) -> None:
        """Evict the least recently seen copies (then ``newest``'s spare) until all
        segments together fit ``max_bytes``."""
        while self.held_bytes() > self.max_bytes:
            with self._lock:
                others = sorted((e.last_seen, key) for key, e in self._entries.items()
                                if key != newest)
                spare = self._spares.pop(newest, None) if not others else None
            if others:
                self.drop(*others[0][1])
            elif spare is not None:
                self._forget(spare)
            else:
                return

    def close(self) -> None:
        """Unlink every hot segment (clean shutdown: the memory is returned)."""
        with self._lock:
            names = [e.shm for e in self._entries.values()] + list(self._spares.values())
            self._entries, self._spares = {}, {}
        for name in set(names) | set(self._mapped):
            self._forget(name)


