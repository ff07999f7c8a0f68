"""A real daemon's errors reach the trainer as the daemon raised them: the same class,
with the file (path) and the field at fault (docs/protocol.md, "Errors")."""

from __future__ import annotations

import errno
import os
import shutil
import signal

import psutil
import pytest
import torch

from snapd import peer
from snapd import protocol as p
from snapd.errors import DaemonUnavailable, ProtocolMismatch, SnapdError, SnapshotFailed
from snapd_client import Client
from snapd_client.connection import DaemonConnection

pytestmark = pytest.mark.integration


def stop(pid: int) -> None:
    """SIGTERM the daemon this test started (it drains, then exits)."""
    try:
        proc = psutil.Process(pid)
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    except psutil.NoSuchProcess:
        pass


def test_a_refused_request_arrives_with_its_field(tmp_path):
    conn = DaemonConnection(str(tmp_path), "run", 0, timeout=60)   # starts the daemon
    try:
        with pytest.raises(SnapdError) as info:
            conn.request(p.Submit("run", 0, -1, 0, {}))
        assert info.value.field == "step" and "non-negative" in str(info.value)
        with pytest.raises(SnapdError) as info:
            conn.request(p.HotGet("../elsewhere", 0))
        assert info.value.field == "run"
    finally:
        conn.close()
        stop(conn.daemon_pid)


def test_a_failed_write_arrives_with_its_class_errno_and_file(tmp_path):
    root = str(tmp_path)
    client = Client(root, "run", daemon=True)
    client.track(model=torch.nn.Linear(4, 4))
    client.snapshot(1).wait()   # the daemon runs
    # Now it cannot create the snapshots folder: a file holds its name.
    snapshots = client.store.snapshots_path
    shutil.rmtree(snapshots)
    with open(snapshots, "w") as f:
        f.write("in the way")
    try:
        handle = client.snapshot(2)
        with pytest.raises(SnapshotFailed) as info:
            handle.wait()
        cause = info.value.__cause__
        assert type(cause) is FileExistsError, repr(cause)
        assert (cause.errno, cause.filename) == (errno.EEXIST, snapshots)
    finally:
        pid = client.daemon_pid
        os.remove(snapshots)
        client.close()
        if pid is not None:
            stop(pid)


def test_a_client_of_another_protocol_catches_protocol_mismatch(tmp_path):
    conn = DaemonConnection(str(tmp_path), "run", 0, timeout=60)   # starts the daemon
    try:
        served = conn.request(p.Ping())   # it serves
        raw = peer.connect(str(tmp_path), timeout=60)
        with raw:
            p.send(raw, p.Hello(p.PROTOCOL_VERSION + 1, os.getpid()), id=1)
            with pytest.raises(ProtocolMismatch) as info:
                raise p.from_wire(p.recv(raw)).exception()
            with pytest.raises((EOFError, ConnectionResetError)):   # then closed
                p.recv(raw)
        assert isinstance(info.value, DaemonUnavailable)
        assert info.value.field == "protocol" and "same snapd version" in str(info.value)
        with peer.Peer.open(str(tmp_path), timeout=60) as tool:
            assert info.value.path == tool.welcome["root"]
        assert conn.request(p.Ping()).pid == served.pid   # its clients go on
    finally:
        conn.close()
        stop(conn.daemon_pid)
