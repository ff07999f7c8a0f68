"""Issue 15's measurements for scripts/bench.py: restore speed and memory.

Imported by scripts/bench.py (workers and report); not run on its own.

- ``direct_read`` / ``DirectReader``: the floor for a cold restore, bytes read back by
  ``O_DIRECT`` into a page-aligned buffer: the ``ref`` worker's file, and, paired,
  snapd's own snapshot files between its cold restores (the ``restore_direct``
  target's reference).
- ``w_memory`` (methods ``mem_hot`` / ``mem_nohot``): a run with hot restore on or off
  (snapshots, the trainer closes, a new one restores, snapshots again), sampling the
  bytes of snapd's shared memory and the daemon's RSS outside shared memory.
- ``w_loop`` (method ``loop``): overlap mode where it is meant to win, a small
  transformer (``torch.set_num_threads(1)``) with its forward and backward between
  ``snapshot()`` and ``optimizer.step()``; the step-time increase against the
  staging copy alone.
- ``issue_targets`` / ``issue_lines``: the issue's targets table, with the figures of
  earlier runs beside this one's.

Shared memory is counted by segment, not by name (the arena, the hot copies, or an
arena the daemon keeps as the hot copy after its trainer is gone): every ``snapd-``
segment in /dev/shm that belongs to this worker's trainer or daemon, every one either
process has open or mapped (an unlinked segment counts while it is held), each once
(by inode), at the larger of its allocated size and its resident pages.
"""

from __future__ import annotations

import mmap
import os
import re
import statistics
import threading
import time
from typing import Any, Dict, Iterable, List, Optional, Tuple

from snapd.format import align_up   # to 4096 bytes, direct I/O's block

GiB, MiB = 1 << 30, 1 << 20
SHM = "/dev/shm"
PREFIX = "snapd-"           # snapd/names.py SHM_PREFIX: every segment snapd makes
PIECE = 8 << 20             # O_DIRECT read size (dd bs=8M)
_MAP = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) \S+ ([0-9a-f]+) \S+ (\d+)\s+(/dev/shm/\S+)")


# --- cold restore floor --------------------------------------------------------------

def direct_read(path: str, reps: int, threads: int = 1) -> List[float]:
    """Read ``path`` by O_DIRECT into a page-aligned buffer (faulted in first, as the
    live tensors are), in 8 MiB pieces on ``threads`` threads; ``reps`` times, each
    after dropping the file's cached pages. Empty when O_DIRECT is refused."""
    reader = DirectReader([path], threads)
    try:
        return [reader.read() for _ in range(reps)] if reader.fds else []
    finally:
        reader.close()


class DirectReader:
    """Reads some files by O_DIRECT, one after the other, into one page-aligned buffer
    (faulted in first, as the live tensors are) in 8 MiB pieces on ``threads`` threads,
    each :meth:`read` after dropping the files' cached pages. ``fds`` is empty where
    the filesystem refuses O_DIRECT."""

    def __init__(self, paths: List[str], threads: int = 1) -> None:
        from concurrent.futures import ThreadPoolExecutor
        self.paths, self.threads, self.fds = paths, threads, []
        sizes = [os.path.getsize(p) for p in paths]
        try:
            self.fds = [os.open(p, os.O_RDONLY | os.O_DIRECT) for p in paths]
        except OSError:
            for fd in self.fds:
                os.close(fd)
            self.fds = []
        # Direct I/O reads whole 4096-byte blocks: a file whose size is not a multiple
        # (torch.save's, DCP's) ends with a piece rounded up, read short.
        self.buf = mmap.mmap(-1, max(align_up(z) for z in sizes + [4096]))
        self.buf.write(b"\0" * len(self.buf))
        view = memoryview(self.buf)
        pieces = [(fd, view[o:o + align_up(min(PIECE, size - o))], o)
                  for fd, size in zip(self.fds, sizes) for o in range(0, size, PIECE)]
        self.shares = [pieces[i::threads] for i in range(threads)]
        self.pool = ThreadPoolExecutor(max(threads - 1, 1))

    def read(self) -> float:
        """One cold read of every file; seconds."""
        for path in self.paths:
            drop_file(path)
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
        for fd in self.fds:
            os.close(fd)
        self.shares = []
        try:
            self.buf.close()
        except BufferError:   # a failed read's traceback still holds a piece of it
            pass


