"""The daemon-process harness of the integration tests: a real ``snapd serve`` and the
peers, arenas and states a test talks to it with, or a root and run a real Client
starts its own daemon under; and how each is stopped and cleaned up. The fixtures
that hand these out are in conftest.py next to this file.
"""

from __future__ import annotations

import glob
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from typing import Any, Dict, List, Optional

import psutil
import torch

from helpers import client_descriptor, wait_exited, wait_for, wait_until

from snapd import peer as peer_mod
from snapd import protocol as p
from snapd.names import ROOT_LOCK_NAME
from snapd.reader import SnapshotReader
from snapd.store import SnapshotId
from snapd_client import Client
from snapd_client.state import flatten

UID = os.getuid()
ALIGN = 64


# --- a root and run for a real Client (it starts the daemon itself) ------------------

class Env:
    """A root, a run name, and everything to clean up after the test."""

    def __init__(self) -> None:
        self.root = tempfile.mkdtemp(prefix="sd-", dir="/tmp")
        self.run = f"r{secrets.token_hex(3)}"
        self.pids = {os.getpid()}   # processes whose arenas this test may leave
        self.daemons = set()

    def lock_pid(self):
        try:
            with open(os.path.join(self.root, ROOT_LOCK_NAME)) as f:
                text = f.read().strip()
        except FileNotFoundError:
            return None
        return int(text) if text else None

    def daemon(self, client: Client) -> psutil.Process:
        pid = client.daemon_pid
        assert pid is not None and pid != os.getpid()
        self.daemons.add(pid)
        return psutil.Process(pid)

    def stop_daemons(self) -> None:
        pids = set(self.daemons) | ({self.lock_pid()} - {None})
        for pid in pids:
            stop(pid)

    def segments(self):
        mine = [p for pid in self.pids for p in glob.glob(f"/dev/shm/snapd-{UID}-{pid}-*")]
        return mine + glob.glob(f"/dev/shm/snapd-hot-{UID}-{self.run}-*")

    def cleanup(self) -> None:
        self.stop_daemons()
        for path in self.segments():
            os.unlink(path)
        shutil.rmtree(self.root, ignore_errors=True)


def stop(pid: int, grace: float = 10.0) -> None:
    """Stop a daemon: wake it (it may be SIGSTOPped), ask, then insist; wait for its
    exit (``exited``: init reaps an orphan late on some machines)."""
    try:
        proc = psutil.Process(pid)
        proc.send_signal(signal.SIGCONT)
        proc.terminate()
    except psutil.NoSuchProcess:
        return
    if wait_exited([proc], grace):
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            return
        wait_exited([proc], grace)


def close_as_if_killed(client: Client) -> None:
    """Hang up without ``bye``, as a killed trainer's connection drops: the daemon
    keeps the run's hot copy for a restart (a clean close releases it)."""
    client._handoff.conn._sock.shutdown(socket.SHUT_RDWR)
    client.close()


# --- a daemon started by the test, and its own peers and arenas ---------------------

class DaemonProc:
    """``python -m snapd serve --root R`` in its own session, its output in ``log``."""

    def __init__(self, root: str, log: str, env: Dict[str, str]) -> None:
        self.root, self.log = root, log
        with open(log, "ab") as f:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "snapd", "serve", "--root", root],
                stdout=f, stderr=f, env=env, start_new_session=True)

    def wait_ready(self, timeout: float = 30.0) -> "DaemonProc":
        assert wait_for(self._answers, timeout, 0.05), f"daemon not ready: {self.text()}"
        return self

    def _answers(self) -> bool:
        """The daemon answers a ping (no event says when it starts to: poll)."""
        if self.proc.poll() is not None:
            raise AssertionError(f"daemon exited {self.proc.returncode}: {self.text()}")
        try:
            with Peer(self.root) as peer:
                assert peer.request(p.Ping())["op"] == "pong"
            return True
        except (OSError, EOFError):
            return False

    def text(self) -> str:
        with open(self.log, "r", errors="replace") as f:
            return f.read()

    def kill(self, sig=signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)


class Peer(peer_mod.Peer):
    """snapd's protocol client, connected and past hello (a request needs one first,
    ping too); ``hello=True`` also asserts that the daemon welcomed it."""

    def __init__(self, root: str, hello: bool = False, run: str = "", rank: int = 0):
        sock = peer_mod.connect(root, timeout=60)
        if sock is None:   # an OSError, which wait_ready() waits out
            raise ConnectionRefusedError(f"no daemon listens under {root}")
        super().__init__(sock)
        reply = self.request(peer_mod.hello(run, rank))
        if hello:
            assert reply["op"] == "welcome", reply


