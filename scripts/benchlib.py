"""What every benchmark under scripts/ shares: the state, the machine, the page cache,
the daemon, the figures' formats and docs/benchmarks.md's sections.

Imported by the bench scripts beside it; not run on its own.
"""

from __future__ import annotations

import datetime
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
GiB, MiB = 1 << 30, 1 << 20
WIDTH = 2048


# --- the state ----------------------------------------------------------------------

def parse_size(text: str) -> int:
    """"100M", "1G", "2GiB": bytes (binary units)."""
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": MiB, "G": GiB}.get(text[-1:], 1)
    return int(float(text[:-1] if text[-1:] in "KMG" else text) * mult)


def build_state(target: int, threads: int, device: str = "cpu", step: bool = True):
    """An MLP + AdamW whose params, exp_avg and exp_avg_sq add up to ~target bytes,
    after one optimizer step; ``step=False``: as a restarted trainer builds it, before
    its restore (the optimizer holds no state yet)."""
    import torch
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    per_layer = (WIDTH * WIDTH + WIDTH) * 4 * 3
    layers = max(1, round(target / per_layer))
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH)
                                  for _ in range(layers)]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if not step:
        return model, opt
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3   # kept: a training process holds grads
    opt.step()
    return model, opt


def state_tensors(model, opt) -> list:
    out = [p.detach() for p in model.parameters()]
    for st in opt.state.values():
        out += [v for v in st.values() if hasattr(v, "numel")]
    return out


def nbytes_of(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


_TRAIN: Dict[str, Any] = {}


def train_briefly(seconds: float = 0.05) -> None:
    """Matmuls for ``seconds``: what a training loop does between snapshots.

    Every timed copy and save runs after this. On this VM a copy that follows a
    sleep runs up to 2x slower than one that follows compute (torch's intra-op
    threads went idle): timing after a sleep would measure the benchmark's waiting,
    not the method (scripts/bench_staging.py shows both conditions).
    """
    import torch
    if not _TRAIN:
        _TRAIN.update(a=torch.randn(512, 512), b=torch.randn(512, 512),
                      c=torch.empty(512, 512))
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        torch.mm(_TRAIN["a"], _TRAIN["b"], out=_TRAIN["c"])


def timed_copy(dst, src) -> float:
    """One ``copy_`` of every tensor into preallocated memory, timed."""
    import torch
    t0 = time.perf_counter()
    with torch.no_grad():
        for d, s in zip(dst, src):
            d.copy_(s)
    return time.perf_counter() - t0


def median(xs) -> Optional[float]:
    return statistics.median(xs) if xs else None


def calm_steps(steps: List[tuple], spans: List[tuple], guard_s: float) -> List[float]:
    """The durations of the calm ones among ``steps`` ((start, end) each): those that
    neither overlap a snapshot's ``spans`` ((from, to): its call to durable) nor start
    within ``guard_s`` after one. Their mean is what a step costs undisturbed, measured
    in the same seconds as the loop (bench_cadence.py, bench_frameworks.py)."""
    return [b - a for a, b in steps
            if not any(a < end + guard_s and b > start for start, end in spans)]


def round_order(items, round_: int) -> tuple:
    """The order of one round of a bench that repeats its configurations: forward in
    even rounds, backward in odd ones, so that the machine's drift falls on each alike."""
    return tuple(items) if round_ % 2 == 0 else tuple(reversed(items))


# --- files and the page cache -------------------------------------------------------

def files_under(path: str) -> List[str]:
    return [path] if os.path.isfile(path) else \
        sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs)


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(p) for p in files_under(path))


def cached_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Cached:"):
                return int(line.split()[1]) * 1024
    return 0


def drop_cache(path: str) -> int:
    """sync, then POSIX_FADV_DONTNEED on every file under path; page-cache bytes freed."""
    os.sync()
    before = cached_bytes()
    for p in files_under(path):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return before - cached_bytes()


_WARM = """import sys
total = 0
for p in sys.argv[1:]:
    with open(p, "rb", buffering=0) as fh:
        while block := fh.read(16 << 20):
            total += len(block)
print(total)"""


