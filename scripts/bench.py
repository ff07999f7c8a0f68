#!/usr/bin/env python
"""Snapshots: stall, time to durable, memory, restore, and training slowdown.

    python scripts/bench.py [--sizes 100M,1G,2G] [--loop-sizes 100M,1G] [--quick]
                            [--json /tmp/snapd-bench.json]
    python scripts/bench_render.py /tmp/snapd-bench.json [--doc docs/benchmarks.md]

Every way to checkpoint is a :class:`Method`: ``save`` (returns when training may go
on: the stall), ``wait`` (returns when the save is durable) and ``load`` (a restore
into the live model and optimizer). One loop times them all (:func:`time_saves`), the
same restore loop restores them (:func:`time_restores`), and the figures go to JSON;
scripts/bench_render.py turns that JSON into docs/benchmarks.md's tables and targets.

The state is an MLP of Linear(2048, 2048) layers plus its AdamW state (params +
exp_avg + exp_avg_sq ~ the size; 1G = 1 GiB) after one optimizer step, on 2 torch
threads. Each method runs in its own process (``--method M --size S``, JSON out) so
peak RSS figures do not mix. Methods: ``torch_save`` (torch.save + fsync of file and
directory; restore: torch.load(weights_only=True) + load_state_dict), ``dcp_save``
(dcp.save; restore: dcp.load in place), ``dcp_async`` (dcp.async_save with a reused
CPU DefaultStager: the stall lasts until staging completes), ``snapd_wait`` and
``snapd_overlap`` (the Client through its daemon; in overlap mode the stall adds the
time the next optimizer.step() waits in snapd's pre-hook). The ``ref`` worker times
the floors: a warm ``copy_``, the raw bytes written by os.write and by O_DIRECT with
fsync, read back by O_DIRECT, and pread from /dev/shm. scripts/bench_loops.py holds
the runs that are training loops rather than saves: ``slowdown``, ``loop`` and
``mem_hot``/``mem_nohot``. docs/benchmarks.md says what each figure is.

Every timed copy and save follows 50 ms of matmuls (``train_briefly``). The first
save of each method is an uncounted warm-up. Figures are medians over the counted
repetitions (9 at 100M, 3 at 1G and 2G; 3 cold restores). ``--quick`` is a smoke
test (100M, 2 repetitions, short loops).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import subprocess
import sys
import time
import warnings
from collections import defaultdict
from typing import Any, Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from snapd.fsio import fsync_dir  # noqa: E402
import bench_loops  # noqa: E402  (the runs that are training loops, beside this script)
import bench_render  # noqa: E402  (its figures are stored with the run's)
from benchlib import (MiB, REPO, build_state, close_as_if_killed,  # noqa: E402
                      daemon_pid_of, dir_bytes, drop_cache, end_run, files_under,
                      memory_probes, nbytes_of, parse_size, snapd_shm_files, start_run,
                      state_tensors, stop_daemon, timed_copy, train_briefly, wait_idle,
                      warm_cache)

RUN = "bench"
METHODS = ["ref", "torch_save", "dcp_save", "dcp_async", "snapd_wait", "snapd_overlap"]
MEMORY = ["mem_hot", "mem_nohot"]   # a run's shared memory, hot restore on / off
PIECE = 8 << 20                     # O_DIRECT read size (dd bs=8M)


# --- the method interface -----------------------------------------------------------

class Method:
    """One way to checkpoint the live ``model`` and ``opt`` under ``root``.

    ``save(i)`` returns when the training loop may run its next update (the stall),
    ``wait()`` when that save is durable; either may return extra figures by name.
    ``load()`` restores the last save into the live tensors and returns the seconds
    the restore itself took; ``cold_files()`` names what a cold restore drops from the
    page cache and the files it reads.
    """
    synchronous = False   # durable when save() returns
    restores = True

    def __init__(self, root: str, model, opt) -> None:
        self.root, self.model, self.opt, self.path = root, model, opt, None
        self.sd = None   # what a file method saves: built once, before the first save

    def state(self) -> Dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict()}

    def begin(self, args, sampler, res: Dict[str, Any]) -> None:
        """Before the counted saves: one uncounted warm-up save (DCP's stager
        allocates its staging copy there)."""
        time_saves(self, [0])

    def after_saves(self, args, tensors, res: Dict[str, Any]) -> bool:
        """After the counted saves, figures of the method's own; whether the restore
        loop follows."""
        return self.restores

    def save(self, i: int) -> Dict[str, float]:
        raise NotImplementedError

    def wait(self) -> Dict[str, Any]:
        return {}

    def load(self) -> float:
        raise NotImplementedError

    def warm(self, res: Dict[str, Any]) -> None:
        """Files in the page cache before the warm restores: an uncounted restore."""
        self.load()

    def cold_files(self) -> Tuple[str, List[str]]:
        return self.path, files_under(self.path)

    def file_bytes(self) -> int:
        return dir_bytes(self.path)

    def close(self) -> None:
        pass


class TorchSave(Method):
    synchronous = True

    def save(self, i):
        import torch
        self.path = os.path.join(self.root, f"ts{i}.pt")
        with open(self.path, "wb") as f:
            torch.save(self.sd, f)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(self.root)
        return {}

    def load(self):
        import torch
        t0 = time.perf_counter()
        loaded = torch.load(self.path, weights_only=True)
        self.model.load_state_dict(loaded["model"])
        self.opt.load_state_dict(loaded["optim"])
        return time.perf_counter() - t0


class DcpSave(Method):
    """dcp.save; ``options`` go to it (a process group, for one)."""
    synchronous = True

    def __init__(self, root, model, opt, **options) -> None:
        super().__init__(root, model, opt)
        self.options = options

    def save(self, i):
        import torch.distributed.checkpoint as dcp
        self.path = os.path.join(self.root, f"d{i}")
        dcp.save(self.sd, checkpoint_id=self.path, **self.options)
        return {}

    def load(self):
        import torch.distributed.checkpoint as dcp
        t0 = time.perf_counter()
        dcp.load(self.state(), checkpoint_id=self.path)
        return time.perf_counter() - t0


class DcpAsync(Method):
    """The best this torch offers on CPU: shared-memory staging in a background thread,
    the staging copy cached and reused across saves (pinned memory and non-blocking
    copies need an accelerator). Its stall lasts until staging completes. ``options``
    go to dcp.async_save (a process group, the checkpointer type)."""
    restores = False

    def __init__(self, root, model, opt, **options) -> None:
        super().__init__(root, model, opt)
        self.options = options
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        self.stager = DefaultStager(StagingOptions(
            use_pinned_memory=False, use_shared_memory=True, use_async_staging=True,
            use_non_blocking_copy=False))

    def save(self, i):
        import torch.distributed.checkpoint as dcp
        self.path = os.path.join(self.root, f"a{i}")
        t0 = time.perf_counter()
        resp = dcp.async_save(self.sd, checkpoint_id=self.path, async_stager=self.stager,
                              **self.options)
        returned = time.perf_counter() - t0
        if hasattr(resp, "staging_completion"):
            resp.staging_completion.result()
            resp = resp.upload_completion
        self.upload = resp
        return {"return_s": returned}

    def wait(self):
        self.upload.result()
        return {}

    def after_saves(self, args, tensors, res):
        res["stager"] = "DefaultStager(shared memory, async staging; no pinning on CPU)"
        return False

    def close(self):
        self.stager.close()


class RawFile(Method):
    """The state's raw bytes (``views``) into a new file, then fsync of it and of its
    directory: the ``ref`` worker's floors of a durable write."""
    synchronous, restores = True, False

    def __init__(self, root: str, name: str, views, flags: int = 0) -> None:
        super().__init__(root, None, None)
        self.name, self.views, self.flags = name, views, flags

    def save(self, i):
        self.path = os.path.join(self.root, f"{self.name}{i}.bin")
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | self.flags, 0o644)
        try:
            for view in self.views:
                done = 0
                while done < len(view):
                    done += os.write(fd, view[done:])
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_dir(self.root)
        return {}


