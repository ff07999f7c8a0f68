"""Hot restore: tensors from the daemon's in-memory copy of the latest snapshot.

After a commit the daemon may hold the snapshot's slot of the trainer's arena (named
by the daemon; snapd/arena_map.py). A trainer restarted on the same node then reads
its tensors from memory instead of disk. The segment is a hint, like LATEST: it is
used only for the snapshot restore() chose, and each tensor must match the committed
manifest (path, dtype, shape, size, and the xxh3 of its raw bytes) or the object is
read from the files instead.

Each byte is copied once: the segment is read (pread, not mapped: mapping 1 GiB of
4 KiB pages costs more than copying it on a VM) straight into the tensor the live
module or optimizer already holds at that path, when one fits, and hashed there in
pieces small enough to still be in cache. ``load_state_dict`` then finds its own
tensors and copies nothing, and no new memory is touched (new pages are what such a
machine writes slowest). Tensors with no live counterpart get new memory. What fits,
and what else an entry becomes, is the files' rule (snapd/reader.py,
``destinations``): the segment is only another source of the bytes, and a restore
reads the same tensors from either. Tensors are read on this thread and a few
workers, shared by bytes; the kernel copies and the hash release the GIL.

Reading in place means a live tensor is written before its checksum is known. A
mismatch makes restore() read that object from the files, which overwrite it; the
object names are kept in ``touched`` so that a restore that then fails altogether
can say which objects hold partial state. What verification protects against is
the same as for the files; reading after the copy also catches a slot its trainer
stages into meanwhile (a read-only client's restore beside a live run).

A restore that could have read memory and read the files says why, in its resume
line (``Client.not_hot``): :func:`hot_offer` keeps the daemon's reason when it holds
no copy (or why no daemon answered), and :meth:`HotSource.why_not_used` the first
reason the held copy was not used (another snapshot than the one restore chose, a
tensor that does not match the manifest or its checksum, a segment gone).
"""

from __future__ import annotations

import os
import stat
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import xxhash

from snapd import protocol as proto
from snapd.errors import DaemonUnavailable, SnapdError
from snapd.names import SHM_DIR, SHM_PREFIX
from snapd.plan import tensor_extent
from snapd.reader import SnapshotReader, bytes_of, destinations
from snapd.store import SnapshotId

# Read, then hashed while still in the core's L2: measured at 1 GiB on a 2-CPU VM, a
# restore took 180 ms with 4 MiB pieces (the hash reading back from memory), 160 ms
# with 256 KiB, 195 ms with 64 KiB (the syscalls).
PIECE_BYTES = 256 << 10
MAX_READERS = 4


def _open_segment(name: str) -> int:
    if "/" in name or not name.startswith(SHM_PREFIX):
        raise SnapdError(f"hot segment name {name!r} is not a snapd segment")
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY | os.O_NOFOLLOW)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or not st.st_size:
        os.close(fd)
        raise SnapdError(f"hot segment {name}: not a non-empty file of ours")
    return fd


def _read_verified(fd: int, start: int, out: memoryview, expected: int) -> bool:
    """Read ``len(out)`` bytes at ``start`` into ``out``; True iff their xxh3 matches."""
    hasher = xxhash.xxh3_64()
    for pos in range(0, len(out), PIECE_BYTES):
        piece = out[pos:pos + PIECE_BYTES]
        if os.preadv(fd, [piece], start + pos) != len(piece):
            return False
        hasher.update(piece)
    return hasher.intdigest() == expected


def hot_offer(connect: Callable[[], Any], run: str, rank: int
              ) -> Tuple[Optional["HotSource"], Optional[str]]:
    """The daemon's held copy of (run, rank) as a tensor source, or None and why not.
    ``connect`` returns a connection to a daemon already serving the root (it never
    starts one just to restore)."""
    try:
        reply = connect().request(proto.HotGet(run, rank))
    except DaemonUnavailable:
        return None, "no daemon is serving the root"
    except SnapdError as e:
        return None, f"the daemon did not answer ({e})"
    if not reply.shm or not reply.snapshot or not isinstance(reply.plan, dict):
        reason = getattr(reply, "reason", None)   # absent from an older daemon
        return None, reason if isinstance(reason, str) and reason else \
            "the daemon holds no copy of this run and rank"
    return HotSource(reply.shm, reply.snapshot, reply.plan), None


class _Miss(Exception):
    """An object the held copy cannot serve; the message says why."""


