"""Every option a Client is given reaches whatever acts on it, with a real daemon: a
daemon the client starts runs with the client's daemon-wide values (its status says
so), so ``remote_keep_last=0`` keeps every remote commit; a client that joins a
daemon running with other values is refused with what to do; tools never are."""

from __future__ import annotations

import pytest
import torch

from harness import Peer, snapshot_and_replicate
from helpers import wait_until
from option_values import non_default_values, value_for
from snapd import protocol as p
from snapd.errors import OptionMismatch
from snapd.options import CLIENT_OPTIONS, DAEMON_OPTIONS
from snapd.remote.layout import RemoteRoot
from snapd.store import SnapshotId
from snapd_client import Client

pytestmark = pytest.mark.integration


def model():
    torch.manual_seed(0)
    return torch.nn.Linear(16, 8)


def daemon_status(root):
    with Peer(root) as peer:   # a tool's hello: run "", no options
        return peer.request(p.Status())["status"]


def snapshot_once(client, step=1):
    client.track(model=model())
    client.snapshot(step).wait(60)


def test_a_started_daemon_runs_with_every_daemon_wide_value_of_the_client(env, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("k" * 32 + "\n")
    values = non_default_values(remote=f"file://{tmp_path}/remote", key_file=str(keys))
    given = {name: value_for(name, values) for name in DAEMON_OPTIONS}
    client = Client(env.root, env.run, daemon=True, **given)
    try:
        snapshot_once(client)
        env.daemon(client)
        applied = daemon_status(env.root)["options"]
        for name in DAEMON_OPTIONS:
            assert applied[name] == given[name], name
    finally:
        client.close()


def test_the_client_holds_every_client_option(env):
    values = non_default_values()
    given = {name: value_for(name, values) for name in CLIENT_OPTIONS}
    client = Client(env.root, env.run, **given)   # daemon=False: nothing is started
    try:
        for name in CLIENT_OPTIONS:
            assert getattr(client.options, name) == given[name], name
        assert client.daemon is False and client.daemon_pid is None
    finally:
        client.close()


def test_remote_keep_last_zero_keeps_every_remote_commit(env, s3_env):
    url = s3_env.url()
    remote = RemoteRoot(url)
    net = model()
    client = Client(env.root, env.run, daemon=True, remote=url, remote_keep_last=0)
    client.track(model=net)
    try:
        snapshot_and_replicate(client, env, remote, net, (1, 2, 3, 4))
    finally:
        client.close()
    # A clean stop lets the uploader finish the retention that follows commit 4.
    env.stop_daemons()
    assert remote.commits(env.run) == [SnapshotId(0, s) for s in (1, 2, 3, 4)]


def refusal(root, differ):
    return (f"the daemon serving {root} runs with other daemon-wide options than this "
            f"client was given: {differ}. Give the client the daemon's values, or stop "
            f"the daemon (`snapd stop {root}`) and start the trainer again: it starts a "
            "daemon with the client's options")


def test_a_client_joining_a_daemon_started_by_hand_with_other_values_is_refused(harness):
    root = harness.root()
    harness.start(root)   # `snapd serve --root`: remote_keep_last 2, the default
    client = Client(root, harness.run, daemon=True, remote_keep_last=0)
    try:
        with pytest.raises(OptionMismatch) as refused:
            snapshot_once(client)
    finally:
        client.close()
    assert str(refused.value) == refusal(root, "remote_keep_last=2 (this client: 0)")
    assert refused.value.field == "remote_keep_last"
    assert daemon_status(root)["options"]["remote_keep_last"] == 2   # a tool is served
    same = Client(root, harness.run + "b", daemon=True, remote_keep_last=2)
    try:
        snapshot_once(same)   # the same value: welcome
    finally:
        same.close()


def test_a_client_joining_a_daemon_another_client_started_is_refused(env):
    first = Client(env.root, env.run, daemon=True, writer_threads=3)
    try:
        snapshot_once(first)
        env.daemon(first)
        second = Client(env.root, env.run + "b", daemon=True, writer_threads=2)
        try:
            with pytest.raises(OptionMismatch) as refused:
                snapshot_once(second)
        finally:
            second.close()
        assert str(refused.value) == refusal(env.root, "writer_threads=3 (this client: 2)")
        wait_until(lambda: [c["run"] for c in daemon_status(env.root)["clients"]
                            if c["run"]] == [env.run], 30,
                   "the refused client gone, the first one served")
    finally:
        first.close()
