"""Signed commits (snapd/signing.py): with a key, the writer signs each manifest; a
client with a key refuses, naming the file, a manifest that is unsigned, signed with
a key it does not accept, or changed after signing, and restores the newest correctly
signed snapshot bit for bit; a list of accepted keys lets a key be rotated; without a
key nothing changes; a hello is compared by signing key id. (The remote commit
record: tests/integration/test_signed_remote.py; node-local parts:
tests/test_signed_parts.py; a client joining a daemon:
tests/integration/test_signing_key_join.py.)"""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
from click.testing import CliRunner

from snapd import format as fmt
from snapd.cli import main
from snapd import protocol as p
from snapd.errors import (CorruptSnapshot, InvalidOption, OptionMismatch, ProtocolError,
                          UntrustedSnapshot)
from snapd.options import Options
from snapd.plan import ObjectPlan, SnapshotPlan, TensorSource
from snapd.reader import SnapshotReader
from snapd.signing import (KEY_VARIABLE, Keys, check_same_signer, key_id, load_keys,
                           signer_id)
from snapd.store import RunStore
from snapd.writer import write_snapshot
from snapd_client import Client
from snapd_client.capture import tensor_bytes
from snapd_client.distrestore import Parts, prepare
from snapd_client.restore import FallbackWarning
from snapd_client.rng import RngStreams
from snapd_client.state import flatten
from snapd_client.values import type_name

from helpers import (assert_equal, read_manifest, small_model_and_opt, small_train_step,
                     write_manifest_raw)

KEY = "k" * 16 + "0123456789abcdef"
OTHER = "o" * 16 + "fedcba9876543210"


def key_file(tmp_path, *keys: str) -> str:
    path = tmp_path / "keys"
    path.write_text("".join(k + "\n" for k in keys))
    return str(path)


def snapshot_dir(root: str, step: int) -> str:
    return os.path.join(root, "r", "snapshots", f"{step:08d}")


def take(root: str, steps, monkeypatch, key=None, start=None):
    """Train steps 1..max(steps) on the same model (``start``: carried on from it),
    snapshotting at ``steps``, each signed with ``key[step]`` (None: unsigned);
    returns the model, optimizer and the state at each snapshot, cloned."""
    model, opt = start or small_model_and_opt()
    states = {}
    done = 0
    for step in sorted(steps):
        with monkeypatch.context() as m:
            if key and key.get(step):
                m.setenv(KEY_VARIABLE, key[step])
            else:
                m.delenv(KEY_VARIABLE, raising=False)
            client = Client(root, "r", daemon=False)
            client.track(model=model, optimizer=opt)
            for s in range(done + 1, step + 1):
                small_train_step(model, opt, s)
            done = step
            client.snapshot(step).wait()
            client.close()
        states[step] = {k: v.clone() for k, v in model.state_dict().items()}
    return model, opt, states


def restore_with(root: str, **options):
    model, opt = small_model_and_opt()
    client = Client(root, "r", daemon=False, **options)
    client.track(model=model, optimizer=opt)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        step = client.restore()
    client.close()
    return step, model, [str(w.message) for w in seen
                         if issubclass(w.category, FallbackWarning)]


def test_a_signed_manifest_carries_the_key_id_and_an_hmac_of_its_bytes(tmp_path,
                                                                        monkeypatch):
    root = str(tmp_path / "root")
    take(root, [2], monkeypatch, {2: KEY})
    data = open(os.path.join(snapshot_dir(root, 2), fmt.MANIFEST_NAME), "rb").read()
    kid, mac, signed = fmt.signature_of(data)
    assert kid == key_id(KEY.encode()) and len(mac) == 32
    assert signed == data[:-fmt.SIGNATURE_BYTES]
    Keys(KEY.encode(), []).check(data, path="m", what="manifest")   # verifies
    read_manifest(snapshot_dir(root, 2))   # still a valid manifest to every reader
    shown = CliRunner().invoke(main, ["inspect", "r@2", "--root", root, "--json"])
    assert json.loads(shown.output)["signed_by"] == kid.hex()