def drop_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


# --- shared memory and daemon RSS -----------------------------------------------------

def close_as_if_killed(client) -> None:
    """Hang up without ``bye``, as a killed trainer's connection drops: the daemon
    keeps the run's hot copy for a restart (a clean close releases it; the same
    step as tests/integration/harness.py)."""
    import socket
    conn = getattr(getattr(client, "_handoff", None), "conn", None)
    sock = getattr(conn, "_sock", None)
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
    client.close()


def segments_total(*sources: Dict[int, int]) -> int:
    """Bytes of the segments in ``sources`` ({inode: bytes}, one per way of seeing
    them), each segment counted once at the largest figure any source gives."""
    best: Dict[int, int] = {}
    for src in sources:
        for ino, n in src.items():
            best[ino] = max(best.get(ino, 0), n)
    return sum(best.values())


def parse_smaps(text: str) -> Dict[int, int]:
    """{inode: resident bytes} of the snapd segments mapped in one smaps text; a
    segment mapped in pieces adds its pieces, one range mapped twice counts once."""
    ranges: Dict[Tuple[int, int, int], int] = {}
    key = None
    for line in text.splitlines():
        m = _MAP.match(line)
        if m:
            start, end, offset, ino, path = m.groups()
            key = (int(ino), int(offset, 16), int(end, 16) - int(start, 16)) \
                if os.path.basename(path).startswith(PREFIX) else None
        elif key is not None and line.startswith("Rss:"):
            ranges[key] = max(ranges.get(key, 0), int(line.split()[1]) * 1024)
            key = None
    out: Dict[int, int] = {}
    for (ino, _, _), n in ranges.items():
        out[ino] = out.get(ino, 0) + n
    return out


def held_segments(pid: int) -> Dict[int, int]:
    """Segments a process maps (resident bytes) or holds open (allocated bytes)."""
    try:
        with open(f"/proc/{pid}/smaps") as f:
            mapped = parse_smaps(f.read())
    except OSError:
        return {}
    opened: Dict[int, int] = {}
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        fds = []
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith(f"{SHM}/{PREFIX}"):
                st = os.stat(f"/proc/{pid}/fd/{fd}")
                opened[st.st_ino] = st.st_blocks * 512
        except OSError:
            continue
    return {ino: max(mapped.get(ino, 0), opened.get(ino, 0))
            for ino in set(mapped) | set(opened)}


def named_segments(pids: Iterable[int], run: str) -> Dict[int, int]:
    """Segments in /dev/shm named for these processes (arenas carry the trainer's pid,
    hot copies the daemon's after an ``x``) or for this run's hot copies."""
    uid = os.getuid()
    marks = [f"{PREFIX}{uid}-{p}-" for p in pids] + [f"-{p}x" for p in pids]
    hot = f"{PREFIX}hot-{uid}-{run}-"
    out: Dict[int, int] = {}
    try:
        with os.scandir(SHM) as it:
            for e in it:
                if e.name.startswith(PREFIX) and \
                        (e.name.startswith(hot) or any(m in e.name for m in marks)):
                    st = e.stat()
                    out[st.st_ino] = st.st_blocks * 512
    except OSError:
        pass
    return out


def rss_outside_shm(pid: int) -> Optional[int]:
    """VmRSS minus RssShmem: the process's own memory (anonymous and file pages)."""
    vals: Dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key = line.split(":", 1)[0]
                if key in ("VmRSS", "RssShmem"):
                    vals[key] = int(line.split()[1]) * 1024
    except OSError:
        return None
    return vals.get("VmRSS", 0) - vals.get("RssShmem", 0) if "VmRSS" in vals else None


