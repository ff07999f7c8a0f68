"""Helpers the tests import: waiting on a condition, stopping the daemons a test
started, shared trained roots, plans for the writer, damaging files on purpose.
Fixtures live in conftest.py; these are plain functions, imported by name
(``from helpers import flip_byte``). The daemon-process harness of the integration
tests is tests/integration/harness.py. No test module imports another: what two of
them share lives here (tests/test_layering.py checks)."""

from __future__ import annotations

import errno
import math
import os
import shutil
import signal
import threading
import time
import warnings
from io import StringIO

import psutil
import torch
from rich.console import Console

from snapd import format as fmt
from snapd.logwriter import LogWriter
from snapd.names import ROOT_LOCK_NAME
from snapd.plan import ObjectPlan, SnapshotPlan, TensorSource
from snapd.store import RunStore
from snapd_client import Client
from snapd_client.anomaly import AnomalyWarning
from snapd_client.capture import Capture, CapturedObject, tensor_bytes
from snapd_client.state import flatten


def wait_for(cond, timeout: float = 60.0, interval: float = 0.01) -> bool:
    """Poll ``cond`` until it holds or ``timeout`` seconds pass: whether it held. For
    what has no event to wait on from outside (a file appearing, a thread's pass).
    Generous by default: on a loaded machine threads and processes start late."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(interval)
    return bool(cond())   # a last look: the deadline may have passed while asleep


def wait_until(cond, timeout: float, what: str, interval: float = 0.05) -> None:
    """``wait_for``, failing the test with ``what`` it waited for."""
    assert wait_for(cond, timeout, interval), f"timed out waiting for {what}"


def text_of(renderable, width: int = 100) -> str:
    """What rich prints of ``renderable`` on a plain terminal ``width`` columns wide."""
    out = StringIO()
    Console(file=out, width=width, force_terminal=False, color_system=None).print(renderable)
    return out.getvalue()

def exited(proc: psutil.Process) -> bool:
    """The process has exited: it is gone, or a zombie not reaped yet. A daemon the
    client started is an orphan, reaped by init, which on some machines does so only
    a second or two later; its exit is what a test waits for."""
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_exited(procs, timeout: float) -> list:
    """Wait until every process of ``procs`` has exited (``exited``), at most
    ``timeout`` seconds: those still running."""
    wait_for(lambda: all(map(exited, procs)), timeout)
    return [proc for proc in procs if not exited(proc)]


def stop_daemons_under(base: str, timeout: float = 20.0) -> None:
    """SIGTERM every daemon whose root lies under ``base`` (it drains, then exits);
    SIGKILL what is still alive after ``timeout``."""
    procs = []
    for dirpath, _dirs, files in os.walk(base):
        if ROOT_LOCK_NAME not in files:
            continue
        try:
            with open(os.path.join(dirpath, ROOT_LOCK_NAME)) as f:
                proc = psutil.Process(int(f.read().strip() or 0))
            if "snapd" in " ".join(proc.cmdline()):
                proc.send_signal(signal.SIGTERM)
                procs.append(proc)
        except (OSError, ValueError, psutil.Error):
            continue
    for proc in wait_exited(procs, timeout):
        proc.kill()


def trained_root(tmp_path_factory, name: str, train) -> str:
    """A root that ``train(root)`` filled once: the pristine copy a test module shares."""
    root = str(tmp_path_factory.mktemp(name) / "root")
    os.mkdir(root)
    train(root)
    return root


def private_copy(pristine: str, tmp_path) -> str:
    """A private copy of a pristine root, free to damage."""
    path = str(tmp_path / "root")
    shutil.copytree(pristine, path)
    return path


def outside_listing(root: str) -> list:
    """Everything in tmp_path outside the root: must not change under hostile input."""
    base = os.path.dirname(root)
    found = []
    for dirpath, _dirs, files in os.walk(base):
        if dirpath.startswith(root):
            continue
        found += [os.path.join(dirpath, f) for f in files]
    return sorted(found)


def flip_byte(path: str, offset: int, mask: int = 0xFF) -> None:
    """Damage one byte of a real file in place."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ mask]))


def read_manifest(snapshot_dir: str) -> dict:
    with open(os.path.join(snapshot_dir, fmt.MANIFEST_NAME), "rb") as f:
        return fmt.decode_manifest(f.read(), path=snapshot_dir)