@pytest.mark.parametrize("newest", ["unsigned", "other key", "changed after signing"])
def test_a_client_with_a_key_refuses_and_restores_the_newest_signed(tmp_path,
                                                                    monkeypatch, newest):
    root = str(tmp_path / "root")
    keys = {2: KEY, 4: None if newest == "unsigned" else
            OTHER if newest == "other key" else KEY}
    _, _, states = take(root, [2, 4], monkeypatch, keys)
    four = snapshot_dir(root, 4)
    if newest == "changed after signing":   # re-framed, the old signature kept
        data = open(os.path.join(four, fmt.MANIFEST_NAME), "rb").read()
        trailer = data[-fmt.SIGNATURE_BYTES:]
        manifest = read_manifest(four)
        manifest["metric"] = 0.5
        write_manifest_raw(four, manifest)
        framed = bytearray(open(os.path.join(four, fmt.MANIFEST_NAME), "rb").read())
        framed[12] = fmt.FLAG_SIGNED
        with open(os.path.join(four, fmt.MANIFEST_NAME), "wb") as f:
            f.write(bytes(framed) + trailer)
        SnapshotReader(four)   # whole by its own checksums
    step, model, refusals = restore_with(root, signing_key_file=key_file(tmp_path, KEY))
    assert step == 2
    assert_equal(model.state_dict(), states[2], "model")
    [refusal] = refusals
    said = {"unsigned": "is not signed", "other key":
            f"signed with key id {key_id(OTHER.encode()).hex()}",
            "changed after signing": "does not match its bytes"}[newest]
    assert os.path.join(four, fmt.MANIFEST_NAME) in refusal and said in refusal


def test_rotation_accepts_every_key_listed_and_signs_with_the_first(tmp_path,
                                                                    monkeypatch):
    root = str(tmp_path / "root")
    _, _, states = take(root, [2, 4], monkeypatch, {2: OTHER, 4: KEY})
    rotated = key_file(tmp_path, KEY, OTHER)
    assert load_keys(rotated, {}).signer == KEY.encode()
    step, model, refusals = restore_with(root, signing_key_file=rotated)
    assert step == 4 and not refusals
    assert_equal(model.state_dict(), states[4], "model")
    # The old key alone no longer accepts the new snapshot: the old one is restored.
    step, _, refusals = restore_with(root, signing_key_file=key_file(tmp_path, OTHER))
    assert step == 2 and len(refusals) == 1


def test_without_a_key_signed_and_unsigned_snapshots_restore_as_before(tmp_path,
                                                                      monkeypatch):
    root = str(tmp_path / "root")
    _, _, states = take(root, [2, 4], monkeypatch, {2: None, 4: KEY})
    monkeypatch.delenv(KEY_VARIABLE, raising=False)
    step, model, refusals = restore_with(root)
    assert step == 4 and not refusals
    assert_equal(model.state_dict(), states[4], "model")


def test_an_unusable_key_is_refused_at_once_naming_where_it_came_from(tmp_path,
                                                                     monkeypatch):
    monkeypatch.setenv(KEY_VARIABLE, "short")
    with pytest.raises(InvalidOption) as short:
        Client(str(tmp_path / "root"), "r", daemon=False)
    assert KEY_VARIABLE in str(short.value)
    monkeypatch.delenv(KEY_VARIABLE)
    with pytest.raises(InvalidOption) as missing:
        Client(str(tmp_path / "root"), "r", daemon=False,
               signing_key_file=str(tmp_path / "absent"))
    assert missing.value.field == "signing_key_file"
    assert issubclass(UntrustedSnapshot, CorruptSnapshot)   # refused like damage