class Snapd(Method):
    """The snapd Client through its daemon. In overlap mode save() also runs the next
    optimizer.step() at once (no forward/backward to hide the copy behind: the worst
    case), and the stall adds the time that step waited in snapd's pre-hook (stamped by
    a second pre-hook, registered after snapd's, by :meth:`stamp_steps`)."""

    def __init__(self, root, model, opt, overlap: bool, **options) -> None:
        super().__init__(root, model, opt)
        from snapd_client import Client
        self.overlap, self.stamp, self.restored = overlap, {}, []
        self.ckpt = Client(root, RUN, mode="overlap" if overlap else "wait", **options)

    def begin(self, args, sampler, res):
        snapd_start(args, self, sampler, res)   # its warm-up is the first snapshot

    def after_saves(self, args, tensors, res):
        return snapd_after_saves(args, self, tensors, res)

    def stamp_steps(self) -> None:
        self.opt.register_step_pre_hook(
            lambda *a: self.stamp.__setitem__("t", time.perf_counter()))

    def save(self, i):
        t0 = time.perf_counter()
        self.handle = self.ckpt.snapshot(i)
        call = time.perf_counter() - t0
        if not self.overlap:
            return {"call_s": call}
        tc = time.perf_counter()
        self.opt.step()
        step = time.perf_counter() - tc
        blocked = self.stamp["t"] - tc
        return {"call_s": call, "blocked_s": blocked, "step_s": step,
                "stall_s": call + blocked}

    def wait(self):
        result = self.handle.wait()
        self.last_bytes = result.bytes_written
        return {"daemon_write_s": result.seconds, "staged": self.handle.staged_bytes,
                "written": result.bytes_written}

    def file_bytes(self):
        return self.last_bytes

    def load(self):
        """A restore from the files, with no daemon."""
        from snapd_client import Client
        c = Client(self.root, RUN, daemon=False)
        c.track(model=self.model, optimizer=self.opt)
        t0 = time.perf_counter()
        c.restore()
        dt = time.perf_counter() - t0
        self.restored.append(c.restored.path)
        c.close()
        return dt

    def warm(self, res):
        # snapd's writer and its cold reads go by direct I/O, which leave the page cache
        # as it was: the newest snapshot's files and the log are read once, buffered
        # (not every snapshot's: at 2G the run holds more than the page cache keeps).
        snaps = os.path.join(self.root, RUN, "snapshots")
        newest = max((os.path.join(snaps, d) for d in os.listdir(snaps)),
                     key=lambda d: os.path.getmtime(os.path.join(d, "manifest.snapd")))
        res["warmed_bytes"] = warm_cache(newest) + warm_cache(os.path.join(self.root, RUN,
                                                                          "log"))

    def cold_files(self):
        tensors = [p for p in files_under(self.restored[-1])
                   if not p.endswith("manifest.snapd")]
        return os.path.join(self.root, RUN, "snapshots"), tensors