def write_manifest_raw(snapshot_dir: str, manifest: dict) -> None:
    """Rewrite a manifest with a *valid* header and checksum: a hostile, not torn, file."""
    with open(os.path.join(snapshot_dir, fmt.MANIFEST_NAME), "wb") as f:
        f.write(fmt.encode_manifest(manifest))


def plan_for(state, step: int = 1, name: str = "model",
             frozen: bool = False) -> SnapshotPlan:
    """A one-object plan of ``state`` for ``write_snapshot``, as a client would make it;
    ``frozen``: every tensor marked frozen (nothing trains it)."""
    flat = flatten(state, name)
    tensors = [TensorSource(p, str(t.dtype)[6:], list(t.shape), tensor_bytes(t),
                            frozen=frozen)
               for p, t in zip(flat.paths, flat.tensors)]
    return SnapshotPlan("r", step, {"id": 0, "mode": "fresh", "parent": None},
                        [ObjectPlan(name, "x.Y", flat.skeleton, tensors)], {"python": b"s"})


def client_descriptor(states: dict, offsets: list, *, run: str = "r", step: int = 1,
                      lineage: dict | None = None, rng: dict | None = None,
                      metric: float | None = None, rank: int = 0, world_size: int = 1,
                      type_name: str = "T") -> dict:
    """The descriptor a client submits for ``states`` (object name -> state dict)
    staged at ``offsets`` (one per tensor leaf, objects in order), made by the
    client's own encoder (``Capture.descriptor``): what the daemon really receives."""
    objects = []
    for name, state in states.items():
        flat = flatten(state, name)
        objects.append(CapturedObject(name, type_name, flat.skeleton, None,
                                      tuple(flat.paths), tuple(flat.tensors),
                                      (False,) * len(flat.paths)))
    capture = Capture(run=run, step=step, rank=rank,
                      lineage=lineage or {"id": 0, "mode": "fresh", "parent": None},
                      data_version=None, metric=metric, rng=rng or {}, cursor=None,
                      objects=tuple(objects), world_size=world_size)
    return capture.descriptor(offsets)


class ThreadCollective:
    """A fake collective of threads, one per rank, meeting at a barrier: the bytes
    collectives of snapd_client/ranks.py, for restore's agreement in-process."""

    def __init__(self, world):
        self.world, self.barrier = world, threading.Barrier(world, timeout=20)
        self.slots = [None] * world

    def member(self, rank):
        threads = self

        class Member:
            def __init__(self):
                self.rank, self.world_size = rank, threads.world

            def broadcast_bytes(self, data, src=0):
                return self.allgather_bytes(data if rank == src else b"")[src]

            def allgather_bytes(self, data):
                threads.barrier.wait()
                threads.slots[rank] = bytes(data)
                threads.barrier.wait()
                out = list(threads.slots)
                threads.barrier.wait()
                return out
        return Member()


def pull_on_rank_threads(clients, join_s: float = 60):
    """snapd_client.fromremote.pull_from_remote on one thread per rank (``clients``:
    each rank's stand-in client, in rank order), met by a ThreadCollective; each
    rank's result (or the error it raised) and the FallbackWarnings said."""
    import warnings
    from snapd_client.fromremote import pull_from_remote
    from snapd_client.restore import FallbackWarning
    threads, out = ThreadCollective(len(clients)), [None] * len(clients)

    def one(rank):
        try:
            out[rank] = pull_from_remote(threads.member(rank), clients[rank])
        except Exception as e:   # the test looks at it
            out[rank] = e

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        workers = [threading.Thread(target=one, args=(r,)) for r in range(len(clients))]
        for w in workers:
            w.start()
        for w in workers:
            w.join(join_s)
    assert not any(w.is_alive() for w in workers)
    return out, [str(w.message) for w in seen if w.category is FallbackWarning]

def record_puts(remote, run: str) -> list:
    """Every write to ``remote`` (a RemoteRoot) from now on, in order, as a path
    relative to ``run``'s directory there."""
    order, base = [], remote.run_path(run) + "/"
    put, pipe = remote.fs.put_file, remote.fs.pipe_file
    remote.fs.put_file = lambda src, dst, **k: (order.append(dst[len(base):]),
                                                put(src, dst, **k))
    remote.fs.pipe_file = lambda dst, data, **k: (order.append(dst[len(base):]),
                                                  pipe(dst, data, **k))
    return order


