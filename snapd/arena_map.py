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

The hot copy (:class:`HotCache`): a client that wants one attaches its arena as
``hot``, with a slot to spare. The daemon then renames the file to a name of its own,
``snapd-hot-<uid>-<run>-<rank>-<daemon pid>x<nonce>``, instead of unlinking it, and
after each commit *holds* the committed slot: a restarted trainer on the same node
reads it by that name instead of the files. The name says which daemon keeps it, so
that the next daemon unlinks what a SIGKILLed one left (``reclaim_orphans``), and
never what a live one holds.
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

import psutil

from snapd.errors import SnapdError
from snapd.names import SHM_DIR, arena_prefix, hot_prefix
from snapd.plan import used_bytes

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


def hot_segment_name(run: str, rank: int) -> str:
    """The daemon's name for a held arena of (run, rank). It ends with the daemon's
    pid, so that a later daemon can tell the arenas a dead (SIGKILLed) one held from
    a live one's: see HotCache.reclaim_orphans."""
    return (f"{hot_prefix()}{_UNSAFE.sub('_', run)}-{rank}-"
            f"{os.getpid()}x{secrets.token_hex(4)}")


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
    """One client arena as the daemon maps it: ``slots`` equal slots, which of them
    are busy (submitted, being written) and which is held (the hot copy). (The
    client's side, which creates and fills the arena, is
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
        self._held: Set[int] = set()   # committed slots served as hot copies
        self._lock = threading.Lock()
        self._retired = False
        self._unlink = False
        self.closed = False
        self.hot = False   # attached as hot: its committed slot is held (server.py)

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

    def take_name(self, name: str) -> None:
        """Rename the file to ``name`` (a hot arena: the daemon's name, which a
        restarted trainer opens and the daemon unlinks when it lets go)."""
        path = os.path.join(os.path.dirname(self.path), validate_shm_name(name))
        try:
            os.rename(self.path, path)
        except OSError as e:
            raise SnapdError(f"arena {self.path}: cannot rename it to {path} "
                             f"({e.strerror})") from e
        self.path, self.name = path, name
        self._unlink = True   # the client no longer knows the name: ours to unlink

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
            if slot in self._held:
                raise SnapdError(f"slot {slot} of arena {self.name} holds the latest "
                                 "committed snapshot (the hot copy): stage into another "
                                 "until a newer snapshot commits", field="slot")
            self._busy.add(slot)

    def hold(self, slot: int) -> None:
        """Keep ``slot`` (a committed snapshot) mapped and unwritten: the hot copy."""
        with self._lock:
            self._held.add(slot)

    def unhold(self, slot: int) -> None:
        """The slot is no longer the hot copy; a retired arena closes with it."""
        with self._lock:
            self._held.discard(slot)
            done = self._retired and not self._busy and not self._held
        if done:
            self._close()

    def release(self, slot: int) -> None:
        """The slot is the client's again; a retired arena closes with its last slot."""
        with self._lock:
            self._busy.discard(slot)
            done = self._retired and not self._busy and not self._held
        if done:
            self._close()

    @property
    def busy(self) -> Set[int]:
        with self._lock:
            return set(self._busy)

    def retire(self, *, unlink: bool) -> None:
        """No more submits; unmap (and unlink, when the client is gone) once idle and
        no slot is held (a dead trainer's hot copy waits for its restart)."""
        with self._lock:
            self._retired = True
            self._unlink = self._unlink or unlink
            done = not self._busy and not self._held
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


def rebased(desc: Dict[str, Any], base: int) -> Dict[str, Any]:
    """A plan descriptor over a slot, its tensors' offsets made relative to the start
    of the whole arena (``base``: the slot's start), so that a reader of the file
    needs no slot number."""
    objects = [dict(o, tensors=[t if "ref" in t else dict(t, offset=t["offset"] + base)
                                for t in o["tensors"]]) for o in desc["objects"]]
    return dict(desc, objects=objects)


@dataclass
class HotEntry:
    shm: str                 # the arena's name in /dev/shm
    snapshot: str
    plan: Dict[str, Any]     # offsets from the start of the arena file
    nbytes: int
    arena: MappedArena
    slot: int
    last_seen: float = field(default_factory=time.monotonic)   # publish, or client left


