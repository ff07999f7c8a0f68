"""Staging: the arena a snapshot is copied into, and the Stager that fills it.

The *arena* is one shared-memory file, allocated once per client and reused.

A snapshot's tensors are copied into a *slot* of the arena; the daemon maps the same
file and writes the slot to disk, so the trainer's only cost is one memory copy.
Why one file and not a segment per tensor: the number of mappings and descriptors
stays bounded (one) whatever the model, and the pages are faulted in once, before
the first copy (at allocation, or in the background: prefault.py), so that no
snapshot pays for page faults on the training path.

Layout: ``slots`` equal slots back to back, each a multiple of the page size (one
more than ``Options.slots`` with ``hot_restore``: the latest commit's, which the
daemon serves as the hot copy; see handoff.py). Inside a
slot, in plan order, each tensor of 4096 bytes or more starts on a 4096-byte boundary
(so that the daemon can write it to disk by direct I/O, which needs aligned source
addresses), and each smaller one on a 64-byte boundary (cache lines, and any dtype's
alignment); :func:`layout` computes the offsets.

Who copies CPU tensors depends on torch's own threads. With more than one, ``copy_``
splits each big copy over them, and in a training loop they are awake from the last
kernel, which no other thread can beat. With one (trainers pinned to a core each,
or a CPU-bound loop that keeps the other cores for the daemon and data loaders),
tensors whose bytes lie in one run (contiguous, no conj or neg bit) are copied as
plain bytes in pieces of ``PIECE_BYTES``, which the calling thread and up to
``copy_threads - 1`` helpers take one at a time from a shared counter: a core that
another process holds then slows the copy by its share only, where fixed halves
would wait for the slow half. Measured at 100 MB on this project's 2-core machine:
about 7 ms shared against 9 ms for ``copy_`` on one thread (docs/benchmarks.md,
"Staging copy"). Other tensors go through ``copy_``, which handles strides and the
conj and neg bits.

On CUDA the arena is page-locked once (``cudaHostRegister``; where the driver
refuses, a warning, and copies that are synchronous), so device-to-host copies are
truly asynchronous; they run on a side stream that first waits for the
compute stream (the values are those at ``stage()`` time) and end with an event that
:meth:`Arena.wait` synchronizes on.

The *stager* (:class:`Stager`, the seam torch's ``AsyncStager`` names: stage,
synchronize) owns the order of the copies, the CUDA fence and the background copy of
overlap mode; ``Handoff`` (handoff.py) gives it a slot and learns, through a
callback, when the slot may be submitted.
"""

from __future__ import annotations

import errno
import itertools
import logging
import mmap
import os
import secrets
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from snapd.cpulanes import usable_cpus
from snapd.errors import InsufficientSpace, SnapdError
from snapd.format import CHUNK_ALIGN, align_up
from snapd.names import SHM_DIR, arena_prefix
from snapd_client.prefault import Prefault

logger = logging.getLogger(__name__)

ALIGN = 64                # every tensor
BLOCK_ALIGN = CHUNK_ALIGN  # tensors of a block or more: direct I/O from the slot
SLOT_ROUND = 2 << 20  # slots grow in 2 MiB steps (huge-page friendly, few regrowths)
PIECE_BYTES = 2 << 20  # the unit of copying work the threads share

Piece = Tuple[np.ndarray, np.ndarray]  # (destination bytes, source bytes)


