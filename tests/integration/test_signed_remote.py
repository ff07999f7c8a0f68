"""Signed remote commits on a real S3 API (moto's server on 127.0.0.1): a new node's
client with the signing key refuses a remote commit that is unsigned, signed with a
key it does not accept, or changed after signing, and restores the previous signed
one, pulled from S3, bit for bit (docs/operations.md, "Signed commits")."""

from __future__ import annotations

import warnings

import pytest

from snapd import format as fmt
from snapd.remote.layout import RemoteRoot, decode_record, encode_record
from snapd.remote.upload import upload_snapshot
from snapd.signing import KEY_VARIABLE, load_keys
from snapd.store import RunStore
from snapd_client import Client
from snapd_client.fromremote import RemoteWarning

from helpers import assert_equal, small_model_and_opt, small_train_step

RUN = "gpt"
KEY = "k" * 16 + "0123456789abcdef"
OTHER = "o" * 16 + "fedcba9876543210"


def node_a(root: str, key_path: str):
    """Steps 1-4, snapshots 2 and 4, signed; returns the weights at step 2."""
    model, opt = small_model_and_opt()
    client = Client(root, RUN, daemon=False, signing_key_file=key_path)
    client.track(model=model, optimizer=opt)
    at_two = None
    for step in range(1, 5):
        client.log(step, loss=small_train_step(model, opt, step))
        if step % 2 == 0:
            client.snapshot(step).wait()
        if step == 2:
            at_two = {k: v.clone() for k, v in model.state_dict().items()}
    client.close()
    return at_two


@pytest.mark.parametrize("forged", ["unsigned", "other key", "changed after signing"])
def test_a_forged_remote_commit_is_refused_and_the_previous_signed_one_restored(
        s3_env, tmp_path, monkeypatch, forged):
    monkeypatch.delenv(KEY_VARIABLE, raising=False)
    key_path = tmp_path / "keys"
    key_path.write_text(KEY + "\n")
    url = s3_env.url()
    remote = RemoteRoot(url)
    store = RunStore(str(tmp_path / "node-a"), RUN)
    at_two = node_a(store.root, str(key_path))
    keys = load_keys(str(key_path), {})
    upload_snapshot(remote, store, "00000002", signer=keys)   # the daemon's upload
    signer = {"unsigned": None, "other key": load_keys(None, {KEY_VARIABLE: OTHER}),
              "changed after signing": keys}[forged]
    upload_snapshot(remote, store, "00000004", signer=signer)
    if forged == "changed after signing":   # the payload rewritten, the signature kept
        data = remote.record_bytes(RUN, "00000004")
        where = remote.where(remote.record_path(RUN, "00000004"))
        record = decode_record(data, where=where, run=RUN, name="00000004")
        record["uploaded_at"] += 1.0
        body = encode_record(record)
        framed = bytearray(body)
        framed[12] = fmt.FLAG_SIGNED
        remote.fs.pipe_file(remote.record_path(RUN, "00000004"),
                            bytes(framed) + data[-fmt.SIGNATURE_BYTES:])

    model, opt = small_model_and_opt()
    client = Client(str(tmp_path / "node-b"), RUN, daemon=False, remote=url,
                    signing_key_file=str(key_path))
    client.track(model=model, optimizer=opt)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        step = client.restore()
    client.close()

    assert step == 2 and client.restored_from == "remote"
    assert_equal(model.state_dict(), at_two, "model")
    notes = [str(w.message) for w in seen if issubclass(w.category, RemoteWarning)]
    said = {"unsigned": "is not signed", "other key": "which this client does not accept",
            "changed after signing": "does not match its bytes"}[forged]
    assert any("00000004" in n and said in n and "committed/00000004" in n
               for n in notes), notes
    local = RunStore(str(tmp_path / "node-b"), RUN)
    assert [sid.name for sid in local.committed()] == ["00000002"]   # 4 never came down
