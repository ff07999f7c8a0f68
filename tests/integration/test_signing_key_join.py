"""A client joining a running daemon (a real process, over its socket: one a keyed
client started, one started by hand without a key) must sign with the daemon's key:
the hello carries the id of the client's signing key ("" for none, never the key) and
a daemon with another key, or none, refuses it with OptionMismatch naming both and
what to do (docs/operations.md, "Signed commits"). With the same key the client is
served and its snapshot is signed with that key."""

from __future__ import annotations

import os

import pytest
import torch

from snapd import format as fmt
from snapd.errors import OptionMismatch
from snapd.signing import KEY_VARIABLE, key_id
from snapd_client import Client

pytestmark = pytest.mark.integration

KEY = "k" * 16 + "0123456789abcdef"
OTHER = "o" * 16 + "fedcba9876543210"
KEY_ID, OTHER_ID = key_id(KEY.encode()).hex(), key_id(OTHER.encode()).hex()


def refusal(root: str, daemon: str, client: str) -> str:
    return (f"the daemon serving {root} {daemon}, but {client}: one daemon signs every "
            "snapshot of its root with the key it was started with (key ids are "
            "compared; a key is never sent). Give the client the daemon's key "
            f"(SNAPD_SIGNING_KEY or signing_key_file), or stop the daemon (`snapd stop "
            f"{root}`) and start the trainer again: it starts a daemon with the "
            "client's key")


def snapshot_with(root: str, run: str, key, monkeypatch, env=None) -> None:
    """One snapshot by a client of the daemon of ``root`` (joined, or started when
    none runs) with ``key`` (None: none) in its environment; raises what its
    snapshot() raises. ``env``: told of the daemon the client started, to stop it."""
    with monkeypatch.context() as m:
        if key is None:
            m.delenv(KEY_VARIABLE, raising=False)
        else:
            m.setenv(KEY_VARIABLE, key)
        client = Client(root, run, daemon=True)
        try:
            client.track(model=torch.nn.Linear(4, 2))
            client.snapshot(1).wait(60)
            if env is not None:
                env.daemon(client)
        finally:
            client.close()


def signer_of(root: str, run: str):
    """The key id (hex) that signed the run's snapshot of step 1, None: unsigned."""
    with open(os.path.join(root, run, "snapshots", "00000001", fmt.MANIFEST_NAME),
              "rb") as f:
        found = fmt.signature_of(f.read())
    return None if found is None else found[0].hex()


def test_a_daemon_a_client_started_with_a_key_refuses_a_client_without_it_or_another(
        env, monkeypatch):
    snapshot_with(env.root, env.run, KEY, monkeypatch, env)   # starts it, with the key
    assert signer_of(env.root, env.run) == KEY_ID
    for key, client in ((None, "this client has no key"),
                        (OTHER, f"this client's key has id {OTHER_ID}")):
        with pytest.raises(OptionMismatch) as refused:
            snapshot_with(env.root, env.run + "b", key, monkeypatch)
        assert str(refused.value) == refusal(env.root, f"signs with key id {KEY_ID}",
                                             client)
        assert refused.value.field == "signing_key" and refused.value.path == env.root
    assert not os.path.exists(os.path.join(env.root, env.run + "b", "snapshots",
                                           "00000001"))
    snapshot_with(env.root, env.run + "b", KEY, monkeypatch)   # the same key: served
    assert signer_of(env.root, env.run + "b") == KEY_ID


def test_a_daemon_started_by_hand_without_a_key_refuses_a_client_with_one(
        harness, monkeypatch):
    harness.env.pop(KEY_VARIABLE, None)
    root = harness.root()
    harness.start(root)   # `snapd serve --root`, no key in its environment
    with pytest.raises(OptionMismatch) as refused:
        snapshot_with(root, harness.run, KEY, monkeypatch)
    assert str(refused.value) == refusal(root, "signs nothing (it has no key)",
                                         f"this client's key has id {KEY_ID}")
    snapshot_with(root, harness.run, None, monkeypatch)   # no key either: served
    assert signer_of(root, harness.run) is None


def test_a_relative_key_file_reaches_the_daemon_the_client_starts(env, tmp_path,
                                                                  monkeypatch):
    """The daemon a client starts runs in "/": the file is named to it absolutely."""
    (tmp_path / "keys").write_text(KEY + "\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(KEY_VARIABLE, raising=False)
    client = Client(env.root, env.run, daemon=True, signing_key_file="keys")
    try:
        client.track(model=torch.nn.Linear(4, 2))
        client.snapshot(1).wait(60)
        env.daemon(client)
    finally:
        client.close()
    assert client.options.signing_key_file == str(tmp_path / "keys")
    assert signer_of(env.root, env.run) == KEY_ID