def nbytes_of(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def layout(tensors: Sequence[torch.Tensor],
           stored: Optional[Sequence[bool]] = None) -> tuple[List[int], int]:
    """Each tensor's offset within a slot, and the bytes needed. A tensor with
    ``stored[i]`` False (another rank writes it, or an earlier snapshot holds its
    bytes) takes no bytes: offset 0."""
    offsets, end = [], 0
    for i, t in enumerate(tensors):
        if stored is not None and not stored[i]:
            offsets.append(0)
            continue
        start = align_up(end, BLOCK_ALIGN if nbytes_of(t) >= BLOCK_ALIGN else ALIGN)
        offsets.append(start)
        end = start + nbytes_of(t)
    return offsets, end


def slot_size_for(needed: int) -> int:
    return max(SLOT_ROUND, align_up(needed, SLOT_ROUND))


def _is_byte_run(t: torch.Tensor) -> bool:
    """Its bytes are the value, in one run: a plain memory copy is the whole job."""
    return t.device.type == "cpu" and t.is_contiguous() and not t.is_conj() \
        and not t.is_neg()


def _pieces(dst: torch.Tensor, src: torch.Tensor) -> Iterator[Piece]:
    to = dst.numpy()
    frm = src.detach().reshape(-1).view(torch.uint8).numpy()
    for pos in range(0, len(to), PIECE_BYTES):
        yield to[pos:pos + PIECE_BYTES], frm[pos:pos + PIECE_BYTES]


def _copy_some(pieces: List[Piece], counter: Iterator[int]) -> None:
    """Copy pieces until none is left; threads running this share ``counter``."""
    for i in counter:
        if i >= len(pieces):
            return
        np.copyto(*pieces[i])  # a memcpy; numpy releases the GIL for it


class Arena:
    """A shared-memory file of ``slots`` equal slots, mapped and faulted in.

    The file is ``/dev/shm/snapd-<uid>-<pid>-<nonce>``, mode 0600, created with
    ``O_EXCL`` so that no other file is ever reused or followed.
    """

    def __init__(self, slot_bytes: int, slots: int = 1, copy_threads: int = 1, *,
                 background: bool = False) -> None:
        if slots not in (1, 2, 3):  # Options.slots, plus one for the hot copy
            raise ValueError(f"slots={slots}: the staging arena has 1 to 3 slots")
        if copy_threads < 1:
            raise ValueError(f"copy_threads={copy_threads}: at least 1 (the caller)")
        self.slot_bytes = align_up(max(slot_bytes, 1), mmap.PAGESIZE)
        self.slots = slots
        self.size = self.slot_bytes * slots
        self.name = f"{arena_prefix(os.getpid())}{secrets.token_hex(4)}"
        self.path = os.path.join(SHM_DIR, self.name)
        self._map, fd = self._create(allocate=not background)
        self._u8: Optional[torch.Tensor] = torch.frombuffer(self._map, dtype=torch.uint8)
        # Every page faulted in before the first copy (prefault.py): now, or, with
        # ``background``, on a thread of prefault's that ready() finishes. It writes
        # the pages through the file first, and closes the descriptor once done.
        self._prefault = Prefault(self._u8.data_ptr(), self.size, fd)
        self._registered = False
        self._register_tried = False
        self._stream = None
        self._event = None
        self._pending: list = []  # CUDA sources kept alive until their copy is done
        self._helper_count = min(copy_threads, usable_cpus()) - 1
        self._helpers = ThreadPoolExecutor(self._helper_count,
                                           thread_name_prefix="snapd-copy") \
            if self._helper_count else None
        self.fault_in(background)

    def _create(self, allocate: bool) -> Tuple[mmap.mmap, int]:
        """The file, mapped, and its descriptor, which the fault-in writes through
        and then closes (the mapping keeps the file)."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # fallocate, not ftruncate: a full /dev/shm is an error here, never a
            # SIGBUS later while copying. In the background, the fault-in allocates
            # (its failure makes ready() False: the arena is then never copied into).
            if allocate:
                os.posix_fallocate(fd, 0, self.size)
            else:
                os.ftruncate(fd, self.size)
            return mmap.mmap(fd, self.size), fd
        except OSError as e:
            os.close(fd)
            os.unlink(self.path)
            cls = InsufficientSpace if e.errno == errno.ENOSPC else SnapdError
            raise cls(f"{self.path}: cannot allocate a {self.size}-byte staging arena "
                      f"({e}); free space in {SHM_DIR} or use slots=1") from e

    @property
    def closed(self) -> bool:
        return self._u8 is None

    def fault_in(self, background: bool = False) -> None:
        """Fault every page in, so that no snapshot pays for page faults: on a thread
        of prefault.py's (paused across forks and by :meth:`pause_fault_in`), or now."""
        if background:
            self._prefault.start()
        elif not self.ready():
            self.close()
            raise InsufficientSpace(f"{self.path}: cannot fault in a {self.size}-byte "
                                    f"staging arena; free space in {SHM_DIR} or use "
                                    "slots=1", path=self.path)

    @property
    def faulted_in(self) -> bool:
        """Every page of every slot is in (or faulting in failed: the copy faults its
        own): a copy into any slot now costs a steady one, no set-up."""
        p = self._prefault
        return p.done >= p.nbytes or p.error is not None

    def pause_fault_in(self) -> None:
        """Leave the CPUs and memory bandwidth to something else (a restore) for now;
        :meth:`fault_in` goes on."""
        self._prefault.pause()

    def ready(self, slot: Optional[int] = None) -> bool:
        """The pages up to the end of ``slot`` (None: of every slot) faulted in, what
        is left of them done here, before a copy into it; the later slots' go on in
        the background. False if that failed (a full /dev/shm): the arena must not be
        copied into.

        A first snapshot waits for its own slot's pages only: with hot restore on,
        the arena has a slot more, and this machine has faulted in shared memory at
        anywhere from 0.13 to over 2 GB/s (measured on a 2-CPU VM)."""
        error = self._prefault.wait(None if slot is None else (slot + 1) * self.slot_bytes)
        if error is not None:
            logger.info("staging arena %s: its pages could not be allocated (%s)",
                        self.path, error)
        return error is None

    def view(self, slot: int, offset: int, nbytes: int) -> torch.Tensor:
        """Bytes ``[offset, offset + nbytes)`` of a slot, as a uint8 tensor."""
        if self._u8 is None:
            raise SnapdError(f"staging arena {self.name} is closed")
        if not 0 <= slot < self.slots or offset < 0 or offset + nbytes > self.slot_bytes:
            raise SnapdError(f"arena {self.name}: [{offset}, {offset + nbytes}) of slot "
                             f"{slot} lies outside its {self.slot_bytes}-byte slots")
        base = slot * self.slot_bytes + offset
        return self._u8[base:base + nbytes]

    def stage(self, slot: int, tensors: Sequence[torch.Tensor],
              offsets: Sequence[int], *, share: bool = True) -> None:
        """Copy each tensor into its place in ``slot``.

        CPU tensors are copied before this returns (the copies release the GIL, so a
        background thread may call this); ``share=False`` leaves out the helpers (a
        background copy must not take cores from training). CUDA tensors are only
        enqueued on the side stream; call :meth:`wait` before the slot is handed to
        the daemon.
        """
        pieces: List[Piece] = []
        shared = share and self._helpers is not None and torch.get_num_threads() == 1
        with torch.no_grad():
            for t, off in zip(tensors, offsets):
                n = nbytes_of(t)
                if n == 0:
                    continue
                dst = self.view(slot, off, n)
                if shared and _is_byte_run(t):
                    pieces += _pieces(dst, t)
                elif t.device.type == "cuda":
                    self._copy_cuda(dst.view(t.dtype).view(t.shape), t)
                else:  # strided, conj or neg views; other devices
                    dst.view(t.dtype).view(t.shape).copy_(t.to("cpu"))
            if self._pending:
                self._event = torch.cuda.Event()
                self._event.record(self._stream)
        if pieces:
            self._copy_shared(pieces)

    def _copy_shared(self, pieces: List[Piece]) -> None:
        counter = itertools.count()
        helpers = [self._helpers.submit(_copy_some, pieces, counter)
                   for _ in range(min(self._helper_count, len(pieces) - 1))]
        try:
            _copy_some(pieces, counter)
        finally:
            for f in helpers:  # never return while a helper still writes the slot
                f.result()

    def _copy_cuda(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if not self._register_tried:
            self._register()
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=src.device)
        # The side stream waits for the work queued so far, so it copies the values
        # of this instant; later kernels on the compute stream overlap the copy.
        self._stream.wait_stream(torch.cuda.current_stream(src.device))
        with torch.cuda.stream(self._stream):
            dst.copy_(src, non_blocking=True)
        self._pending.append(src)

    def fence(self) -> None:
        """Make the compute stream wait, on the GPU, for the copies enqueued so far.

        For tensors that kernels queued after snapshot() change in place (a module's
        buffers, in the next forward): without the fence such a kernel may run while
        the side stream still reads the tensor. The CPU does not wait, and copies
        enqueued after the fence do not hold the compute stream.
        """
        if self._stream is None or not self._pending:
            return
        done = torch.cuda.Event()
        done.record(self._stream)
        torch.cuda.current_stream(self._stream.device).wait_event(done)

    def _register(self) -> None:
        """Page-lock the whole arena once: pinned memory makes D2H copies async.

        Where the driver refuses (a sandboxed runtime, memory locked elsewhere), the
        copies still land: CUDA copies into pageable memory synchronously. Snapshots
        stay correct and stall longer, which the warning says once.
        """
        self._register_tried = True
        # Flag 1 (portable): pinned for every device this process uses.
        rc = torch.cuda.cudart().cudaHostRegister(self._u8.data_ptr(), self.size, 1)
        if int(rc) != 0:
            warnings.warn(f"cudaHostRegister of the {self.size}-byte staging arena "
                          f"{self.path} failed (cudaError {int(rc)}): device-to-host "
                          "copies into it are synchronous, so snapshot() stalls for the "
                          "whole copy. Check that this runtime allows page-locked host "
                          "memory (ulimit -l, container limits)", RuntimeWarning,
                          stacklevel=4)
            return
        self._registered = True

    def wait(self) -> None:
        """Block until every enqueued device-to-host copy has landed in the arena."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        self._pending.clear()

    def close(self) -> None:
        """Unmap and unlink. Safe to call twice."""
        if self._u8 is None:
            return
        self._prefault.stop()   # no thread of ours touches the memory once unmapped
        self.wait()
        if self._helpers is not None:
            self._helpers.shutdown()
            self._helpers = None
        if self._registered and torch.cuda.is_available():
            torch.cuda.cudart().cudaHostUnregister(self._u8.data_ptr())
        self._u8 = None
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass  # the daemon unlinks a dropped client's segment too
        try:
            self._map.close()
        except BufferError:
            pass  # a view is still referenced; the mapping goes with it (name is gone)

    def __repr__(self) -> str:
        return f"<Arena {self.name} {self.slots}x{self.slot_bytes}>"


def copy_order(tensors: Sequence[torch.Tensor], offsets: Sequence[int],
               deferred: Sequence[bool], stored: Optional[Sequence[bool]] = None
               ) -> Tuple[list, list, list]:
    """Split the staging copies of one snapshot into three (tensor, offset) lists;
    a tensor with ``stored[i]`` False (another rank writes it) is in none.

    ``now``: everything not deferred, copied (CPU) or enqueued (CUDA) first; in overlap
    mode the compute stream is then fenced behind the CUDA ones, since the next
    forward may change them (buffers). ``device_later``: deferred CUDA tensors,
    enqueued after the fence; only ``optimizer.step()`` changes them, and its pre-hook
    waits. ``later``: deferred CPU tensors, copied by the background thread.
    """
    now, device_later, later = [], [], []
    keep = [True] * len(tensors) if stored is None else stored
    for t, o, d, k in zip(tensors, offsets, deferred, keep):
        if not k:
            continue
        (now if not d else device_later if t.is_cuda else later).append((t, o))
    return now, device_later, later


def _stage_pairs(arena: Arena, slot: int, pairs: list, **kwargs) -> None:
    arena.stage(slot, [t for t, _ in pairs], [o for _, o in pairs], **kwargs)


Landed = Callable[[Optional[BaseException]], None]


class Stager:
    """Copies a capture's tensors into an arena slot, in the order its mode needs.

    ``stage()`` copies what must be copied before snapshot() returns and raises if
    that fails. Then ``landed(None)`` runs once every copy of the slot has landed
    (``landed(error)`` if a background copy failed): the slot may be submitted. In
    ``wait`` mode that is inside ``stage()``, on the caller's thread; in ``overlap``
    mode on the stager's one thread, after the deferred copies. ``synchronize()`` blocks until the copy in progress has landed;
    the optimizer's step pre-hook calls it in overlap mode.

    ``wait`` mode copies everything, and waits for the device copies, inside
    ``stage()``. ``overlap`` mode copies inside ``stage()`` only what the next forward
    may change (see :func:`copy_order`), fences the compute stream behind those CUDA
    copies, and leaves the deferred CPU copies to its thread.
    """

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self._worker: Optional[ThreadPoolExecutor] = None
        self._copied: Optional[threading.Event] = None   # overlap: the copy in progress

    def stage(self, arena: Arena, slot: int, tensors: Sequence[torch.Tensor],
              offsets: Sequence[int], deferrable: Sequence[bool], landed: Landed,
              stored: Optional[Sequence[bool]] = None) -> None:
        """Copy ``tensors[i]`` to ``offsets[i]`` of ``slot``; overlap mode may copy
        those marked ``deferrable`` later, on its thread. Those with ``stored[i]``
        False are another rank's to write: never copied."""
        overlap = self.mode == "overlap"
        now, device_later, later = copy_order(
            tensors, offsets, deferrable if overlap else [False] * len(tensors), stored)
        _stage_pairs(arena, slot, now)
        if overlap:
            arena.fence()  # what the next forward may write is copied before it runs
        _stage_pairs(arena, slot, device_later)
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="snapd-stage")
        if overlap:
            self._copied = copied = threading.Event()
            self._worker.submit(self._finish, arena, slot, later, landed, copied)
        else:
            arena.wait()
            # The copy is done: the trainer may change its tensors. The submit is sent
            # here, before snapshot() returns (a few hundred bytes on the socket, not
            # waited for): once it is in the daemon's socket queue the snapshot
            # commits even if the trainer is killed the next instant.
            landed(None)

    def _finish(self, arena: Arena, slot: int, later: list, landed: Landed,
                copied: threading.Event) -> None:
        """Overlap mode, on the stager's thread: the deferred copies, then landed."""
        try:
            # share=False: this runs beside forward and backward, which need the
            # cores more than this copy does.
            _stage_pairs(arena, slot, later, share=False)
            arena.wait()
        except Exception as e:
            landed(e)
            return
        finally:
            copied.set()
        landed(None)

    def synchronize(self) -> None:
        """Block until the staging copy in progress has landed in its slot."""
        copied = self._copied
        if copied is not None:
            copied.wait()

    def drain(self) -> None:
        """Finish every copy and ``landed`` call started; the thread ends (a next
        stage() starts another)."""
        self.synchronize()
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
