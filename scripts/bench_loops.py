"""The bench's runs that are training loops rather than saves, for scripts/bench.py
(each runs in a worker of its own; not run on its own), and what they sample.

- ``slowdown``: a CPU-bound loop (``torch.set_num_threads(1)``, matmuls + AdamW step)
  whose step (3 s) is longer than one snapshot write; the step time without
  snapshots against a snapd overlap-mode snapshot every step, and where the CPU went.
- ``loop``: overlap mode where it is meant to win, a small transformer with its
  forward and backward between ``snapshot()`` and ``optimizer.step()``; the
  step-time increase against the staging copy alone.
- ``mem_hot`` / ``mem_nohot``: a run with hot restore on or off (snapshots, the
  trainer hangs up as if killed, a new one restores, snapshots again), sampling
  snapd's shared memory and the daemon's RSS outside it (:class:`ShmMeter`).

Shared memory is counted by segment, not by name (the arena, the hot copies, or an
arena the daemon keeps as the hot copy after its trainer is gone): every ``snapd-``
segment in /dev/shm that belongs to this worker's trainer or daemon, every one either
process has open or mapped (an unlinked segment counts while it is held), each once
(by inode), at the larger of its allocated size and its resident pages.
"""

from __future__ import annotations

import os
import re
import threading
import time
from typing import Any, Dict, Iterable, Optional, Tuple

from benchlib import close_as_if_killed, daemon_pid_of, timed_copy, train_briefly, wait_idle

RUN = "bench"
SHM = "/dev/shm"
PREFIX = "snapd-"           # snapd/names.py SHM_PREFIX: every segment snapd makes
_MAP = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) \S+ ([0-9a-f]+) \S+ (\d+)\s+(/dev/shm/\S+)")


# --- peak memory --------------------------------------------------------------------


def proc_status(pid: int) -> Dict[str, int]:
    """/proc/<pid>/status's memory figures (VmRSS, RssShmem, ...) in bytes; {} when
    the process is gone."""
    out: Dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if value.strip().endswith(" kB"):
                    out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def own_shm(trainer: int, daemon: Optional[int]) -> int:
    """/dev/shm bytes that are this worker's: snapd's arena (or, for DCP, the shared
    staging copy torch maps and unlinks at once) plus the daemon's hot copies."""
    arena, hot = 0, 0
    uid = os.getuid()
    try:
        with os.scandir(SHM) as it:
            for e in it:
                if e.name.startswith(f"snapd-{uid}-{trainer}-"):
                    arena += e.stat().st_size
                elif daemon and e.name.startswith(f"snapd-hot-{uid}-") and \
                        f"-{daemon}x" in e.name:
                    hot += e.stat().st_size
    except OSError:
        pass
    return max(arena, proc_status(trainer).get("RssShmem", 0)) + hot