def warm_cache(path: str) -> int:
    """Read every file under ``path`` once into the page cache; its bytes.

    Read by a child process: reading here would leave the caller's malloc changed
    (freeing a 16 MiB block raises glibc's mmap threshold), and a restore timed
    after it would then fault its memory in at other moments than a restarted
    trainer's does (measured: 4.6 k instead of 93 k page faults in the first
    backward after torch.load at 1G, and 171 k instead of 49 k in the step)."""
    out = subprocess.run([sys.executable, "-c", _WARM, *files_under(path)], check=True,
                         capture_output=True, text=True).stdout
    return int(out)


# --- the daemon ---------------------------------------------------------------------

def daemon_pid_of(root: str) -> Optional[int]:
    try:
        with open(os.path.join(root, ".snapd.lock")) as f:
            text = f.read().strip()
        return int(text) if text else None
    except (OSError, ValueError):
        return None


def stop_daemon(root: str, timeout: float = 120.0) -> Optional[int]:
    """SIGTERM the daemon named in <root>/.snapd.lock and wait for it; its pid."""
    import psutil
    pid = daemon_pid_of(root)
    if pid is None:
        return None
    try:
        proc = psutil.Process(pid)
        cmd = " ".join(proc.cmdline())
        if "snapd" not in cmd or "serve" not in cmd:
            return None   # a stale pid reused by something else: not ours to signal
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout)
    except psutil.NoSuchProcess:
        pass
    return pid


def wait_idle(pid: Optional[int], timeout: float = 60.0) -> float:
    """Until the daemon has used under 10 ms of CPU in 0.25 s (after a commit it may
    still be making its spare hot segment, new pages: that must not land in a
    measured step); returns how long that took."""
    import psutil
    t0 = time.monotonic()
    if not pid:
        return 0.0
    try:
        proc = psutil.Process(pid)
        while time.monotonic() - t0 < timeout:
            before = sum(proc.cpu_times()[:2])
            time.sleep(0.25)
            if sum(proc.cpu_times()[:2]) - before < 0.01:
                break
    except psutil.Error:
        pass
    return time.monotonic() - t0


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


def snapd_shm_files() -> List[str]:
    try:
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith("snapd-"))
    except OSError:
        return []


# --- the machine --------------------------------------------------------------------

def busy_processes() -> List[str]:
    """Other processes using CPU right now (1 s sample), heaviest first."""
    import psutil
    me = {os.getpid()} | {p.pid for p in psutil.Process().children(recursive=True)}
    procs = []
    for p in psutil.process_iter(["pid", "cmdline", "name"]):
        try:
            if p.pid not in me:
                p.cpu_percent(None)
                procs.append(p)
        except psutil.Error:
            pass
    time.sleep(1.0)
    usage = []
    for p in procs:
        try:
            cpu = p.cpu_percent(None)
            if cpu >= 5:
                cmd = " ".join(p.info["cmdline"] or [p.info["name"] or "?"])
                usage.append((cpu, f"{cmd[:90]} ({cpu:.0f}% CPU)"))
        except psutil.Error:
            pass
    return [u for _, u in sorted(usage, reverse=True)[:6]]


def start_run(probe: bool = True) -> Dict[str, Any]:
    """The machine as a run starts: what it is, and what else is using it."""
    import psutil
    import torch
    model = "?"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    vm = psutil.virtual_memory()
    return {"nproc": len(os.sched_getaffinity(0)), "cpu": model, "mem_total": vm.total,
            "mem_available": vm.available, "python": platform.python_version(),
            "torch": torch.__version__, "kernel": platform.release(),
            "tmp_disk": tmp_disk(), "shm_total": shutil.disk_usage("/dev/shm").total,
            "start": time.time(), "load_before": os.getloadavg(),
            "busy_before": busy_processes() if probe else []}