class HotSource:
    """A ``tensor_source`` for restore: serves objects of one held snapshot."""

    def __init__(self, shm: str, snapshot: str, plan: Dict[str, Any]) -> None:
        self.shm, self.snapshot, self.plan = shm, snapshot, plan
        self.hits: List[str] = []
        self.misses: List[str] = []
        self.miss_reasons: List[str] = []   # one per miss, in order
        self.touched: List[str] = []  # written in place, then failed: read from files
        self._fd: Optional[int] = None
        self._pool: Optional[ThreadPoolExecutor] = None
        self._workers = 0

    @property
    def used(self) -> bool:
        """Every object restore() read came from memory."""
        return bool(self.hits) and not self.misses

    def why_not_used(self, chosen: str) -> Optional[str]:
        """Why a restore of snapshot ``chosen`` did not read (all of) it from this
        copy; None when it did."""
        if self.used:
            return None
        if self.miss_reasons:
            return self.miss_reasons[0]
        if chosen != self.snapshot:
            return f"the daemon holds {_describe(self.snapshot)}, the restore chose " \
                   f"{_describe(chosen)}"
        return f"{chosen} has no tensor to read from memory"

    def __call__(self, reader: SnapshotReader, name: str,
                 live: Dict[str, torch.Tensor]) -> Optional[List[torch.Tensor]]:
        if os.path.basename(reader.path) != self.snapshot:
            return None
        tensors, reason = None, None
        try:
            tensors = self._load(reader.objects[name]["tensors"], name, live)
        except _Miss as e:
            reason = str(e)
        except FileNotFoundError:   # gone, replaced or malformed: the files are the truth
            reason = f"the hot copy's segment {self.shm} is gone"
        except OSError as e:
            reason = f"the hot copy could not be read ({e.strerror or e})"
        except (ValueError, KeyError, TypeError, SnapdError) as e:
            reason = f"the hot copy's plan of {name} is not usable ({e})"
        if tensors is None:
            self.misses.append(name)
            self.miss_reasons.append(reason)
        else:
            self.hits.append(name)
        return tensors

    def _load(self, entries: List[Dict[str, Any]], name: str,
              live: Dict[str, torch.Tensor]) -> List[torch.Tensor]:
        """The tensors of object ``name``, read and verified; raises _Miss."""
        if self._fd is None:
            self._fd = _open_segment(self.shm)
            self._workers = min(MAX_READERS, os.cpu_count() or 1) - 1  # + this thread
            self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix="snapd-hot") \
                if self._workers else None
        size = os.fstat(self._fd).st_size
        held = next((o for o in self.plan["objects"] if o["name"] == name), None)
        if held is None or len(held["tensors"]) != len(entries):
            raise _Miss(f"the hot copy's tensors of {name} are not the snapshot's")
        starts = []
        for t, entry in zip(held["tensors"], entries):
            saved = (entry["path"], entry["dtype"], list(entry["shape"]), entry["nbytes"])
            held_as = (t["path"], t["dtype"], list(t["shape"]), t["nbytes"])
            if "ref" in entry or held_as != saved:
                raise _Miss(f"the hot copy's tensor {name}/{entry['path']} does not "
                            "match the snapshot's manifest")
            starts.append(tensor_extent(t, size)[0])  # bounds-checked
        out = destinations(entries, live)   # as the files would: one way to read
        if self._read_all([(start, bytes_of(t), e["xxh3"])
                           for start, t, e in zip(starts, out, entries)]):
            return out
        if any(t is live.get(e["path"]) for t, e in zip(out, entries)):
            self.touched.append(name)
        raise _Miss(f"a tensor of {name} in the hot copy did not match its checksum")

    def _read_all(self, jobs: List[tuple]) -> bool:
        """Run every (start, destination, digest) read, shared by bytes between this
        thread and the workers; True iff all verified. Returns only when every
        read has ended: they write into live tensors."""
        shares: List[List[tuple]] = [[] for _ in range(1 + self._workers)]
        loads = [0] * len(shares)
        for job in sorted(jobs, key=lambda j: -len(j[1])):
            i = loads.index(min(loads))
            shares[i].append(job)
            loads[i] += len(job[1])

        def run(share: List[tuple]) -> bool:
            return all([_read_verified(self._fd, *job) for job in share])

        futures = [self._pool.submit(run, s) for s in shares[1:] if s]
        mine = run(shares[0])
        return all([f.result() for f in futures]) and mine

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
        if self._fd is not None:
            os.close(self._fd)
        self._fd = self._pool = None


def _describe(name: str) -> str:
    """A snapshot name as a resume line says it: "step 20" ("step 20 of lineage 1")."""
    sid = SnapshotId.parse(name)
    if sid is None:
        return name
    return f"step {sid.step}" + (f" of lineage {sid.lineage}" if sid.lineage else "")