class ShmMeter:
    """Every ``interval`` s: snapd's shared memory for the trainer (this process) and
    its daemon, and the daemon's RSS outside shared memory; keeps the peaks."""

    def __init__(self, run: str, interval: float = 0.02) -> None:
        self.run, self.interval = run, interval
        self.pids = [os.getpid()]
        self.peak = {"shm": 0, "daemon_own": 0}
        self.phase_peak: Dict[str, int] = {}
        self.phase = "start"
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "ShmMeter":
        self.sample()
        self._thread.start()
        return self

    def add(self, pid: Optional[int]) -> None:
        with self._lock:
            if pid and pid not in self.pids:
                self.pids.append(pid)

    def enter(self, phase: str) -> None:
        self.sample()
        self.phase = phase

    def sample(self) -> None:
        with self._lock:
            pids = list(self.pids)
        total = segments_total(named_segments(pids, self.run),
                               *[held_segments(p) for p in pids])
        self.peak["shm"] = max(self.peak["shm"], total)
        self.phase_peak[self.phase] = max(self.phase_peak.get(self.phase, 0), total)
        for p in pids[1:]:
            own = rss_outside_shm(p)
            if own is not None:
                self.peak["daemon_own"] = max(self.peak["daemon_own"], own)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def stop(self) -> Dict[str, Any]:
        self._stop.set()
        self._thread.join()
        self.sample()
        return {"peak": dict(self.peak), "phases": dict(self.phase_peak)}


def w_memory(args, model, opt, tensors, sampler, res, *, run: str,
             daemon_pid_of, wait_idle, train_briefly) -> None:
    """A run with hot restore on (``mem_hot``) or off (``mem_nohot``), default mode:
    three snapshots; the trainer hangs up without ``bye`` (as one that died: the daemon
    keeps what hot restore keeps); a new trainer restores and takes two more. Sampled
    throughout."""
    from snapd_client import Client
    hot = args.method == "mem_hot"
    meter = ShmMeter(run).start()
    try:
        meter.enter("snapshots")
        c = Client(args.root, run, hot_restore=hot)
        c.track(model=model, optimizer=opt)
        for i in range(3):
            train_briefly()
            c.snapshot(i).wait()
            meter.add(daemon_pid_of(args.root))
        pid = res["daemon_pid"] = daemon_pid_of(args.root)
        close_as_if_killed(c)
        wait_idle(pid)
        meter.enter("between trainers")
        time.sleep(0.2)
        meter.enter("restore")
        c = Client(args.root, run, hot_restore=hot)
        c.track(model=model, optimizer=opt)
        c.restore()
        res["restored_from"] = c.restored_from
        meter.enter("snapshots after restore")
        for i in range(3, 5):
            train_briefly()
            c.snapshot(i).wait()
        wait_idle(pid)
        c.close()
    finally:
        res["meter"] = meter.stop()
    res["peak"] = sampler.stop()


# --- overlap mode in a forward/backward loop ------------------------------------------

D_MODEL, HEADS, FF = 512, 8, 2048
TOKENS = (2, 32)  # batch, sequence: a forward+backward ~6x the staging copy here


def build_transformer(target: int, device: str = "cpu"):
    """A small transformer encoder + AdamW (one step taken) whose params, exp_avg and
    exp_avg_sq add up to ~target bytes; one torch thread."""
    import torch
    torch.set_num_threads(1)
    torch.manual_seed(0)
    per_layer = (4 * D_MODEL * D_MODEL + 2 * D_MODEL * FF) * 4 * 3
    layers = max(1, round(target / per_layer))
    layer = torch.nn.TransformerEncoderLayer(D_MODEL, HEADS, FF, dropout=0.0,
                                             batch_first=True)
    model = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(*TOKENS, D_MODEL, device=device)
    model(x).pow(2).mean().backward()
    opt.step()
    return model, opt