class HotCache:
    """The latest committed snapshot of each (run, rank): a slot of its client's own
    arena, held.

    No byte is copied for it: a client that wants hot restores stages into an arena
    with one slot more than it needs (``hot`` attach), and the slot of its latest
    commit is *held* (:meth:`MappedArena.hold`): neither side writes it until a newer
    snapshot of the run commits, which takes over. So /dev/shm holds the state twice
    (the slot being staged and the committed one), not three times as with a copy
    into segments of the daemon's own. The arena stays mapped, and named, while a
    slot of it is held, even after its client died: that is what a restarted trainer
    reads.

    What is held is bounded twice: by ``max_bytes`` for all held arenas together,
    each counted whole (those least recently used by a client go first), and in time, by the daemon,
    which drops a copy once its client closed cleanly, or ``hot_linger_seconds``
    after it left without saying so (:meth:`expire`).

    Why a (run, rank) has no copy is kept too (:meth:`why_not`): a restart that
    reads the files instead of memory is told why, and so is the daemon's log.
    """

    def __init__(self, *, shm_dir: str = SHM_DIR, max_bytes: int = 0) -> None:
        self.shm_dir = shm_dir
        self.max_bytes = max_bytes or psutil.virtual_memory().total // 4
        self._entries: Dict[Tuple[str, int], HotEntry] = {}
        # Why a (run, rank) holds no copy: the last drop's or refusal's reason.
        self._gone: Dict[Tuple[str, int], str] = {}
        self._lock = threading.Lock()

    def reclaim_orphans(self) -> int:
        """Unlink held arenas (and hot copies of older versions) of this uid whose
        daemon is dead; returns how many."""
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

    def publish(self, run: str, rank: int, arena: MappedArena, slot: int,
                desc: Dict[str, Any], snapshot: str) -> HotEntry:
        """Make ``slot`` of ``arena`` (just committed as ``snapshot``) the held
        snapshot of (run, rank); the slot it replaces is the client's again."""
        entry = HotEntry(arena.name, snapshot, rebased(desc, slot * arena.slot_bytes),
                         used_bytes(desc), arena, slot)
        arena.hold(slot)
        with self._lock:
            old = self._entries.get((run, rank))
            self._entries[(run, rank)] = entry
            self._gone.pop((run, rank), None)
        if old is not None:
            old.arena.unhold(old.slot)
        self._bound((run, rank))
        return entry

    def get(self, run: str, rank: int) -> Optional[HotEntry]:
        with self._lock:
            return self._entries.get((run, rank))

    def drop(self, run: str, rank: int, reason: str = "") -> bool:
        """Let go of the held snapshot of (run, rank); False if none was held. An
        arena whose client is gone is unmapped and unlinked with it. ``reason``
        (why the copy went: "its client closed cleanly") is what :meth:`why_not`
        says of a copy that was held."""
        with self._lock:
            old = self._entries.pop((run, rank), None)
            if old is not None and reason:
                self._gone[(run, rank)] = f"the hot copy of {old.snapshot} was released: " \
                                          f"{reason}"
        if old is not None:
            old.arena.unhold(old.slot)
        return old is not None

    def refuse(self, run: str, rank: int, snapshot: str, reason: str) -> None:
        """The newest snapshot of (run, rank) is not held, for ``reason``; an older
        copy is dropped (it is not the latest any more)."""
        self.drop(run, rank)
        with self._lock:
            self._gone[(run, rank)] = f"{snapshot} was not held in memory: {reason}"

    def why_not(self, run: str, rank: int) -> Optional[str]:
        """Why (run, rank) has no copy, when one was held or refused; None when this
        cache never heard of it."""
        with self._lock:
            return self._gone.get((run, rank))

    def fits(self, arena_bytes: int) -> bool:
        """A slot of an arena of ``arena_bytes`` may be held at all (the bound is for
        all together)."""
        return max(arena_bytes, 1) <= self.max_bytes

    def held_bytes(self) -> int:
        """Each held arena whole: what holding keeps alive once its client is gone."""
        with self._lock:
            return sum(e.arena.size for e in self._entries.values())

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
        reason = f"no client for {linger:g} s (hot_linger_seconds)"
        return [key for key in old if self.drop(*key, reason=reason)]

    def _bound(self, newest: Tuple[str, int]) -> None:
        """Drop the least recently seen held snapshots until all together fit
        ``max_bytes`` (``newest`` is never dropped: it fits, see :meth:`fits`)."""
        while self.held_bytes() > self.max_bytes:
            with self._lock:
                others = sorted((e.last_seen, key) for key, e in self._entries.items()
                                if key != newest)
            if not others:
                return
            self.drop(*others[0][1], reason=f"all hot copies together are kept within "
                                            f"hot_max_bytes ({self.max_bytes} bytes)")

    def close(self) -> None:
        """Let go of every held snapshot (clean shutdown: the memory is returned)."""
        with self._lock:
            entries, self._entries = list(self._entries.values()), {}
        for entry in entries:
            entry.arena.unhold(entry.slot)