class Arena:
    """A staging segment the test owns, like a client's."""

    def __init__(self, size: int, slots: int = 1) -> None:
        # The prefix of a client's arenas: the daemon maps only the peer's own.
        self.name = f"snapd-{os.getuid()}-{os.getpid()}-{secrets.token_hex(4)}"
        self.path = f"/dev/shm/{self.name}"
        # Kept open, like a client's mapping: the daemon unlinks the name at attach.
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(self.fd, size)
        self.size, self.slots = size, slots
        self.slot_bytes = size // slots

    def stage(self, slot: int, run: str, step: int, states: Dict[str, Dict],
              metric: Optional[float] = None) -> Dict[str, Any]:
        """Copy the states' tensors into a slot; return the descriptor the client
        would submit for it (its own encoder: helpers.client_descriptor)."""
        offsets, pos = [], 0
        with open(self.fd, "r+b", closefd=False) as f:
            for name, state in states.items():
                for t in flatten(state, name).tensors:
                    raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                    f.seek(slot * self.slot_bytes + pos)
                    f.write(raw)
                    offsets.append(pos)
                    pos += -(-len(raw) // ALIGN) * ALIGN
        assert pos <= self.slot_bytes
        return client_descriptor(states, offsets, run=run, step=step,
                                 rng={"python": b"\x01\x02"}, metric=metric,
                                 type_name="test.State")

    def attach(self, peer: Peer, run: str, hot: bool = False) -> None:
        reply = peer.request(p.Attach(run, 0, self.name, self.size, self.slots, hot))
        assert reply["op"] == "ok", reply

    def remove(self) -> None:
        os.close(self.fd)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class Harness:
    """root() -> a short root; start(root) -> a ready daemon; arena(size) -> a segment;
    ``run``: this test's run name. cleanup() kills the daemons and removes the rest."""

    def __init__(self, env: Dict[str, str], logs: str) -> None:
        self.env, self.logs = env, logs
        self.run = f"it{secrets.token_hex(3)}"
        self.daemons: List[DaemonProc] = []
        self.arenas: List[Arena] = []
        self.roots: List[str] = []

    def root(self) -> str:   # short: Unix socket paths are limited to 107 bytes
        self.roots.append(tempfile.mkdtemp(prefix="snapd-it-", dir="/tmp"))
        return self.roots[-1]

    def start(self, root, ready=True, extra_env=None) -> DaemonProc:
        d = DaemonProc(root, os.path.join(self.logs, f"daemon-{len(self.daemons)}.log"),
                       {**self.env, **(extra_env or {})})
        self.daemons.append(d)
        return d.wait_ready() if ready else d

    def arena(self, size, slots=1) -> Arena:
        self.arenas.append(Arena(size, slots))
        return self.arenas[-1]

    def cleanup(self) -> None:
        for d in self.daemons:
            d.kill()
            d.proc.wait(10)
        for a in self.arenas:
            a.remove()
        for path in glob.glob(f"/dev/shm/snapd-hot-{UID}-{self.run}-*"):
            os.unlink(path)
        for r in self.roots:
            shutil.rmtree(r, ignore_errors=True)


# --- what the tests stage and check ----------------------------------------------------

def sample_states(seed: int = 0, scale: int = 1) -> Dict[str, Dict]:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(64 * scale, 33, generator=g),
                      "b": torch.randn(7, generator=g).to(torch.bfloat16),
                      "n": torch.tensor(seed)},
            "optimizer": {"state": {0: {"m": torch.randn(5, 5, generator=g).double()}},
                          "mask": torch.rand(9, generator=g) > 0.5, "lr": 0.1}}


def big_states(megabytes: int, seed: int = 1) -> Dict[str, Dict]:
    g = torch.Generator().manual_seed(seed)
    n = megabytes * (1 << 20) // 4 // 4
    return {"model": {f"t{i}": torch.randn(n, generator=g) for i in range(4)}}


def submit(peer, arena, run, step, states, slot=0, metric=None, **options):
    desc = arena.stage(slot, run, step, states, metric)
    reply = peer.request(p.Submit(run, 0, step, slot, desc, options))
    assert reply["op"] == "accepted" and reply["step"] == step, reply
    return desc


def assert_snapshot_equals(path: str, states: Dict[str, Dict]) -> None:
    reader = SnapshotReader(path)
    for name, state in states.items():
        flat = flatten(state, name)
        loaded = reader.load_object(name)
        assert len(loaded) == len(flat.tensors)
        for want, got in zip(flat.tensors, loaded):
            assert got.dtype == want.dtype and got.shape == want.shape
            assert torch.equal(got.reshape(-1).view(torch.uint8),
                               want.contiguous().reshape(-1).view(torch.uint8))


def snapshot_and_replicate(client: Client, env: Env, remote: Any, net: torch.nn.Module,
                           steps) -> None:
    """For each step: change ``net``, snapshot, and wait until the remote tier holds
    that step's commit (the daemon replicates in the background)."""
    for step in steps:
        with torch.no_grad():
            net.weight.add_(1.0)
        client.snapshot(step).wait(60)
        env.daemon(client)
        wait_until(lambda: SnapshotId(0, step) in remote.commits(env.run), 60,
                   f"the remote commit of step {step}")