def w_loop(args, model, opt, tensors, sampler, res, *, run: str, daemon_pid_of,
           wait_idle, timed_copy) -> None:
    """Steps of snapshot() (or not), forward, backward, optimizer.step(), alternating
    one with a snapshot and one without; each timed step follows an untimed one (warm
    threads) and, with a snapshot, waits out the daemon's write afterwards (untimed).
    The copy alone (``copy_`` into preallocated memory) is timed the same way."""
    import torch
    from snapd_client import Client
    x = torch.randn(*TOKENS, D_MODEL)
    stamp: Dict[str, float] = {}

    def step(ckpt=None, i=0) -> Dict[str, float]:
        """One training step, timed in parts; with ``ckpt``, snapshot() first."""
        t0 = time.perf_counter()
        h = ckpt.snapshot(i) if ckpt is not None else None
        t1 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        model(x).pow(2).mean().backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        if h is not None:
            h.wait()   # the daemon's write, not timed
        return {"step": t3 - t0, "call": t1 - t0, "fwd_bwd": t2 - t1,
                "blocked": stamp.get("t", t2) - t2}

    def bare_step(private) -> float:
        """The floor of any snapshot that copies behind the forward and backward: the
        same ``copy_`` on a second thread of this process, no snapd, joined before
        optimizer.step(). What it adds to a step is the copy's cost to the forward
        and backward beside it (memory bandwidth, the other core)."""
        t0 = time.perf_counter()
        copier = threading.Thread(target=lambda: [d.copy_(t) for d, t in
                                                  zip(private, tensors)])
        copier.start()
        opt.zero_grad(set_to_none=False)
        model(x).pow(2).mean().backward()
        copier.join()
        opt.step()
        return time.perf_counter() - t0

    c = Client(args.root, run, mode="overlap")
    c.track(model=model, optimizer=opt)
    step(c, 0)   # warm-up: daemon, arena
    pid = res["daemon_pid"] = daemon_pid_of(args.root)
    # Registered after snapd's step pre-hook, so it stamps when snapd's returns.
    opt.register_step_pre_hook(lambda *a: stamp.__setitem__("t", time.perf_counter()))
    private = [torch.empty_like(t) for t in tensors]
    timed_copy(private, tensors)   # faults the destination in
    base, snap, copy, bare = [], [], [], []
    for i in range(1, args.reps + 1):
        wait_idle(pid)
        step()
        base.append(step())
        step()
        copy.append(timed_copy(private, tensors))
        step()
        bare.append(bare_step(private))
        step()
        snap.append(step(c, i))
    c.close()
    res.update(base_s=[b["step"] for b in base], fwd_bwd_s=[b["fwd_bwd"] for b in base],
               bare_s=bare,
               snap_s=[s["step"] for s in snap], call_s=[s["call"] for s in snap],
               fwd_bwd_snap_s=[s["fwd_bwd"] for s in snap],
               blocked_s=[s["blocked"] for s in snap], copy_s=copy,
               tokens=list(TOKENS), d_model=D_MODEL, layers=len(model.layers))
    res["peak"] = sampler.stop()


def loop_summary(r: Dict[str, Any]) -> Dict[str, Optional[float]]:
    """Medians, the step-time increase and that increase over the copy's time."""
    med = {k: (statistics.median(r[k]) if r.get(k) else None)
           for k in ("base_s", "snap_s", "call_s", "blocked_s", "copy_s", "fwd_bwd_s",
                     "fwd_bwd_snap_s", "bare_s")}

    def over_copy(step_s):
        inc = None if step_s is None or med["base_s"] is None else step_s - med["base_s"]
        return inc, (None if inc is None or not med["copy_s"] else inc / med["copy_s"])

    med["increase_s"], med["fraction"] = over_copy(med["snap_s"])
    med["bare_increase_s"], med["bare_fraction"] = over_copy(med["bare_s"])
    return med


# --- the issue's targets --------------------------------------------------------------