def end_run(info: Dict[str, Any], script: str, argv: List[str], probe: bool = True) -> None:
    """Load, other processes, duration, date and the command line, as the run ends."""
    env = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items())
                   if k.startswith("SNAPD_"))
    info.update(load_after=os.getloadavg(), busy_after=busy_processes() if probe else [],
                elapsed_s=time.time() - info["start"],
                date=datetime.datetime.fromtimestamp(info["start"], datetime.timezone.utc)
                .strftime("%Y-%m-%d %H:%M UTC"),
                command=(env + " " if env else "") + f".venv/bin/python scripts/{script} "
                + " ".join(argv))


def tmp_disk() -> str:
    dev, fstype, best = "?", "?", ""
    with open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            if "/tmp".startswith(parts[1].rstrip("/") or "/") and len(parts[1]) >= len(best):
                best, dev, fstype = parts[1], parts[0], parts[2]
    du = shutil.disk_usage("/tmp")
    return (f"{dev} ({fstype}, mounted on {best}), {du.total / GiB:.0f} GiB, "
            f"{du.free / GiB:.0f} GiB free")


def memory_probes() -> Dict[str, Any]:
    """What new and stale memory cost here. First touch against touching again: on a
    VM whose freed pages go back to the host, every new page (page cache, tmpfs, fresh
    tensors) is slow. Reading memory right away against after it sat untouched (the
    process busy elsewhere), in 4 KiB and in 2 MiB pages: memory left alone for a
    second can be several times slower to touch again, which weighs on every copy of
    memory last touched a while ago (a hot copy, an arena, a model after a pause)."""
    import mmap
    import torch
    import xxhash
    x = torch.empty(512 * MiB, dtype=torch.uint8)
    t0 = time.perf_counter()
    x.fill_(1)
    t1 = time.perf_counter()
    x.fill_(2)
    t2 = time.perf_counter()
    other = torch.randn(512, 512)

    def busy(seconds: float) -> None:
        t = time.perf_counter()
        while time.perf_counter() - t < seconds:
            other @ other

    def hash_gbps(view) -> float:
        t = time.perf_counter()
        xxhash.xxh3_64_intdigest(view)
        return len(view) / (time.perf_counter() - t) / 1e9

    stale, view = {}, memoryview(x.numpy())
    for idle in (0.0, 1.0, 3.0):
        busy(idle)
        stale[str(idle)] = hash_gbps(view)
    del view, x
    # Private: an anonymous mmap is shared (shmem) by default, and shmem follows
    # /dev/shm's rules, not the process's madvise.
    huge = mmap.mmap(-1, 512 * MiB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        huge.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):   # no THP here: the figure says what 4 KiB pays
        pass
    view = memoryview(huge)
    view[:] = b"\1" * len(view)
    busy(3.0)
    stale_huge = hash_gbps(view)
    view.release()
    huge.close()
    return {"first_touch_gbps": 512 * MiB / (t1 - t0) / 1e9,
            "retouch_gbps": 512 * MiB / (t2 - t1) / 1e9, "stale_read_gbps": stale,
            "stale_read_huge_gbps": stale_huge, "damon": damon_schemes(),
            "shm_huge": shm_huge_pages()}


def shm_huge_pages() -> str:
    """Whether /dev/shm may use 2 MiB pages: its mount's ``huge=`` option (tmpfs
    default: never)."""
    try:
        with open("/proc/mounts") as f:
            for parts in (line.split() for line in f):
                if len(parts) > 3 and parts[1] == "/dev/shm":
                    opts = [o for o in parts[3].split(",") if o.startswith("huge=")]
                    return opts[0].split("=", 1)[1] if opts else "never"
    except OSError:
        pass
    return "?"