def fill(directory: str) -> str:
    """Take every free byte of the filesystem holding ``directory`` (a small tmpfs,
    made for the test); returns the filler file to delete to free the space again."""
    filler = os.path.join(directory, "filler")
    with open(filler, "wb", buffering=0) as f:
        for chunk in (1 << 16, 4096, 1):
            try:
                while True:
                    f.write(b"\xff" * chunk)
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
    return filler


# --- a real run's state log, to damage -------------------------------------------------

def train_logged_run(root: str, steps: int = 30, every: int = 10) -> None:
    """A real Client's run with a log over several small segments (4 KiB each): a
    step record per step, a snapshot every ``every`` steps."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    client = Client(root, "r", daemon=False, log_segment_bytes=4096)
    client.track(model=model, optimizer=opt)
    for step in range(1, steps + 1):
        loss = model(torch.randn(3, 4)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        client.log(step, loss=loss.item())
        if step % every == 0:
            client.snapshot(step).wait()
    client.close()  # seals the segment: every byte is fsynced, behind a sync mark


def put_back_log(run_path: str, segments: dict, damaged: str, data: bytes) -> None:
    """Rank 0's log as the run left it (``segments``: name -> bytes), with segment
    ``damaged`` replaced by ``data``."""
    log_dir = os.path.join(run_path, "log", "rank-00000")
    shutil.rmtree(log_dir)
    os.mkdir(log_dir)
    for name, raw in segments.items():
        with open(os.path.join(log_dir, name), "wb") as f:
            f.write(data if name == damaged else raw)


# --- a long state log ---------------------------------------------------------------------

LOGGED_RNG = {"python": 1, "numpy": 2, "torch": 3, "gen:loader": 4}

# The long log's size. The reads it checks are bounded by 1 MiB (64 KiB for the last
# record); what proves them bounded is that reading any whole segment, let alone the
# log, breaks the bound several times over: three segments of 5 MiB (the last 4.3
# MiB), 14.3 MiB in all, do that as well as a million records over 122 MiB did, at a
# tenth of the cost of building them (a million records took 6 s or more).
LONG_LOG_STEPS = 120_000
LONG_LOG_SEGMENT_BYTES = 5 << 20


def logged_step(step: int) -> dict:
    """The step record of ``long_record_log``: 0.01 s of training per step."""
    return {"kind": "step", "step": step, "time": 1000.0 + step * 0.01,
            "cursor": [step // 500, step % 500], "rng": dict(LOGGED_RNG),
            "scalars": {"loss": 1.0 / (step + 1)}}


def logged_commit(step: int) -> dict:
    """The commit record of ``long_record_log`` (with a torch RNG state's size)."""
    return {"kind": "snapshot", "event": "committed", "step": step,
            "time": 1000.0 + step * 0.01, "name": f"{step:08d}",
            "rng": {"torch": b"\0" * 5056}, "cursor": {"epoch": 0}}


def long_record_log(root: str) -> RunStore:
    """Run "big" of ``root``: rank 0's log holds steps 1..LONG_LOG_STEPS and a commit
    every 1000 steps but the last, over three segments of LONG_LOG_SEGMENT_BYTES (the
    sizes, and why they prove a read bounded, are above). Written with one write per
    segment and no fsync: building it is the cost, not reading it."""
    store = RunStore(root, "big")
    store.ensure()

    def records():
        for step in range(1, LONG_LOG_STEPS + 1):
            yield logged_step(step)
            if step % 1000 == 0 and step < LONG_LOG_STEPS:
                yield logged_commit(step)

    with LogWriter(store.path, 0, segment_bytes=LONG_LOG_SEGMENT_BYTES,
                   flush_interval=None, fsync=lambda fd: None) as writer:
        assert writer.append_many(records()) == LONG_LOG_STEPS + LONG_LOG_STEPS // 1000 - 1
    return store


def small_model_and_opt():
    """A small MLP and its AdamW (moments to restore), the same on every call."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 3))
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


class OverlapJob:
    """A small model, its AdamW and a StepLR, tracked by an in-process client. Each
    step draws its batch and a dropout mask from the global RNG, so that a resume is
    exact only if every stream, the weights and the moments are (the restore with
    overlap tests, local and remote)."""

    def __init__(self, root: str, run: str = "r", **options) -> None:
        self.model, self.opt = small_model_and_opt()
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=2, gamma=0.5)
        self.client = Client(root, run, daemon=False, **options)
        self.client.track(model=self.model, optimizer=self.opt, scheduler=self.sched)

    def forward_backward(self) -> None:
        x, y = torch.randn(16, 8), torch.randn(16, 3)
        out = torch.nn.functional.dropout(self.model(x), 0.2)
        self.opt.zero_grad()
        ((out - y) ** 2).mean().backward()

    def step(self) -> None:
        self.forward_backward()
        self.opt.step()
        self.sched.step()

    def train(self, first: int, last: int, every: int = 0) -> None:
        for step in range(first, last + 1):
            self.step()
            if every and step % every == 0:
                self.client.snapshot(step)

    def outcome(self) -> dict:
        """Everything a later step reads, as it is now."""
        return {"weights": {k: v.clone() for k, v in self.model.state_dict().items()},
                "moments": {(i, k): v.clone()
                            for i, s in self.opt.state_dict()["state"].items()
                            for k, v in s.items()},
                "lr": [g["lr"] for g in self.opt.param_groups],
                "rng": torch.get_rng_state()}


def resumed_from_remote(root: str, url: str, overlap: bool,
                        first_step=OverlapJob.step) -> dict:
    """A new node's OverlapJob (``root`` empty) restored from the remote at ``url``
    (step 6 expected, pulled), its first step by ``first_step`` (a test may hold the
    background download there), two more, closed: its outcome."""
    torch.manual_seed(99)   # the restore must put every stream back
    job = OverlapJob(root, remote=url)
    assert job.client.restore(overlap=overlap) == 6
    assert job.client.restored_from == "remote"
    first_step(job)
    for _ in range(2):
        job.step()
    job.client.close()
    return job.outcome()


def hold_pull_finish(monkeypatch):
    """Hold the background half of a pull from the remote tier (remotearrival.FINISH)
    until released; (entered, release)."""
    from snapd_client import remotearrival
    entered, release = threading.Event(), threading.Event()

    def gated(pending, read, **how):
        entered.set()
        assert release.wait(60), "the test never released the download"
        return pending.finish(read, **how)

    monkeypatch.setattr(remotearrival, "FINISH", gated)
    return entered, release


def assert_same(a, b, where: str = "") -> None:
    """Two outcomes equal bit for bit (tensors with torch.equal), naming the first
    key that differs."""
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    else:
        assert a == b, where


def small_train_step(model, opt, step: int) -> float:
    """One update on step ``step``'s own batch (drawn from a generator seeded by it)."""
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 3, generator=g)
    loss = ((model(x) - y) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def assert_equal(a, b, where: str = "") -> None:
    """Two trees of tensors, dicts, lists and plain values equal, bit for bit; the
    path of the first difference in the message."""
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert set(a) == set(b), where
        for k in a:
            assert_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def file_remote_of(root: str, run: str, remote_dir: str) -> str:
    """Every committed snapshot of ``run`` under ``root`` uploaded to a file:// remote
    at ``remote_dir`` by the uploader's own ``upload_snapshot``, and rank 0's state log
    replicated beside them, as LogSync does; the remote's URL."""
    from snapd.remote.layout import RemoteRoot
    from snapd.remote.upload import upload_snapshot
    url = f"file://{remote_dir}"
    remote, store = RemoteRoot(url), RunStore(root, run)
    for sid in store.committed():
        upload_snapshot(remote, store, sid.name)
    log_dir = os.path.join(store.log_path, "rank-00000")
    for segment in os.listdir(log_dir):
        remote.fs.put_file(os.path.join(log_dir, segment),
                           f"{remote.log_path(run)}/rank-00000/{segment}")
    return url


def train_to_nan(root: str, run: str = "r", steps: int = 60, nan_at: int = 45):
    """A run trained in this process (daemon=False), snapshots every 20 steps with
    keep_last=1; from ``nan_at`` on the weights are NaN (as a bad batch leaves them),
    so every later loss is NaN. Returns the AnomalyWarnings log() gave."""
    model, opt = small_model_and_opt()
    client = Client(root, run, daemon=False, keep_last=1)
    client.track(model=model, optimizer=opt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(1, steps + 1):
            if step == nan_at:
                with torch.no_grad():
                    model[0].weight.fill_(math.nan)
            loss = small_train_step(model, opt, step)
            client.log(step, loss=loss)
            if step % 20 == 0:
                client.snapshot(step).wait()
    client.close()
    return [w for w in caught if issubclass(w.category, AnomalyWarning)]