def make_method(name: str, root: str, model, opt) -> Method:
    if name.startswith("snapd"):
        return Snapd(root, model, opt, overlap=name == "snapd_overlap")
    method = {"torch_save": TorchSave, "dcp_save": DcpSave, "dcp_async": DcpAsync}[name](
        root, model, opt)
    method.sd = method.state()   # built once, before the first save, as a loop would
    return method


# --- the loops ----------------------------------------------------------------------

def time_saves(method: Method, ids, before=None) -> Dict[str, List[Any]]:
    """The one timing loop: for each save, ``before()`` (a little training), then
    save() (the stall) and wait() (durable, from the same start); extra figures by
    name, and when each save started (``start_t``, perf_counter)."""
    out: Dict[str, List[Any]] = defaultdict(list)
    for i in ids:
        (before or train_briefly)()
        t0 = time.perf_counter()
        extra = method.save(i)
        stall = time.perf_counter() - t0
        extra.update(method.wait())
        durable = stall if method.synchronous else time.perf_counter() - t0
        extra.update(stall_s=extra.get("stall_s", stall), durable_s=durable, start_t=t0)
        for key, value in extra.items():
            out[key].append(value)
    return dict(out)


def time_restores(args, method: Method, res: Dict[str, Any]) -> None:
    """Warm restores (after ``method.warm``), then cold ones. Each cold restore drops
    the files from the page cache, restores, then reads the same files raw by
    O_DIRECT (``paired_direct_s``: the floor of a cold read, paired, since this
    disk's speed moves by up to 50% between minutes; every method runs that read
    between its restores, so that each finds its live tensors as long untouched)."""
    method.warm(res)
    res["restore_warm_s"] = [method.load() for _ in range(args.reps)]
    dropped, files = method.cold_files()
    raw = DirectReader(files)
    res["cold_dropped"], res["restore_cold_s"], res["paired_direct_s"] = [], [], []
    try:
        for _ in range(args.cold_reps):
            res["cold_dropped"].append(drop_cache(dropped))
            res["restore_cold_s"].append(method.load())
            if raw.fds:
                res["paired_direct_s"].append(raw.read())
    finally:
        raw.close()