def damon_schemes() -> List[str]:
    """The kernel's running DAMON schemes, e.g. "pageout of regions idle >= 6.0 s": a
    kernel reclaiming memory it sees idle makes touching it again slow. Empty where
    there is none or it cannot be read."""
    root, out = "/sys/kernel/mm/damon/admin/kdamonds", []

    def read(*path: str) -> str:
        with open(os.path.join(*path)) as f:
            return f.read().strip()

    def numbered(path: str) -> List[str]:
        return [os.path.join(path, n) for n in sorted(os.listdir(path)) if n.isdigit()]
    try:
        for kd in numbered(root):
            if read(kd, "state") != "on":
                continue
            for ctx in numbered(os.path.join(kd, "contexts")):
                aggr_us = int(read(ctx, "monitoring_attrs", "intervals", "aggr_us"))
                for sc in numbered(os.path.join(ctx, "schemes")):
                    age = int(read(sc, "access_pattern", "age", "min"))
                    out.append(f"{read(sc, 'action')} of regions idle "
                               f">= {age * aggr_us / 1e6:.1f} s")
    except (OSError, ValueError):
        pass
    return out


# --- figures as text ----------------------------------------------------------------

def fs(x: Optional[float]) -> str:
    """Seconds: "15 ms", "2.49 s"."""
    if x is None:
        return "–"
    return f"{x * 1e3:.0f} ms" if x < 1 else f"{x:.2f} s"


def fr(x: Optional[float], y: Optional[float]) -> str:
    """A ratio: "0.060 (1/17)" below one half, "1.10" above."""
    if x is None or not y:
        return "–"
    r = x / y
    return f"{r:.3f} (1/{1 / r:.0f})" if r < 0.5 else f"{r:.2f}"


def fg(n: Optional[float]) -> str:
    return "–" if n is None else f"{n / GiB:.2f}"


def machine_text(info: Dict[str, Any], shared: str = "",
                 commands: Optional[List[str]] = None) -> List[str]:
    """The "Measured ... with" block (``commands``, else the run's own) and the
    machine's paragraph of a section, ``shared`` added to it."""
    busy = sorted(set(info.get("busy_before", [])) | set(info.get("busy_after", [])))
    quiet = ("No other process used ≥5% CPU in the 1 s samples taken at the start and "
             "the end of the run (what ran in between is not known)." if not busy else
             "Other processes using CPU when the run started or ended (1 s samples; the "
             "machine was **not idle**, so disk and CPU figures carry that noise): "
             + "; ".join(f"`{b}`" for b in busy) + ".")
    return [f"Measured {info['date']} with:", "", "```sh",
            *(commands or [info["command"].strip()]), "```", "", f"Machine: {info['nproc']} CPUs (`nproc`; {info['cpu']}), "
            f"{info['mem_total'] / GiB:.1f} GiB memory, Python {info['python']}, torch "
            f"{info['torch']}, Linux {info['kernel']}; disk under /tmp: "
            f"{info['tmp_disk']}.{shared} Load average at start "
            f"{info['load_before'][0]:.2f}, at end {info['load_after'][0]:.2f}; the run "
            f"took {info['elapsed_s'] / 60:.1f} min. {quiet}", ""]


def write_doc(path: str, section: str, heading: str) -> None:
    """Replace (or append) the section that starts with ``heading``, keeping every
    other section."""
    text = ""
    if os.path.exists(path):
        with open(path) as f:
            text = f.read()
    if not text.strip():
        text = "# Benchmarks\n\nMeasured figures and the commands that produce them.\n"
    section = section.rstrip("\n") + "\n"
    start = text.find(heading)
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        nxt = text.find("\n## ", start + len(heading))
        end = len(text) if nxt < 0 else nxt + 1
        text = text[:start] + section + ("\n" + text[end:] if nxt >= 0 else "")
    with open(path, "w") as f:
        f.write(text)


def emit(text: str, doc: Optional[str], heading: str) -> None:
    """Print a section, and replace it in ``doc`` when one is named."""
    print(text)
    if doc:
        write_doc(doc, text, heading)
        print(f"written to {doc}", file=sys.stderr)


def run_bench(argv: Optional[List[str]], parse: Any, run_all: Any, report: Any,
              heading: str) -> Dict[str, Any]:
    """A bench's whole main: its arguments, its run, the JSON (``--json``) and its
    markdown section (printed, and written into ``--doc``)."""
    import json
    import warnings
    warnings.filterwarnings("ignore")
    args = parse(argv)
    data = run_all(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)
    emit(report(data), args.doc, heading)
    return data