TARGETS = [
    ("restore_warm", "file restore, warm: ≤ the faster of torch.load + load_state_dict "
                     "and dcp.load"),
    ("restore_cold", "file restore, cold: ≤ the faster of torch.load + load_state_dict "
                     "and dcp.load"),
    ("restore_direct", "file restore, cold: ≤ 1.2× a raw O_DIRECT read of the same bytes "
                       "(paired since 2026-12-02: its own files, between its restores)"),
    ("shm_hot", "/dev/shm peak of a run, hot_restore on: ≤ 2.05× the state"),
    ("shm_nohot", "/dev/shm peak of a run, hot_restore off: ≤ 1.05× the state"),
    ("daemon_rss", "daemon RSS outside shared memory < 100 MiB"),
    ("first", "first snapshot stall ≤ 2× the median of the later ones (mode=wait)"),
    ("loop", "overlap mode, forward/backward loop: step-time increase ≤ 0.3× the "
             "staging copy"),
    ("hot", "hot restore ≤ 1.5× pread from /dev/shm (100M; paired since 2026-12-02: "
            "after each hot restore); ≤ 2× memcpy, paired (1G, 2G)"),
]

# The 15:07 run (2026-11-29), from docs/benchmarks.md as it was then; "–": not
# measured by that version of the bench.
OLD_1507: Dict[Tuple[str, str], str] = {
    ("restore_warm", "100M"): "3.88× (93 ms vs 24 ms) ✗",
    ("restore_warm", "1G"): "0.84× (260 ms vs 309 ms) ✓",
    ("restore_warm", "2G"): "1.61× (866 ms vs 539 ms) ✗",
    ("restore_cold", "100M"): "3.03× (282 ms vs 93 ms) ✗",
    ("restore_cold", "1G"): "1.36× (1.07 s vs 786 ms) ✗",
    ("restore_cold", "2G"): "1.58× (1.94 s vs 1.23 s) ✗",
    ("shm_hot", "100M"): "≈3× (0.28 GiB) ✗",
    ("shm_hot", "1G"): "3.02× (2.96 GiB) ✗",
    ("shm_hot", "2G"): "3.00× (6.05 GiB) ✗",
    ("first", "100M"): "35× (350 ms vs 10 ms) ✗",
    ("first", "1G"): "17× (1.03 s vs 60 ms) ✗",
    ("first", "2G"): "11.9× (2.12 s vs 178 ms) ✗",
    ("hot", "100M"): "1.48× (28 ms vs 19 ms) ✓",
    ("hot", "1G"): "1.30× (111 ms vs 86 ms) ✓",
    ("hot", "2G"): "1.68× (243 ms vs 144 ms) ✓",
}

# The code before issue 15's changes, measured by this bench (that run's JSON, its
# "issue_targets", through before_from_json): what the merged code is compared with.
# The machine was loaded by other test runs then (docs/benchmarks.md, notes).
BEFORE: Dict[Tuple[str, str], str] = {
    ("restore_warm", "100M"): "1.03× (83 ms vs 81 ms) ✗",
    ("restore_warm", "1G"): "1.61× (865 ms vs 536 ms) ✗",
    ("restore_warm", "2G"): "6.15× (5.66 s vs 920 ms) ✗",
    ("restore_cold", "100M"): "0.67× (83 ms vs 124 ms) ✓",
    ("restore_cold", "1G"): "1.10× (1.12 s vs 1.02 s) ✗",
    ("restore_cold", "2G"): "1.62× (3.04 s vs 1.87 s) ✗",
    ("restore_direct", "100M"): "1.04× (83 ms vs 80 ms) ✓",
    ("restore_direct", "1G"): "2.07× (1.12 s vs 543 ms) ✗",
    ("restore_direct", "2G"): "2.10× (3.04 s vs 1.45 s) ✗",
    ("shm_hot", "100M"): "3.02× (0.28 GiB of 0.09 GiB) ✗",
    ("shm_hot", "1G"): "3.00× (2.96 GiB of 0.98 GiB) ✗",
    ("shm_hot", "2G"): "3.00× (6.05 GiB of 2.02 GiB) ✗",
    ("shm_nohot", "100M"): "1.02× (0.10 GiB of 0.09 GiB) ✓",
    ("shm_nohot", "1G"): "1.00× (0.99 GiB of 0.98 GiB) ✓",
    ("shm_nohot", "2G"): "1.00× (2.02 GiB of 2.02 GiB) ✓",
    ("daemon_rss", "100M"): "28 MiB ✓",
    ("daemon_rss", "1G"): "29 MiB ✓",
    ("daemon_rss", "2G"): "30 MiB ✓",
    ("first", "100M"): "12.27× (530 ms vs 43 ms) ✗",
    ("first", "1G"): "5.41× (2.88 s vs 533 ms) ✗",
    ("first", "2G"): "4.16× (5.95 s vs 1.43 s) ✗",
    ("loop", "100M"): "3.27× (+61 ms per step vs a copy of 19 ms) ✗",
    ("loop", "1G"): "2.27× (+402 ms per step vs a copy of 177 ms) ✗",
    ("hot", "100M"): "10.92× (173 ms vs 16 ms) ✗",
    ("hot", "1G"): "6.75× (3.20 s vs 475 ms) ✗",
    ("hot", "2G"): "6.36× (6.72 s vs 1.06 s) ✗",
}
BEFORE_DATE = "2026-12-01 14:11 UTC, loaded"


