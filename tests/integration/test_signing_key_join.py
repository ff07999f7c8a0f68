"""A client joining a running daemon (`snapd serve`, a real process, over its socket)
must sign with the daemon's key: the hello carries the id of the client's signing key
("" for none, never the key) and a daemon with another key, or none, refuses it with
OptionMismatch naming both and what to do (docs/operations.md, "Signed commits").
With the same key the client is served and its snapshot is signed with that key."""

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


def snapshot_with(root: str, run: str, key, monkeypatch) -> None:
    """One snapshot by a client joining the daemon of ``root`` with ``key`` (None:
    none) in its environment; raises what its snapshot() raises."""
    with monkeypatch.context() as m:
        if key is None:
            m.delenv(KEY_VARIABLE, raising=False)
        else:
            m.setenv(KEY_VARIABLE, key)
        client = Client(root, run, daemon=True)
        try:
            client.track(model=torch.nn.Linear(4, 2))
            client.snapshot(1).wait(60)
        finally:
            client.close()


def started(harness, key):
    """A root and its daemon, started by hand with ``key`` (None: none)."""
    harness.env.pop(KEY_VARIABLE, None)
    root = harness.root()
    harness.start(root, extra_env={KEY_VARIABLE: key} if key else None)
    return root


def test_a_daemon_with_a_key_refuses_a_client_without_it_or_with_another(
        harness, monkeypatch):
    root = started(harness, KEY)
    for key, client in ((None, "this client has no key"),
                        (OTHER, f"this client's key has id {OTHER_ID}")):
        with pytest.raises(OptionMismatch) as refused:
            snapshot_with(root, harness.run, key, monkeypatch)
        assert str(refused.value) == refusal(root, f"signs with key id {KEY_ID}", client)
        assert refused.value.field == "signing_key" and refused.value.path == root
    assert not os.path.exists(os.path.join(root, harness.run, "snapshots", "00000001"))
    snapshot_with(root, harness.run, KEY, monkeypatch)   # the same key: served, signed
    with open(os.path.join(root, harness.run, "snapshots", "00000001",
                           fmt.MANIFEST_NAME), "rb") as f:
        kid, _, _ = fmt.signature_of(f.read())
    assert kid.hex() == KEY_ID


def test_a_daemon_without_a_key_refuses_a_client_with_one(harness, monkeypatch):
    root = started(harness, None)
    with pytest.raises(OptionMismatch) as refused:
        snapshot_with(root, harness.run, KEY, monkeypatch)
    assert str(refused.value) == refusal(root, "signs nothing (it has no key)",
                                         f"this client's key has id {KEY_ID}")
    snapshot_with(root, harness.run, None, monkeypatch)   # no key either: served
    with open(os.path.join(root, harness.run, "snapshots", "00000001",
                           fmt.MANIFEST_NAME), "rb") as f:
        assert fmt.signature_of(f.read()) is None