class Sampler:
    """Calls :meth:`sample` every ``interval`` s on a thread of its own, from
    :meth:`start` until :meth:`stop`, which samples once more and returns the result."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self):
        self.sample()
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def stop(self) -> Dict[str, Any]:
        self._stop.set()
        self._thread.join()
        self.sample()
        return self.result()


class PeakSampler(Sampler):
    """Peak RSS of this process (and of added pids), and of this worker's /dev/shm
    use (see own_shm), every 10 ms."""

    def __init__(self, interval: float = 0.01) -> None:
        import psutil
        super().__init__(interval)
        self._psutil = psutil
        self.procs: Dict[str, Any] = {"trainer": psutil.Process()}
        self.peak: Dict[str, int] = {"trainer": 0, "shm": 0}

    def add(self, role: str, pid: int) -> None:
        with self._lock:
            if role not in self.procs:
                self.procs[role] = self._psutil.Process(pid)
                self.peak[role] = 0

    def sample(self) -> None:
        with self._lock:
            procs = list(self.procs.items())
        for role, proc in procs:
            try:
                self.peak[role] = max(self.peak[role], proc.memory_info().rss)
            except self._psutil.Error:
                continue
        daemon = self.procs.get("daemon")
        self.peak["shm"] = max(self.peak["shm"],
                               own_shm(os.getpid(), daemon.pid if daemon else None))

    def result(self) -> Dict[str, int]:
        return dict(self.peak)


# --- shared memory and daemon RSS ----------------------------------------------------

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


class ShmMeter(Sampler):
    """Every ``interval`` s: snapd's shared memory for the trainer (this process) and
    its daemon, and the daemon's RSS outside shared memory (VmRSS - RssShmem: its own
    anonymous and file pages); keeps the peaks, overall and by phase."""

    def __init__(self, run: str, interval: float = 0.02) -> None:
        super().__init__(interval)
        self.run, self.pids, self.phase = run, [os.getpid()], "start"
        self.peak = {"shm": 0, "daemon_own": 0}
        self.phase_peak: Dict[str, int] = {}

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
            status = proc_status(p)
            if "VmRSS" in status:
                own = status["VmRSS"] - status.get("RssShmem", 0)
                self.peak["daemon_own"] = max(self.peak["daemon_own"], own)

    def result(self) -> Dict[str, Any]:
        return {"peak": dict(self.peak), "phases": dict(self.phase_peak)}


def w_memory(args, model, opt, tensors, sampler, res) -> None:
    """A run with hot restore on (``mem_hot``) or off (``mem_nohot``), default mode:
    three snapshots; the trainer hangs up without ``bye`` (as one that died: the daemon
    keeps what hot restore keeps); a new trainer restores and takes two more. Sampled
    throughout."""
    from snapd_client import Client
    hot = args.method == "mem_hot"
    meter = ShmMeter(RUN).start()
    try:
        meter.enter("snapshots")
        c = Client(args.root, RUN, hot_restore=hot)
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
        c = Client(args.root, RUN, hot_restore=hot)
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


def w_loop(args, model, opt, tensors, sampler, res) -> None:
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

    c = Client(args.root, RUN, mode="overlap")
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



# --- the training slowdown ------------------------------------------------------------

def w_slowdown(args, model, opt, tensors, sampler, res) -> None:
    import torch
    from snapd_client import Client
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    c = torch.empty(1024, 1024)
    torch.mm(a, b, out=c)
    t0 = time.perf_counter()
    for _ in range(10):
        torch.mm(a, b, out=c)
    unit = (time.perf_counter() - t0) / 10
    opt_s = []
    for _ in range(2):
        t0 = time.perf_counter()
        opt.step()
        opt_s.append(time.perf_counter() - t0)
    units = max(1, round((args.step_seconds - min(opt_s)) / unit))
    res.update(matmul_s=unit, units=units, opt_step_s=opt_s, target_step_s=args.step_seconds)

    parts = {"base": [], "snap": []}   # per step: (matmuls, optimizer step, snapshot())

    def step():
        t0 = time.perf_counter()
        for _ in range(units):
            torch.mm(a, b, out=c)
        t1 = time.perf_counter()
        opt.step()   # in overlap mode snapd's pre-hook waits here for the copy
        return t1 - t0, time.perf_counter() - t1

    import psutil
    me = psutil.Process()
    cpu_acc = {"base": [0.0, 0.0, 0.0, 0.0], "snap": [0.0, 0.0, 0.0, 0.0]}

    def cpu_now():
        """(trainer CPU-s, daemon CPU-s, machine busy CPU-s, machine steal CPU-s)"""
        t = me.cpu_times()
        d = 0.0
        if "daemon" in sampler.procs:
            try:
                dt = sampler.procs["daemon"].cpu_times()
                d = dt.user + dt.system
            except psutil.Error:
                pass
        m = psutil.cpu_times()
        busy = sum(m) - m.idle - getattr(m, "iowait", 0.0) - getattr(m, "steal", 0.0) \
            - getattr(m, "guest", 0.0) - getattr(m, "guest_nice", 0.0)
        return [t.user + t.system, d, busy, getattr(m, "steal", 0.0)]

    def block(n, ckpt=None, start=0):
        times, handles = [], []
        c0 = cpu_now()
        for i in range(n):
            t0 = time.perf_counter()
            mm, st = step()
            t1 = time.perf_counter()
            if ckpt is not None:
                handles.append(ckpt.snapshot(start + i))
            times.append(time.perf_counter() - t0)
            if ckpt is None or i:   # as counted: not the first step of a snapshot block
                parts["snap" if ckpt is not None else "base"].append(
                    (mm, st, time.perf_counter() - t1))
        c1 = cpu_now()
        kind = "snap" if ckpt is not None else "base"
        for k in range(4):
            cpu_acc[kind][k] += c1[k] - c0[k]
        return times, handles

    step()  # warm
    ckpt = Client(args.root, RUN, mode="overlap")
    ckpt.track(model=model, optimizer=opt)
    ckpt.snapshot(0).wait()   # warm-up: daemon, arena
    pid = res["daemon_pid"] = daemon_pid_of(args.root)
    res["settle_s"] = wait_idle(pid)  # and the daemon's spare hot segment
    if pid:
        sampler.add("daemon", pid)
    rounds, steps = args.slow_rounds or 1, args.slow_steps or 2
    # Blocks alternate (A B A B A) so that load from other processes hits both sides.
    base, snap, first, handles = [], [], [], []
    for r in range(rounds):
        base += block(steps)[0]
        # One more step than counted: the first has no earlier snapshot to overlap.
        times, hs = block(steps + 1, ckpt, start=1 + r * (steps + 1))
        first.append(times[0])
        snap += times[1:]
        handles += hs
        for h in hs:
            h.wait()   # the next baseline block runs with the daemon idle
        wait_idle(pid)
    base += block(steps)[0]
    results = [h.wait() for h in handles]
    ckpt.close()
    res.update(base_s=base, snap_s=snap, snap_first_s=first,
               backpressure_s=[h.stall_seconds for h in handles],
               skipped=list(ckpt.skipped),
               daemon_write_s=[r.seconds for r in results if r is not None])
    # CPU-seconds per block kind: trainer, daemon, whole machine (busy), steal.
    res["cpu"] = {k: dict(zip(("trainer", "daemon", "machine", "steal"), v))
                  for k, v in cpu_acc.items()}
    res["cpu_wall"] = {"base": sum(base), "snap": sum(snap) + sum(first)}
    res["cpu_steps"] = {"base": len(base), "snap": len(snap) + len(first)}
    res["parts"] = parts
    res["peak"] = sampler.stop()