def write_two_rank_snapshot(root: str, options: Options) -> str:
    """A snapshot of two ranks (each its part; the last commits it globally)."""
    store = RunStore(root, "r")
    store.ensure()
    for rank in range(2):
        flat = flatten({"weight": torch.full((2, 2), float(rank)), "bias": torch.zeros(2)},
                       "model")
        tensors = [TensorSource(p, "float32", list(t.shape), tensor_bytes(t))
                   for p, t in zip(flat.paths, flat.tensors)]
        plan = SnapshotPlan(run="r", step=5, lineage={"id": 0, "mode": "fresh",
                                                      "parent": None},
                            objects=[ObjectPlan("model", type_name(torch.nn.Linear(2, 2)),
                                                flat.skeleton, tensors)],
                            rng=RngStreams().capture(), rank=rank, world_size=2,
                            session="s")
        write_snapshot(store, plan, options)
    return store.snapshot_path(store.committed()[-1])


def test_many_ranks_the_commit_record_and_each_part_are_signed_and_checked(tmp_path):
    keys_path = key_file(tmp_path, KEY)
    keys = load_keys(keys_path, {})
    signed = write_two_rank_snapshot(str(tmp_path / "signed"),
                                     Options(signing_key_file=keys_path))
    got = prepare(Parts(signed), 1, 2, {"model": torch.nn.Linear(2, 2)}, RngStreams(),
                  data_version=None, stream=None, omit=set(), keys=keys)
    assert torch.equal(got.states["model"]["weight"], torch.ones(2, 2))
    unsigned = write_two_rank_snapshot(str(tmp_path / "unsigned"), Options())
    with pytest.raises(UntrustedSnapshot) as refused:
        prepare(Parts(unsigned), 1, 2, {"model": torch.nn.Linear(2, 2)}, RngStreams(),
                data_version=None, stream=None, omit=set(), keys=keys)
    assert refused.value.path == os.path.join(unsigned, fmt.COMMIT_NAME)


def test_verify_with_a_key_in_the_environment_checks_signatures(tmp_path, monkeypatch):
    root = str(tmp_path / "root")
    take(root, [2, 4], monkeypatch, {2: KEY, 4: None})
    monkeypatch.setenv(KEY_VARIABLE, KEY)
    for quick in ([], ["--sha256"]):
        result = CliRunner().invoke(main, ["verify", *quick, "--all", "--root", root,
                                           "--json"])
        assert result.exit_code == 1, result.output
        two, four = json.loads(result.output)["snapshots"]
        assert two["ok"] and two["signed_by"] == key_id(KEY.encode()).hex()
        assert not four["ok"] and four["field"] == "signature" and \
            four["file"] == os.path.join(snapshot_dir(root, 4), fmt.MANIFEST_NAME)
    monkeypatch.delenv(KEY_VARIABLE)
    result = CliRunner().invoke(main, ["verify", "--all", "--root", root])
    assert result.exit_code == 0, result.output   # without a key, nothing is required


def test_a_hello_is_compared_by_signing_key_id_never_by_the_key():
    """The daemon's side of a client joining it (the real process:
    tests/integration/test_signing_key_join.py): equal ids, or none sent (a tool, an
    older client), pass; another id or none against one is refused; anything but an
    id is a protocol error, the key itself included."""
    mine, other = signer_id(load_keys(None, {KEY_VARIABLE: KEY})), key_id(OTHER.encode())
    assert mine == key_id(KEY.encode()).hex() and signer_id(None) == ""
    for own, given in ((mine, mine), ("", ""), (mine, None), ("", None)):
        check_same_signer(own, given, "/data/ckpt")
    for own, given in ((mine, other.hex()), (mine, ""), ("", mine)):
        with pytest.raises(OptionMismatch) as refused:
            check_same_signer(own, given, "/data/ckpt")
        assert refused.value.field == "signing_key" and refused.value.path == "/data/ckpt"
        assert (own or "has no key") in str(refused.value)
        assert (given or "this client has no key") in str(refused.value)
    for wrong in (KEY, mine.upper(), mine[:-1], 5, b"x"):
        with pytest.raises(ProtocolError):
            check_same_signer(mine, wrong, "/data/ckpt")
    older = {"op": "hello", "protocol": p.PROTOCOL_VERSION, "pid": 1, "run": "r", "rank": 0}
    assert p.from_wire(older).signing_key_id is None