def w_method(args, model, opt, tensors, sampler, res) -> None:
    """One method at one size: warm-up, the counted saves, its own figures, restores."""
    method = make_method(args.method, args.root, model, opt)
    try:
        method.begin(args, sampler, res)
        res.update(time_saves(method, range(1, args.reps + 1)))
        res["file_bytes"] = method.file_bytes()
        res["peak"] = sampler.stop()
        if method.after_saves(args, tensors, res):
            time_restores(args, method, res)
    finally:
        method.close()


# --- snapd's own figures ------------------------------------------------------------

def snapd_start(args, method: Snapd, sampler, res) -> None:
    """As the README's loop starts: track(), restore() (a fresh run: 0, which also
    opens the state log), an optimizer step and --first-gap seconds of training; then
    the first snapshot, the warm-up, whose stall is a target of its own."""
    ckpt, opt = method.ckpt, method.opt
    for key, call in (("track_s", lambda: ckpt.track(model=method.model, optimizer=opt)),
                      ("fresh_restore_s", ckpt.restore)):
        t0 = time.perf_counter()
        call()
        res[key] = time.perf_counter() - t0
    t0 = time.perf_counter()
    opt.step()
    train_briefly()
    while time.perf_counter() - t0 < args.first_gap:
        train_briefly()
    res["gap_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    h = ckpt.snapshot(0)
    res["first_call_s"] = time.perf_counter() - t0
    h.wait()
    res["first_snapshot_s"] = time.perf_counter() - t0
    pid = daemon_pid_of(args.root)
    res["daemon_pid"], res["client_daemon_pid"] = pid, ckpt.daemon_pid
    res["settle_s"] = wait_idle(pid)   # the daemon's spare hot segment
    if pid:
        sampler.add("daemon", pid)
    if method.overlap:
        opt.step()   # snapd's pre-hook is registered; ours goes after it
        method.stamp_steps()
        base = []
        for _ in range(max(2, args.reps)):
            t0 = time.perf_counter()
            opt.step()
            base.append(time.perf_counter() - t0)
        res["step_baseline_s"] = base


def snapd_after_saves(args, method: Snapd, tensors, res) -> bool:
    """Paired figures, then (mode=wait) hot restores; False when no file restore follows.

    Paired: the reference copy_ again, in this process and alternating with snapshots,
    so that both see the same memory and machine state (the ``ref`` worker's copy runs
    in a process with no daemon, arena or hot copies beside it)."""
    import torch
    private = [torch.empty_like(t) for t in tensors]
    timed_copy(private, tensors)   # faults the destination in
    n, pairs = args.reps, []
    for i in range(n):
        train_briefly()
        reference = timed_copy(private, tensors)
        pairs.append((reference, time_saves(method, [n + 1 + i])["stall_s"][0]))
    res["paired_copy_s"], res["paired_stall_s"] = [a for a, _ in pairs], [b for _, b in pairs]
    if method.overlap:
        method.ckpt.close()
        return False
    # Later snapshots after as long a gap as the first had: on this VM memory left
    # untouched for seconds is slower to touch again, the arena's slots included.
    gapped = []
    for i in range(min(3, n)):
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < res["gap_s"]:
            train_briefly()
        gapped.append(time_saves(method, [2 * n + 1 + i])["stall_s"][0])
    res["stall_after_gap_s"] = gapped
    # As a killed trainer: a clean close() releases the hot copy.
    close_as_if_killed(method.ckpt)
    hot_restores(args, method, tensors, private, res)
    res["daemon_stopped"] = stop_daemon(args.root)
    return True


def hot_restores(args, method: Snapd, tensors, private, res) -> None:
    """Restores from the daemon's hot copy (the first an uncounted warm-up), each
    followed by the paired references: a pread of the same bytes from a /dev/shm file
    that sat untouched as long as the hot copy, and a copy_. No restore from the files
    comes first: after one, the next restore through the daemon reads the files too."""
    from snapd_client import Client
    hot, how, paired, paired_pread = [], [], [], []
    source = ShmSource(tensors, private)
    try:
        for _ in range(args.reps + 1):
            # Read-only: a writing trainer that restores lets the daemon drop the copy.
            c = Client(args.root, RUN, read_only=True)
            c.track(model=method.model, optimizer=method.opt)
            t0 = time.perf_counter()
            c.restore()
            hot.append(time.perf_counter() - t0)
            how.append(c.restored_from)
            close_as_if_killed(c)   # keeps the hot copy for the next one
            # After, not before: a restore runs at a trainer's start, not right after
            # torch's threads were busy (they spin a while after a parallel copy).
            paired_pread.append(source.read())
            paired.append(timed_copy(private, tensors))
    finally:
        source.close()
    res["restore_hot_s"], res["restore_hot_from"] = hot[1:], how[1:]
    res["paired_hot_copy_s"], res["paired_shm_read_s"] = paired[1:], paired_pread[1:]


# --- the floors (the ref worker) ----------------------------------------------------

def w_ref(args, model, opt, tensors, sampler, res) -> None:
    import torch
    dst = [torch.empty_like(t) for t in tensors]
    timed_copy(dst, tensors)   # faults the destination pages in
    res["copy_s"] = []
    for _ in range(args.reps + 1):
        train_briefly()
        res["copy_s"].append(timed_copy(dst, tensors))
    source = ShmSource(tensors, dst)
    try:
        source.read()   # uncounted, as every first
        res["shm_read_s"] = []
        for _ in range(args.reps):
            train_briefly()
            res["shm_read_s"].append(source.read())
    finally:
        source.close()
    del dst
    views = [memoryview(t.reshape(-1).view(torch.uint8).numpy()) for t in tensors]
    raw = RawFile(args.root, "raw", views)
    time_saves(raw, [0])
    res["durable_s"] = time_saves(raw, range(1, args.reps + 1))["durable_s"]
    res["direct_durable_s"] = raw_direct(args, tensors)
    res["peak"] = sampler.stop()
    if res["direct_durable_s"]:
        # The cold-restore floor: the last of those files read back by O_DIRECT.
        last = os.path.join(args.root, f"direct{args.reps}.bin")
        for threads, key in ((1, "direct_read_s"), (2, "direct_read2_s")):
            reader = DirectReader([last], threads)
            res[key] = [reader.read() for _ in range(max(args.cold_reps, 1))]
            reader.close()


def raw_direct(args, tensors) -> List[float]:
    """The same bytes from one page-aligned buffer (what an arena is) to a new file by
    O_DIRECT, then fsync: the disk's own speed without the page cache. The copy into
    the buffer is not timed. Empty when the filesystem refuses O_DIRECT."""
    import torch
    total = nbytes_of(tensors)
    buf = mmap.mmap(-1, (total + 4095) // 4096 * 4096)
    staged, pos = torch.frombuffer(buf, dtype=torch.uint8), 0
    for t in tensors:
        n = t.numel() * t.element_size()
        staged[pos:pos + n].copy_(t.reshape(-1).view(torch.uint8))
        pos += n
    try:
        os.close(os.open(os.path.join(args.root, "direct-probe.bin"),
                         os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644))
    except OSError:
        return []
    view = memoryview(buf)
    direct = RawFile(args.root, "direct",
                     [view[o:o + (4 << 20)] for o in range(0, len(view), 4 << 20)],
                     os.O_DIRECT)
    time_saves(direct, [0])
    times = time_saves(direct, range(1, args.reps + 1))["durable_s"]
    del staged, view, direct
    return times


class PieceReader:
    """Reads ``(fd, view, offset)`` pieces by preadv, dealt round-robin to ``threads``
    threads (this one and the rest in a pool); :meth:`read` returns its seconds."""

    def __init__(self, pieces, threads: int) -> None:
        from concurrent.futures import ThreadPoolExecutor
        self.shares = [pieces[i::threads] for i in range(threads)]
        self.pool = ThreadPoolExecutor(max(threads - 1, 1))

    def read(self) -> float:
        t0 = time.perf_counter()
        others = [self.pool.submit(self._read, s) for s in self.shares[1:]]
        self._read(self.shares[0])
        for f in others:
            f.result()
        return time.perf_counter() - t0

    @staticmethod
    def _read(share) -> None:
        for fd, out, at in share:
            os.preadv(fd, [out], at)

    def close(self) -> None:
        self.pool.shutdown()
        self.shares = []


class ShmSource(PieceReader):
    """The state's bytes in a /dev/shm file, read back into ``dst`` on two threads in
    4 MiB pieces: the kernel's copy between processes, as a hot restore reads the
    daemon's segment (without its checksums and fixed work). The file stays mapped
    meanwhile, as the daemon keeps its segment."""

    def __init__(self, tensors, dst) -> None:
        import torch
        total = nbytes_of(tensors)
        path = f"/dev/shm/snapd-bench-{os.getpid()}"
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.unlink(path)
        try:
            os.posix_fallocate(self.fd, 0, total)
            self.held = mmap.mmap(self.fd, total)
        except BaseException:
            os.close(self.fd)
            raise
        pieces, pos = [], 0
        for t, d in zip(tensors, dst):
            raw = t.reshape(-1).view(torch.uint8).numpy()
            self.held[pos:pos + len(raw)] = raw.tobytes()
            view = memoryview(d.reshape(-1).view(torch.uint8).numpy())
            pieces += [(self.fd, view[o:o + (4 << 20)], pos + o)
                       for o in range(0, len(view), 4 << 20)]
            pos += len(raw)
        super().__init__(pieces, 2)

    def close(self) -> None:
        super().close()
        self.held.close()
        os.close(self.fd)


class DirectReader(PieceReader):
    """Reads some files by O_DIRECT, one after the other, into one page-aligned buffer
    (faulted in first, as the live tensors are) in 8 MiB pieces on ``threads`` threads,
    each :meth:`read` after dropping the files' cached pages. ``fds`` is empty where
    the filesystem refuses O_DIRECT."""

    def __init__(self, paths: List[str], threads: int = 1) -> None:
        self.paths, self.fds = paths, []
        sizes = [os.path.getsize(p) for p in paths]
        try:
            self.fds = [os.open(p, os.O_RDONLY | os.O_DIRECT) for p in paths]
        except OSError:
            for fd in self.fds:
                os.close(fd)
            self.fds = []
        # Direct I/O reads whole 4096-byte blocks: a file whose size is not a multiple
        # (torch.save's, DCP's) ends with a piece rounded up, read short.
        up = lambda n: (n + 4095) // 4096 * 4096   # noqa: E731
        self.buf = mmap.mmap(-1, max(up(z) for z in sizes + [4096]))
        self.buf.write(b"\0" * len(self.buf))
        view = memoryview(self.buf)
        super().__init__([(fd, view[o:o + up(min(PIECE, size - o))], o)
                          for fd, size in zip(self.fds, sizes)
                          for o in range(0, size, PIECE)], threads)

    def read(self) -> float:
        """One cold read of every file; seconds."""
        for path in self.paths:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return super().read()

    def close(self) -> None:
        super().close()
        for fd in self.fds:
            os.close(fd)
        try:
            self.buf.close()
        except BufferError:   # a failed read's traceback still holds a piece of it
            pass


# --- one worker: one method, one size, one process ----------------------------------

def worker(args) -> Dict[str, Any]:
    warnings.filterwarnings("ignore")
    import torch
    t_build = time.perf_counter()
    if args.method == "loop":
        model, opt = bench_loops.build_transformer(parse_size(args.size))
    else:
        model, opt = build_state(parse_size(args.size),
                                 1 if args.method == "slowdown" else args.threads)
    tensors = state_tensors(model, opt)
    res: Dict[str, Any] = {"method": args.method, "size": args.size,
                           "state_bytes": nbytes_of(tensors), "tensors": len(tensors),
                           "threads": torch.get_num_threads(),
                           "build_s": time.perf_counter() - t_build}
    os.makedirs(args.root, exist_ok=True)
    sampler = bench_loops.PeakSampler().start()
    res["rss_before"] = sampler.peak["trainer"]
    res["shm_before"] = bench_loops.own_shm(os.getpid(), None)
    run = {"ref": w_ref, "slowdown": bench_loops.w_slowdown, "loop": bench_loops.w_loop,
           "mem_hot": bench_loops.w_memory, "mem_nohot": bench_loops.w_memory}
    try:
        run.get(args.method, w_method)(args, model, opt, tensors, sampler, res)
    finally:
        stop_daemon(args.root)
        res.setdefault("peak", sampler.stop())
        mine = [f"snapd-{os.getuid()}-{os.getpid()}-"]
        if res.get("daemon_pid"):
            mine.append(f"-{res['daemon_pid']}x")
        res["shm_left"] = [n for n in snapd_shm_files() if any(m in n for m in mine)]
    return res


def run_worker(method: str, size: str, root: str, out: str, args, reps: int,
               **extra) -> Dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--method", method, "--size", size,
           "--root", root, "--out", out, "--reps", str(reps),
           "--cold-reps", str(args.cold_reps), "--threads", str(args.threads),
           "--first-gap", str(args.first_gap)]
    for k, v in extra.items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, PYTHONWARNINGS="ignore"),
                          capture_output=True, text=True, timeout=args.timeout)
    wall = time.perf_counter() - t0
    try:
        with open(out) as f:
            res = json.load(f)
    except (OSError, ValueError):
        res = {"method": method, "size": size,
               "error": f"exit {proc.returncode}: {proc.stderr.strip()[-2000:]}"}
    res["wall_s"] = wall
    left = stop_daemon(root)   # belt and braces: no daemon outlives its worker
    if left is not None and os.path.exists(f"/proc/{left}"):
        res["daemon_left_running"] = left
    shutil.rmtree(root, ignore_errors=True)
    status = "error" if "error" in res else "ok"
    print(f"  {method:14s} {size:5s} {status} in {wall:5.1f} s", file=sys.stderr, flush=True)
    if status == "error":
        print("    " + res["error"][-800:].replace("\n", "\n    "), file=sys.stderr)
    return res