def _ms(x: Optional[float]) -> str:
    if x is None:
        return "–"
    return f"{x * 1e3:.0f} ms" if x < 1 else f"{x:.2f} s"


def target(tid: str, size: str, x: Optional[float], y: Optional[float], limit: float,
           unit: str = "time") -> Optional[Dict[str, Any]]:
    """One target row: x against y must be at most ``limit`` (x / y ≤ limit)."""
    if x is None or not y:
        return None
    ratio = x / y
    if unit == "time":
        text = f"{ratio:.2f}× ({_ms(x)} vs {_ms(y)})"
    else:
        text = f"{ratio:.2f}× ({x / GiB:.2f} GiB of {y / GiB:.2f} GiB)"
    return {"id": tid, "size": size, "measured": text, "ratio": ratio,
            "ok": ratio <= limit}


def size_targets(size: str, per: Dict[str, Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The targets one size's workers answer (the loop's are in loop_target)."""
    def m(method, key):
        xs = per.get(method, {}).get(key)
        return statistics.median(xs) if xs else None

    def faster(*xs):
        xs = [x for x in xs if x is not None]
        return min(xs) if xs else None

    rows = [
        target("restore_warm", size, m("snapd_wait", "restore_warm_s"),
               faster(m("torch_save", "restore_warm_s"), m("dcp_save", "restore_warm_s")),
               1.0),
        target("restore_cold", size, m("snapd_wait", "restore_cold_s"),
               faster(m("torch_save", "restore_cold_s"), m("dcp_save", "restore_cold_s")),
               1.0),
        # Paired where measured: the snapshot's own files, read between its restores.
        target("restore_direct", size, m("snapd_wait", "restore_cold_s"),
               m("snapd_wait", "paired_direct_s") or m("ref", "direct_read_s"), 1.2)]
    for method, tid, limit in (("mem_hot", "shm_hot", 2.05), ("mem_nohot", "shm_nohot", 1.05)):
        r = per.get(method, {})
        if "meter" in r:
            rows.append(target(tid, size, r["meter"]["peak"]["shm"], r["state_bytes"],
                               limit, unit="bytes"))
    own = per.get("mem_hot", {}).get("meter", {}).get("peak", {}).get("daemon_own")
    if own:
        rows.append({"id": "daemon_rss", "size": size, "measured": f"{own / MiB:.0f} MiB",
                     "ratio": own / (100 * MiB), "ok": own < 100 * MiB})
    sw = per.get("snapd_wait", {})
    first = target("first", size, sw.get("first_call_s"), m("snapd_wait", "stall_s"), 2.0)
    gapped = m("snapd_wait", "stall_after_gap_s")
    if first is not None and gapped:
        first["measured"] += (f"; later ones after as long a gap: {_ms(gapped)}, "
                              f"{sw['first_call_s'] / gapped:.2f}×")
    rows.append(first)
    hot = m("snapd_wait", "restore_hot_s")
    if size_bytes(size) <= 256 * MiB:
        # Paired where measured: a pread whose source sat untouched as long as the
        # daemon's hot copy, after each hot restore.
        rows.append(target("hot", size, hot, m("snapd_wait", "paired_shm_read_s")
                           or m("ref", "shm_read_s"), 1.5))
    else:
        rows.append(target("hot", size, hot, m("snapd_wait", "paired_hot_copy_s"), 2.0))
    return [r for r in rows if r is not None]


COLD_METHODS = (("snapd_wait", "snapd"), ("torch_save", "torch.load + load_state_dict"),
                ("dcp_save", "dcp.load"))


def cold_against_own_raw(per: Dict[str, Dict[str, Any]]) -> Optional[str]:
    """Each method's cold restore against its own worker's raw O_DIRECT read of the
    files it restored (``paired_direct_s``): the disk's speed moves between workers
    that run minutes apart, so this is the comparison at one disk speed."""
    parts = []
    for method, label in COLD_METHODS:
        r = per.get(method, {})
        cold, raw = r.get("restore_cold_s"), r.get("paired_direct_s")
        if cold and raw:
            c, d = statistics.median(cold), statistics.median(raw)
            parts.append(f"{label} {c / d:.2f}× ({_ms(c)} vs {_ms(d)})")
    if not parts:
        return None
    return ("- cold restore against the same worker's raw O_DIRECT read of the files it "
            "restored (not a target; the disk's speed moves between workers): "
            + ", ".join(parts))


def loop_target(size: str, r: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    s = loop_summary(r)
    if s["fraction"] is None:
        return None
    floor = "" if s["bare_fraction"] is None else \
        f"; a bare copy_ beside: {s['bare_fraction']:.2f}×"
    return {"id": "loop", "size": size,
            "measured": f"{s['fraction']:.2f}× (+{_ms(s['increase_s'])} per step "
                        f"vs a copy of {_ms(s['copy_s'])}{floor})",
            "ratio": s["fraction"], "ok": s["fraction"] <= 0.3}


def size_bytes(size: str) -> int:
    text = size.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": MiB, "G": GiB}.get(text[-1:], 1)
    return int(float(text[:-1] if text[-1:] in "KMG" else text) * mult)


def issue_table(rows: List[Dict[str, Any]], before: Dict[Tuple[str, str], str],
                before_date: str = "") -> List[str]:
    """Markdown: every target of the issue at every size measured, the 15:07 figure,
    the branch's run before the change (when given), this run's, pass or not."""
    head = ["target", "size", "15:07 run"]
    if before:
        head.append(f"before ({before_date})" if before_date else "before")
    head += ["this run", "result"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    label = dict(TARGETS)
    order = {tid: i for i, (tid, _) in enumerate(TARGETS)}
    for r in sorted(rows, key=lambda r: (order[r["id"]], size_bytes(r["size"]))):
        key = (r["id"], r["size"])
        cells = [label[r["id"]], r["size"], OLD_1507.get(key, "–")]
        if before:
            cells.append(before.get(key, "–"))
        cells += [r["measured"], "pass" if r["ok"] else "**fail**"]
        out.append("| " + " | ".join(cells) + " |")
    return out


def before_from_json(data: Dict[str, Any]) -> Dict[Tuple[str, str], str]:
    """A previous run's targets (its JSON's ``issue_targets``) as the 'before' column."""
    return {(r["id"], r["size"]): f"{r['measured']} {'✓' if r['ok'] else '✗'}"
            for r in data.get("issue_targets", [])}


# --- report sections -------------------------------------------------------------------

def memory_lines(size: str, per: Dict[str, Dict[str, Any]]) -> List[str]:
    out = []
    for method, label in (("mem_hot", "hot_restore on"), ("mem_nohot", "hot_restore off")):
        r = per.get(method)
        if not r:
            continue
        if "error" in r:
            out.append(f"- shared memory, {label}: error")
            continue
        meter, state = r["meter"], r["state_bytes"]
        phases = ", ".join(f"{k} {v / GiB:.2f} GiB" for k, v in meter["phases"].items()
                           if k != "start")
        out.append(f"- /dev/shm, a run with {label} (3 snapshots, the trainer hangs up "
                   f"as if killed, a new one restores ({r.get('restored_from')}), 2 more): peak "
                   f"{meter['peak']['shm'] / GiB:.2f} GiB = "
                   f"{meter['peak']['shm'] / state:.2f}× the state; by phase: {phases}; "
                   f"the daemon's RSS outside shared memory peaked at "
                   f"{meter['peak']['daemon_own'] / MiB:.0f} MiB")
    return out


def first_line(per: Dict[str, Dict[str, Any]]) -> List[str]:
    sw = per.get("snapd_wait", {})
    if "first_call_s" not in sw or not sw.get("stall_s"):
        return []
    later = statistics.median(sw["stall_s"])
    return [f"- first snapshot (mode=wait): track() took {_ms(sw.get('track_s'))}, "
            f"restore() of the fresh run {_ms(sw.get('fresh_restore_s'))}; then "
            f"an optimizer step and training until the first snapshot "
            f"({_ms(sw.get('gap_s'))}: `--first-gap`, the steps before a loop's first "
            "snapshot, while the daemon starts and the arena is made in the "
            "background); the "
            f"first snapshot() stalled {_ms(sw['first_call_s'])}, "
            f"{sw['first_call_s'] / later:.1f}× the median of the later ones "
            f"({_ms(later)})" + gapped_text(sw)]


def gapped_text(sw: Dict[str, Any]) -> str:
    gapped = sw.get("stall_after_gap_s")
    if not gapped:
        return ""
    median = statistics.median(gapped)
    return (f"; later snapshots each after as long a gap of training as the first had "
            f"stalled {_ms(median)} (median of {len(gapped)}), the first "
            f"{sw['first_call_s'] / median:.1f}× that")


def loop_lines(loops: Dict[str, Dict[str, Any]]) -> List[str]:
    if not loops:
        return []
    out = ["### Overlap mode in a training loop (forward and backward between snapshot() "
           "and optimizer.step())", "",
           f"A transformer encoder (d_model {D_MODEL}, {HEADS} heads, feed-forward {FF}) + "
           "AdamW, `torch.set_num_threads(1)`; each step: snapshot() (or not), "
           f"forward and backward on {TOKENS[0]}×{TOKENS[1]} tokens, optimizer.step(), "
           "in overlap mode (the copy runs behind the forward and backward; the step "
           "pre-hook waits for what is left of it). Steps with and without a snapshot "
           "alternate, each after an untimed step; after a snapshot step the daemon's "
           "write is waited out, untimed. The copy alone is a `copy_` of the state into "
           "preallocated memory on the same thread count, timed between the same steps. "
           "*Bare copy beside* is the floor of any snapshot that copies behind the "
           "forward and backward: the same `copy_` on a second thread of the trainer, "
           "no snapd, joined before optimizer.step(), between the same steps.",
           "", "| state | layers | step, no snapshot | step with snapshot | increase | "
           "copy alone | increase / copy | bare copy beside: increase / copy | "
           "forward+backward, no snapshot / with | snapshot() call | blocked in pre-hook |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]

    def frac(x):
        return "–" if x is None else f"{x:.2f}"

    for size, r in loops.items():
        if "error" in r:
            out.append(f"| {size} | error | | | | | | | | | |")
            continue
        s = loop_summary(r)
        inc = "–" if s["increase_s"] is None else f"{s['increase_s'] * 1e3:+.1f} ms"
        bare = "–" if s["bare_increase_s"] is None else \
            f"{frac(s['bare_fraction'])} ({s['bare_increase_s'] * 1e3:+.1f} ms)"
        out.append(f"| {size} ({r['state_bytes'] / GiB:.2f} GiB) | {r.get('layers')} | "
                   f"{_ms(s['base_s'])} | {_ms(s['snap_s'])} | {inc} | "
                   f"{_ms(s['copy_s'])} | {frac(s['fraction'])} | {bare} | "
                   f"{_ms(s['fwd_bwd_s'])} / {_ms(s['fwd_bwd_snap_s'])} | "
                   f"{_ms(s['call_s'])} | {_ms(s['blocked_s'])} |")
    n = next((len(r["snap_s"]) for r in loops.values() if r.get("snap_s")), 0)
    return out + ["", f"({n} steps of each kind; medians.)", ""]
