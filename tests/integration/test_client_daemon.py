"""The Client and the real daemon process, over its real socket.

The client starts the daemon itself (as a trainer would). Each test has a short
root under /tmp (Unix socket paths are limited to 107 bytes) and its own run name;
teardown stops every daemon that served the root (SIGCONT, SIGTERM, then SIGKILL)
and removes the /dev/shm segments this test's processes and runs left behind.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import textwrap
import time

import psutil
import pytest
import torch
import xxhash

from snapd.errors import CorruptSnapshot, DaemonUnavailable, SnapshotFailed
from snapd.reader import SnapshotReader
from snapd.store import RunStore
from snapd.liveview import DaemonProbe
from snapd_client import Client

from harness import UID, Env, close_as_if_killed, stop
from helpers import flip_byte, read_manifest, wait_until, write_manifest_raw

pytestmark = pytest.mark.integration


class Blob:
    """A tracked object whose tensor size the test chooses (growth, slow writes)."""

    def __init__(self, nbytes: int = 1 << 20, fill: float = 1.0) -> None:
        self.x = torch.full((nbytes // 4,), fill)

    def state_dict(self):
        return {"x": self.x}

    def load_state_dict(self, state):
        self.x = state["x"].clone()


def make_model(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.BatchNorm1d(64),
                                torch.nn.ReLU(), torch.nn.Linear(64, 8))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def train_step(model, opt) -> None:
    model(torch.randn(16, 32)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def state_of(model, opt) -> dict:
    """Every tensor of the model and the optimizer, cloned, by a stable key."""
    out = {f"model{k}": v.clone() for k, v in model.state_dict().items()}
    for i, s in opt.state_dict()["state"].items():
        out.update({f"opt{i}.{k}": v.clone() for k, v in s.items()
                    if isinstance(v, torch.Tensor)})
    return out


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def restored_state(env: Env, build=make_model, close=Client.close, **kw):
    """Restore into freshly built objects (other seed); their state, and the client."""
    model, opt = build(seed=123)
    client = Client(env.root, env.run, **kw)
    client.track(model=model, optimizer=opt)
    step = client.restore()
    close(client)
    return step, state_of(model, opt), client


# --- tests --------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["wait", "overlap"])
def test_snapshots_restore_bit_for_bit_in_both_modes(env, mode):
    model, opt = make_model()
    client = Client(env.root, env.run, mode=mode)
    client.track(model=model, optimizer=opt)
    expected = {}
    for step in range(1, 7):
        train_step(model, opt)   # in overlap mode this step waits for the last copy
        if step % 2 == 0:
            expected[step] = state_of(model, opt)
            client.snapshot(step)
    train_step(model, opt)       # after the last snapshot: must not leak into it
    env.daemon(client)
    client.close()
    step, state, fresh = restored_state(env)
    assert step == 6
    assert_same(state, expected[6])
    store = RunStore(env.root, env.run)
    reader = SnapshotReader(store.snapshot_path(store.committed()[0]))
    saved = {e["path"][1:]: t for e, t in zip(reader.objects["model"]["tensors"],
                                              reader.load_object("model"))}
    assert reader.step == 2 and saved
    assert all(torch.equal(t, expected[2][f"model{k}"]) for k, t in saved.items())


def test_overlap_snapshot_is_not_changed_by_the_next_optimizer_step(env):
    """The step pre-hook makes the next update wait for the copy of the weights."""
    def build(seed=0):
        torch.manual_seed(seed)
        model = torch.nn.Linear(2048, 4096)
        return model, torch.optim.AdamW(model.parameters(), lr=0.1)

    model, opt = build()
    x = torch.randn(32, 2048)
    client = Client(env.root, env.run, mode="overlap")
    client.track(model=model, optimizer=opt)
    for _ in range(2):
        model(x).square().mean().backward()
        opt.step()
    model(x).square().mean().backward()
    expected = state_of(model, opt)
    client.snapshot(2)
    opt.step()          # at once, while 100 MB of weights and moments are copying
    env.daemon(client)
    client.close()
    step, state, _ = restored_state(env, build)
    assert step == 2
    assert_same(state, expected)


class Counting(torch.nn.Module):
    """A module whose forward changes a large buffer (as BatchNorm's stats, larger)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(4))
        self.register_buffer("seen", torch.zeros(16 << 20))

    def forward(self, x):
        self.seen.add_(1)
        return self.w * x


def test_overlap_snapshot_is_not_changed_by_the_next_forward(env):
    """Buffers are copied before snapshot() returns: forward changes them at once."""
    def build(seed=0):
        model = Counting()
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    model, opt = build()
    client = Client(env.root, env.run, mode="overlap")
    client.track(model=model, optimizer=opt)
    expected = state_of(model, opt)
    client.snapshot(1)
    model(torch.ones(4))
    env.daemon(client)
    client.close()
    step, state, _ = restored_state(env, build)
    assert step == 1
    assert_same(state, expected)


def test_client_starts_a_daemon_that_outlives_it(env):
    assert env.lock_pid() is None and not os.path.exists(f"{env.root}/.snapd.sock")
    model, opt = make_model()
    client = Client(env.root, env.run)
    client.track(model=model, optimizer=opt)
    client.snapshot(1).wait()
    daemon = env.daemon(client)
    assert daemon.pid == env.lock_pid()
    client.close()
    probe = DaemonProbe(env.root)

    def client_gone():  # the daemon has handled the goodbye and still answers
        status = probe.status()
        assert status is not None, "the daemon stopped answering when its client left"
        return all(c["run"] != env.run for c in status["clients"])

    try:
        wait_until(client_gone, 60, "the daemon to see its client leave")
    finally:
        probe.close()
    assert daemon.is_running() and daemon.status() != psutil.STATUS_ZOMBIE
    assert not glob.glob(f"/dev/shm/snapd-{UID}-{os.getpid()}-*"), "arena not unlinked"
    again = Client(env.root, env.run)
    again.track(model=model, optimizer=opt)
    again.snapshot(2).wait()
    assert again.daemon_pid == daemon.pid, "a second client reuses the running daemon"
    again.close()


def test_the_daemon_hashes_off_the_cpu_its_trainer_runs_on(harness, tmp_path):
    """A daemon started on every CPU; a trainer on one: each submit names that CPU,
    the daemon keeps its hashing off it while the client is connected, and forgets
    it when the client leaves."""
    cpus = os.sched_getaffinity(0)
    if len(cpus) < 2:
        pytest.skip("one CPU: none to keep free (CI runs on two)")
    root = str(tmp_path / "root")
    harness.start(root)
    trainer = max(cpus)
    probe = DaemonProbe(root)
    os.sched_setaffinity(0, {trainer})   # this thread is the trainer
    try:
        model, opt = make_model()
        client = Client(root, "cpus")
        client.track(model=model, optimizer=opt)
        client.snapshot(1).wait()
        assert probe.status()["cpus_kept_free"] == [trainer]
        client.close()
        wait_until(lambda: probe.status()["cpus_kept_free"] == [], 60,
                   "the daemon to forget the CPU of a client that left")
    finally:
        os.sched_setaffinity(0, cpus)
        probe.close()


TRAINER = textwrap.dedent("""
    import json, os, signal, sys, torch, xxhash
    from snapd_client import Client
    root, run, out = sys.argv[1:4]
    torch.manual_seed(0)
    model = torch.nn.Linear(2048, 4096)   # 32 MiB: the write takes a while
    client = Client(root, run)
    client.track(model=model)
    digest = xxhash.xxh3_64(model.weight.detach().numpy().tobytes()).hexdigest()
    with open(out, "w") as f:
        json.dump({"digest": digest}, f)
    client.snapshot(1)                    # returns once staged and submitted
    os.kill(os.getpid(), signal.SIGKILL)  # the trainer dies at once
""")


def test_trainer_killed_after_snapshot_returns_still_commits(env, tmp_path, warm):
    script, out = tmp_path / "trainer.py", tmp_path / "out.json"
    script.write_text(TRAINER)
    # a child of a warm parent (warm.py): a trainer without an import of torch of its own
    proc = warm["first"].run(str(script), [env.root, env.run, str(out)], timeout=120)
    env.pids.add(proc.pid)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    store = RunStore(env.root, env.run)
    wait_until(lambda: store.read_pointer("LATEST") is not None, 60, "LATEST")
    reader = SnapshotReader(store.snapshot_path(store.read_pointer("LATEST")))
    reader.verify()
    weight = reader.load_object("model")[0]
    assert xxhash.xxh3_64(weight.numpy().tobytes()).hexdigest() == \
        json.loads(out.read_text())["digest"]
    # The daemon unlinks a dead client's arena once its snapshot is written.
    wait_until(lambda: not glob.glob(f"/dev/shm/snapd-{UID}-{proc.pid}-*"), 30,
               "the dead trainer's arena to be unlinked")


def test_daemon_killed_mid_write_then_next_snapshot_restarts_it(env):
    blob = Blob(1 << 20, fill=1.0)
    client = Client(env.root, env.run, timeout=30)
    client.track(blob=blob)
    client.snapshot(1).wait()
    first = env.daemon(client)
    blob.x = torch.full(((300 << 20) // 4,), 2.0)   # 300 MB: the arena grows
    handle = client.snapshot(2)
    first.kill()                                  # kill -9 mid-write
    with pytest.raises(DaemonUnavailable):
        handle.wait()
    store = RunStore(env.root, env.run)
    assert store.read_pointer("LATEST").name == "00000001"
    assert [s.name for s in store.committed()] == ["00000001"]
    SnapshotReader(store.snapshot_path(store.committed()[0])).verify()

    blob.x = torch.full(((1 << 20) // 4,), 3.0)
    with pytest.warns(RuntimeWarning, match=r"step\(s\) 2 did not commit"):
        handle = client.snapshot(3)
    handle.wait()
    second = env.daemon(client)
    assert second.pid != first.pid
    client.close()
    assert store.read_pointer("LATEST").name == "00000003"
    restored = Blob()
    again = Client(env.root, env.run)
    again.track(blob=restored)
    assert again.restore() == 3 and torch.equal(restored.x, blob.x)
    again.close()


def test_on_busy_skip_skips_while_a_write_is_in_flight(env):
    blob = Blob(300 << 20)
    client = Client(env.root, env.run, on_busy="skip")
    client.track(blob=blob)
    first = client.snapshot(1)
    skipped = client.snapshot(2)      # the 300 MB write of step 1 is still going
    assert skipped.skipped and skipped.done() and skipped.wait() is None
    assert client.skipped == [2]
    first.wait()
    env.daemon(client)
    later = client.snapshot(3)
    assert not later.skipped
    later.wait()
    client.close()
    assert [s.step for s in RunStore(env.root, env.run).committed()] == [1, 3]


def test_on_busy_wait_stalls_and_reports_the_stall(env):
    blob = Blob(200 << 20)
    client = Client(env.root, env.run)      # on_busy="wait", one slot
    client.track(blob=blob)
    client.snapshot(1)
    second = client.snapshot(2)
    assert second.stall_seconds > 0
    env.daemon(client)
    client.close()
    assert [s.step for s in RunStore(env.root, env.run).committed()] == [1, 2]


def test_hundred_snapshots_keep_trainer_and_daemon_memory_flat(env):
    model, opt = make_model()
    client = Client(env.root, env.run, keep_last=3, slots=2)
    client.track(model=model, optimizer=opt)
    me = psutil.Process()
    rss = {}
    for step in range(1, 101):
        train_step(model, opt)
        handle = client.snapshot(step)
        if step in (10, 100):
            handle.wait()
            daemon = env.daemon(client)
            rss[step] = (me.memory_info().rss, daemon.memory_info().rss)
    client.close()
    grew = [(rss[100][i] - rss[10][i]) >> 20 for i in (0, 1)]
    assert grew[0] < 50, f"trainer RSS grew {grew[0]} MB over 90 snapshots"
    assert grew[1] < 50, f"daemon RSS grew {grew[1]} MB over 90 snapshots"
    assert len(RunStore(env.root, env.run).committed()) == 3
    assert len(glob.glob(f"/dev/shm/snapd-{UID}-{os.getpid()}-*")) == 0


def test_the_daemon_moves_bytes_without_loading_torch(env):
    """Writing, compressing, retention and hot copies need no torch in the daemon:
    its start is ~0.3 s instead of ~1.6 s, and its memory ~40 MiB instead of ~220."""
    model, opt = make_model()
    client = Client(env.root, env.run, keep_last=1, compression=3)
    client.track(model=model, optimizer=opt)
    for step in (1, 2, 3):
        train_step(model, opt)
        client.snapshot(step).wait()
    daemon = env.daemon(client)
    close_as_if_killed(client)
    again = Client(env.root, env.run)
    again.track(model=model, optimizer=opt)
    assert again.restore() == 3 and again.restored_from == "hot"
    again.close()
    assert [s.step for s in RunStore(env.root, env.run).committed()] == [3]
    with open(f"/proc/{daemon.pid}/maps") as f:
        loaded = {line.split()[-1] for line in f if "torch" in line}
    assert not loaded, f"the daemon mapped {sorted(loaded)[:3]}"


def test_hung_daemon_fails_the_snapshot_within_the_timeout(env):
    model, opt = make_model()
    client = Client(env.root, env.run, timeout=2.0)
    client.track(model=model, optimizer=opt)
    client.snapshot(1).wait()
    daemon = env.daemon(client)
    daemon.suspend()                       # SIGSTOP: alive, silent
    try:
        start = time.monotonic()
        handle = client.snapshot(2)
        with pytest.raises(DaemonUnavailable, match="not answered"):
            handle.wait()
        # within the 2 s timeout, not the 120 s default; the slack is for a loaded machine
        assert time.monotonic() - start < 2.0 + 30.0
    finally:
        daemon.resume()
    # The daemon answers again: the next snapshot warns, reconnects and commits.
    with pytest.warns(RuntimeWarning, match="was lost"):
        handle = client.snapshot(3)
    handle.wait()
    assert client.daemon_pid == daemon.pid
    client.close()


def hot_segments(env) -> list:
    """The daemon's hot copies of the run: the arena holding the committed slot (and
    a trainer's arena attached as hot, named so from its attach until the daemon
    lets go of it: changing that one does no harm)."""
    found = glob.glob(f"/dev/shm/snapd-hot-{UID}-{env.run}-*")
    assert found, "the daemon holds no hot copy"
    return found


def _tensor_ptrs(model, opt) -> dict:
    ptrs = {f"model{k}": v.data_ptr() for k, v in model.state_dict().items()}
    for i, s in opt.state_dict()["state"].items():
        ptrs.update({f"opt{i}.{k}": v.data_ptr() for k, v in s.items()
                     if isinstance(v, torch.Tensor)})
    return ptrs


def test_hot_restore_when_the_daemon_holds_the_latest_snapshot(env):
    model, opt = make_model()
    client = Client(env.root, env.run)
    client.track(model=model, optimizer=opt)
    train_step(model, opt)
    client.snapshot(1).wait()
    expected = state_of(model, opt)
    daemon = env.daemon(client)
    close_as_if_killed(client)
    # Read-only: a trainer that restores lets the daemon drop the copy (hot_release),
    # and this one is needed below.
    step, state, fresh = restored_state(env, close=close_as_if_killed, read_only=True)
    assert (step, fresh.restored_from) == (1, "hot")
    assert_same(state, expected)

    # A hot copy that disagrees with the manifest is never used.
    for hot in hot_segments(env):
        flip_byte(hot, 64)
    step, state, fresh = restored_state(env)
    assert (step, fresh.restored_from) == (1, "disk")
    assert_same(state, expected)

    # No daemon: restore reads the files, and does not wait for the daemon that
    # track()'s warm-up starts for the snapshots to come (it holds no copy).
    stop(daemon.pid)
    step, state, fresh = restored_state(env)
    assert (step, fresh.restored_from) == (1, "disk")
    assert_same(state, expected)
    assert fresh.daemon_pid != daemon.pid   # the teardown stops it (the root's lock)


def committed_step_one(env) -> dict:
    """One trained step snapshotted through the daemon, which then holds it; the
    state it holds."""
    model, opt = make_model()
    client = Client(env.root, env.run)
    client.track(model=model, optimizer=opt)
    train_step(model, opt)
    client.snapshot(1).wait()
    close_as_if_killed(client)
    return state_of(model, opt)


def test_hot_restore_writes_into_the_live_tensors_and_keeps_no_alias(env):
    expected = committed_step_one(env)

    # A trainer that already holds state of the same shapes (other values): the held
    # bytes go straight into its tensors, which keep their memory.
    live_model, live_opt = make_model(seed=123)
    for _ in range(2):
        train_step(live_model, live_opt)
    before = _tensor_ptrs(live_model, live_opt)
    # Opened now: the restore lets the daemon drop it (hot_release), which unlinks it.
    held = [open(hot, "r+b") for hot in hot_segments(env)]
    fresh = Client(env.root, env.run)
    fresh.track(model=live_model, optimizer=live_opt)
    assert fresh.restore() == 1 and fresh.restored_from == "hot"
    close_as_if_killed(fresh)
    assert_same(state_of(live_model, live_opt), expected)
    assert _tensor_ptrs(live_model, live_opt) == before

    # Nothing restored still points into the daemon's segment: scribbling over it
    # changes nothing in the trainer.
    for f in held:
        with f:
            f.write(b"\xAA" * os.fstat(f.fileno()).st_size)
    assert_same(state_of(live_model, live_opt), expected)


def test_hot_restore_leaves_an_omitted_object_alone(env):
    expected = committed_step_one(env)

    live_model, live_opt = make_model(seed=123)
    train_step(live_model, live_opt)
    own = state_of(live_model, live_opt)
    fresh = Client(env.root, env.run)
    fresh.track(model=live_model, optimizer=live_opt)
    fresh.restore(_omit=["optimizer"])
    fresh.close()
    after = state_of(live_model, live_opt)
    assert_same({k: v for k, v in after.items() if k.startswith("model")},
                {k: v for k, v in expected.items() if k.startswith("model")})
    assert_same({k: v for k, v in after.items() if k.startswith("opt")},
                {k: v for k, v in own.items() if k.startswith("opt")})


def test_a_damaged_hot_copy_and_damaged_files_leave_the_objects_untouched(env):
    committed_step_one(env)
    for hot in hot_segments(env):
        flip_byte(hot, 64)   # inside the model's first tensor
    snapshot = RunStore(env.root, env.run).snapshot_path(
        RunStore(env.root, env.run).committed()[-1])
    model = SnapshotReader(snapshot).objects["model"]
    offset, stored = model["tensors"][-1]["chunks"][-1][:2]
    flip_byte(os.path.join(snapshot, model["file"]), offset + stored - 1)

    live_model, live_opt = make_model(seed=123)
    before = state_of(live_model, live_opt)
    fresh = Client(env.root, env.run)
    fresh.track(model=live_model, optimizer=live_opt)
    with pytest.warns(UserWarning, match="refused"), \
            pytest.raises(CorruptSnapshot, match=r"untouched \(the daemon's copy read "
                                                 r"into \['model', 'optimizer'\] was put "
                                                 r"back\)"):
        fresh.restore()
    fresh.close()
    assert_same(state_of(live_model, live_opt), before)  # all or nothing


def test_a_failed_write_is_raised_once_from_its_cause(env):
    model, opt = make_model()
    client = Client(env.root, env.run)
    client.track(model=model, optimizer=opt)
    first = client.snapshot(1).wait()
    env.daemon(client)
    manifest = read_manifest(first.path)  # step 1 now belongs to another history
    write_manifest_raw(first.path, {**manifest, "lineage": {"id": 0, "mode": "other",
                                                           "parent": None}})
    again = client.snapshot(1)            # the daemon refuses to overwrite step 1
    with pytest.raises(SnapshotFailed, match="already exists") as failure:
        again.wait()
    assert isinstance(failure.value.__cause__, FileExistsError)
    assert again.wait() is None           # reported once
    client.snapshot(2).wait()             # the slot was freed by the failed event
    client.close()                        # nothing left to raise


def test_in_process_path_needs_no_daemon(env):
    model, opt = make_model()
    client = Client(env.root, env.run, daemon=False)
    client.track(model=model, optimizer=opt)
    client.snapshot(1).wait()
    client.close()
    assert env.lock_pid() is None and not os.path.exists(f"{env.root}/.snapd.sock")
    step, state, _ = restored_state(env, daemon=False)
    assert step == 1
    assert_same(state, state_of(model, opt))