def reps_for(nbytes: int, quick: bool) -> int:
    if quick:
        return 2
    # A 10 ms figure on a VM needs more samples to settle; one sample at 2G flipped
    # targets between runs.
    return 9 if nbytes <= 256 * MiB else 3


def loop_steps(size: str, quick: bool) -> int:
    """Steps of each kind in the overlap loop: a 1G step takes ~1 s here."""
    return 4 if quick else (15 if parse_size(size) <= 256 * MiB else 7)


def orchestrate(args) -> Dict[str, Any]:
    sizes = (args.sizes or ("100M" if args.quick else "100M,1G,2G")).split(",")
    loops = [] if args.no_loop else \
        (args.loop_sizes or ("100M" if args.quick else "100M,1G")).split(",")
    info = start_run()
    info.update(memory_probes())
    shm_before = snapd_shm_files()
    base = f"/tmp/sb{os.getpid()}"
    os.makedirs(base, exist_ok=True)
    data: Dict[str, Any] = {"results": {}, "slowdown": None, "loops": {}, "machine": info}
    try:
        if not args.no_slowdown:
            # First, on a machine no earlier worker has disturbed: after a worker that
            # freed ~11 GB (the 2G ones) this VM slows the snapshot steps for a while.
            size = args.slow_size or ("100M" if args.quick else "1G")
            step_s = args.step_seconds or (1.0 if args.quick else 3.0)
            print(f"slowdown loop ({size}, step ~{step_s:.1f} s)", file=sys.stderr)
            data["slowdown"] = run_worker(
                "slowdown", size, f"{base}/sl", f"{base}/slowdown.json", args, 1,
                step_seconds=round(step_s, 2), slow_steps=args.slow_steps or 2,
                slow_rounds=args.slow_rounds or (1 if args.quick else 2))
        for size in loops:
            print(f"overlap loop ({size})", file=sys.stderr)
            data["loops"][size] = run_worker(
                "loop", size, f"{base}/lp{size}", f"{base}/loop-{size}.json", args,
                args.loop_steps or loop_steps(size, args.quick))
        for size in sizes:
            reps = reps_for(parse_size(size), args.quick)
            print(f"size {size} ({reps} counted repetitions)", file=sys.stderr)
            data["results"][size] = {
                m: run_worker(m, size, f"{base}/{i}{size}", f"{base}/{m}-{size}.json",
                              args, reps) for i, m in enumerate(args.methods)}
    finally:
        shutil.rmtree(base, ignore_errors=True)
    end_run(info, "bench.py", sys.argv[1:])
    # Ours only: other sessions' daemons may share /dev/shm (their files are theirs).
    info["shm_left"] = [n for n in snapd_shm_files() if n not in shm_before and
                        n.startswith(f"snapd-hot-{os.getuid()}-{RUN}-")]
    return data


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default=None, help="comma-separated: 100M,1G,2G (default)")
    ap.add_argument("--quick", action="store_true", help="smoke test: 100M, 2 repetitions")
    ap.add_argument("--json", default="/tmp/snapd-bench.json",
                    help="every figure, as JSON (default /tmp/snapd-bench.json)")
    ap.add_argument("--methods", default=",".join(METHODS + MEMORY))
    ap.add_argument("--no-slowdown", action="store_true")
    ap.add_argument("--slow-size", default=None)
    ap.add_argument("--step-seconds", type=float, default=None)
    ap.add_argument("--first-gap", type=float, default=2.0,
                    help="seconds of training between track() and the first snapshot "
                         "(default 2; 0: one optimizer step and 50 ms of matmuls)")
    ap.add_argument("--slow-steps", type=int, default=None,
                    help="steps per block of the slowdown loop (default 2)")
    ap.add_argument("--slow-rounds", type=int, default=None,
                    help="baseline/snapshot block pairs (default 2; 1 with --quick)")
    ap.add_argument("--cold-reps", type=int, default=3)
    ap.add_argument("--no-loop", action="store_true",
                    help="skip the overlap-mode forward/backward loop")
    ap.add_argument("--loop-sizes", default=None,
                    help="state sizes of that loop (default 100M,1G; 100M with --quick)")
    ap.add_argument("--loop-steps", type=int, default=None,
                    help="steps of each kind in that loop (default 15 up to 256M, 7 "
                         "above; 4 with --quick)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=900)
    for hidden in ("--method", "--size", "--root", "--out"):   # worker mode
        ap.add_argument(hidden, help=argparse.SUPPRESS)
    ap.add_argument("--reps", type=int, default=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.method:
        res = worker(args)
        with open(args.out, "w") as f:
            json.dump(res, f)
        return
    args.methods = args.methods.split(",")
    data = orchestrate(args)
    data["figures"] = bench_render.figures(data)   # ratios and targets, as rendered
    with open(args.json, "w") as f:
        json.dump(data, f, indent=1)
    print(f"figures in {args.json}; the tables: .venv/bin/python scripts/bench_render.py "
          f"{args.json} [--doc docs/benchmarks.md]", file=sys.stderr)


if __name__ == "__main__":
    main()
