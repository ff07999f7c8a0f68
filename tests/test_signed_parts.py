"""Signed remote commits of node-local roots (snapd/remote/parts.py with a key): the
committer signs ``commit.snapd`` and the remote commit record, joins only parts whose
manifest an accepted key signed, and writes again, signed, a record no accepted key
signed; a restore of many ranks with the key refuses an unsigned, foreign or altered
remote commit and pulls the newest correctly signed one onto every root, bit for bit
(docs/operations.md, "Signed commits"). The remote is a file:// root."""

from __future__ import annotations

import logging
import os
import shutil
from types import SimpleNamespace

import pytest
import torch

from helpers import pull_on_rank_threads, wait_for
from snapd import format as fmt
from snapd.globalsnap import GlobalSnapshot
from snapd.options import Options
from snapd.plan import ObjectPlan, SnapshotPlan, TensorSource
from snapd.remote import parts
from snapd.remote import uploader as uploader_mod
from snapd.remote.layout import RemoteRoot, decode_record, encode_record
from snapd.signing import KEY_VARIABLE, Keys, key_id, load_keys
from snapd.store import RunStore, SnapshotId
from snapd.writer import write_snapshot

KEY = "k" * 16 + "0123456789abcdef"
OTHER = "o" * 16 + "fedcba9876543210"
LINEAGE = {"id": 0, "mode": "fresh", "parent": None}
OLD, NEW = SnapshotId(0, 10), SnapshotId(0, 20)


def weights(rank: int, step: int) -> torch.Tensor:
    return torch.arange(4, dtype=torch.float32).reshape(2, 2) + 100 * step + rank


@pytest.fixture
def keys(tmp_path, monkeypatch):
    """The key file the nodes' daemons and the restoring clients share."""
    monkeypatch.delenv(KEY_VARIABLE, raising=False)
    path = tmp_path / "keys"
    path.write_text(KEY + "\n")
    return str(path)


@pytest.fixture
def remote(tmp_path):
    return RemoteRoot(f"file://{tmp_path}/remote")


@pytest.fixture
def nodes(tmp_path):
    """Two node-local roots of one run, rank 0 on the first, rank 1 on the second."""
    return RunStore(str(tmp_path / "node-a"), "r"), RunStore(str(tmp_path / "node-b"), "r")


def write_part(store: RunStore, rank: int, sid: SnapshotId, key_file) -> None:
    """Rank ``rank``'s part of ``sid`` as its node's writer writes it (its manifest
    signed when ``key_file`` is given)."""
    t = weights(rank, sid.step)
    plan = SnapshotPlan("r", sid.step, LINEAGE,
                        [ObjectPlan("model", "T", b"\x80", [TensorSource(
                            ".w", "float32", [2, 2], memoryview(t.numpy()).cast("B"))])],
                        rng={"torch": bytes([rank])}, rank=rank, world_size=2,
                        session="s")
    assert not write_snapshot(store, plan, Options(signing_key_file=key_file)).complete


def up(remote, nodes, sid, key_file, committer=None) -> bool:
    """Both parts written and uploaded; the second node tries the commit with
    ``committer``'s keys (None: a committer without a key)."""
    for rank, store in enumerate(nodes):
        write_part(store, rank, sid, key_file)
        parts.upload_part(remote, store, sid.name, rank)
    return parts.settle_part(remote, nodes[1], sid.name, committer)


def stored(remote, sid):
    """The remote commit record's and ``commit.snapd``'s bytes."""
    return (remote.record_bytes("r", sid.name),
            remote.fs.cat_file(remote.file_path("r", sid.name, fmt.COMMIT_NAME)))


def test_with_a_key_the_committer_signs_the_record_and_commit_snapd(remote, nodes, keys):
    signer = load_keys(keys, {})
    assert up(remote, nodes, OLD, keys, signer)
    for data in stored(remote, OLD):
        kid, _, _ = fmt.signature_of(data)
        assert kid == key_id(KEY.encode())
        signer.check(data, path="remote", what="file")   # the HMAC holds
    # A second committer with the same key writes the same bytes.
    first = stored(remote, OLD)
    remote.fs.rm_file(remote.record_path("r", OLD.name))
    assert parts.try_remote_commit(remote, nodes[0], OLD.name, signer)
    assert stored(remote, OLD) == first


def test_each_nodes_uploader_with_the_key_commits_the_parts_signed(remote, nodes, keys,
                                                                   monkeypatch):
    """The daemons' side: each node's uploader sends its part, the one that completes
    the set signs the commit, and both nodes note it for their clients."""
    monkeypatch.setattr(uploader_mod, "PARTS_POLL_FIRST_S", 0.02)
    ups = []
    try:
        for rank, store in enumerate(nodes):
            write_part(store, rank, OLD, keys)
            ups.append(uploader_mod.Uploader(
                store.root, Options(remote=remote.url, signing_key_file=keys),
                remote=remote))
            ups[-1].start()
            ups[-1].committed("r", rank, OLD, 100, complete=False)
        assert wait_for(lambda: all(parts.remote_committed(s, OLD) for s in nodes), 20)
    finally:
        for up in ups:
            up.stop()
    for data in stored(remote, OLD):
        load_keys(keys, {}).check(data, path="remote", what="file")


@pytest.mark.parametrize("part_key", [None, OTHER], ids=["unsigned", "other key"])
def test_a_committer_with_a_key_never_joins_a_part_no_accepted_key_signed(
        remote, nodes, keys, tmp_path, caplog, part_key):
    signer = load_keys(keys, {})
    other = None
    if part_key is not None:
        other = tmp_path / "other-keys"
        other.write_text(part_key + "\n")
    write_part(nodes[0], 0, OLD, keys)
    write_part(nodes[1], 1, OLD, str(other) if other else None)
    for rank, store in enumerate(nodes):
        parts.upload_part(remote, store, OLD.name, rank)
    with caplog.at_level(logging.WARNING, logger="snapd.remote.parts"):
        assert not parts.try_remote_commit(remote, nodes[0], OLD.name, signer)
    assert remote.commits("r") == []
    assert fmt.COMMIT_NAME not in remote.uploaded_files("r", OLD.name)
    said = "is not signed" if part_key is None else "which this client does not accept"
    assert any("rank 1's part is not joined" in r.message and said in r.message and
               "rank-00001/manifest.snapd" in r.message for r in caplog.records)
    # The committer polls again and again: the same part is warned of once.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="snapd.remote.parts"):
        assert not parts.try_remote_commit(remote, nodes[0], OLD.name, signer)
    assert not [r for r in caplog.records if "is not joined" in r.message]
    # Its node, given the key, writes the part anew and sends it: the set commits.
    shutil.rmtree(os.path.join(nodes[1].parts_path(OLD), fmt.part_dir_name(1)))
    write_part(nodes[1], 1, OLD, keys)
    parts.upload_part(remote, nodes[1], OLD.name, 1)
    assert parts.try_remote_commit(remote, nodes[0], OLD.name, signer)


def test_an_unsigned_record_is_written_again_signed_by_a_committer_with_the_key(
        remote, nodes, keys):
    signer = load_keys(keys, {})
    assert up(remote, nodes, OLD, keys, committer=None)   # a node without the key
    assert fmt.signature_of(remote.record_bytes("r", OLD.name)) is None
    assert parts.settle_part(remote, nodes[0], OLD.name, signer)
    for data in stored(remote, OLD):
        signer.check(data, path="remote", what="file")
    assert parts.remote_committed(nodes[0], OLD)   # the marker, for its client


def forge(remote, how: str) -> None:
    """NEW's record rewritten (``uploaded_at`` moved), its signature kept."""
    assert how == "changed after signing"
    data = remote.record_bytes("r", NEW.name)
    record = decode_record(data, where="r", run="r", name=NEW.name)
    record["uploaded_at"] += 1.0
    body = bytearray(encode_record(record))
    body[12] = fmt.FLAG_SIGNED
    remote.fs.pipe_file(remote.record_path("r", NEW.name),
                        bytes(body) + data[-fmt.SIGNATURE_BYTES:])


def pull_on_two_roots(roots, url, client_keys):
    """fromremote.pull_from_remote on 2 rank threads, one per root; each rank's
    result (or error) and the FallbackWarnings."""
    return pull_on_rank_threads(
        [SimpleNamespace(options=Options(remote=url), run="r", rank=rank,
                         store=RunStore(roots[rank], "r"), _keys=client_keys)
         for rank in range(2)], join_s=30)


@pytest.mark.parametrize("forged", ["unsigned", "other key", "changed after signing"])
def test_a_client_with_the_key_refuses_a_forged_remote_commit_and_pulls_the_signed_one(
        remote, nodes, keys, tmp_path, forged):
    signer = load_keys(keys, {})
    assert up(remote, nodes, OLD, keys, signer)
    committer = {"unsigned": None, "other key": Keys(OTHER.encode(), [KEY.encode()]),
                 "changed after signing": signer}[forged]
    assert up(remote, nodes, NEW, keys, committer)
    if forged == "changed after signing":
        forge(remote, forged)
    roots = [str(tmp_path / "new-a"), str(tmp_path / "new-b")]
    out, warned = pull_on_two_roots(roots, remote.url, signer)
    assert out == [{OLD.name}] * 2, out
    said = {"unsigned": "is not signed", "other key": "which this client does not accept",
            "changed after signing": "does not match its bytes"}[forged]
    assert len(warned) == 2 and all(
        f"remote snapshot {NEW.name} is refused" in w and said in w and
        f"committed/{NEW.name}" in w for w in warned), warned
    for root in roots:
        store = RunStore(root, "r")
        assert store.committed() == [OLD] and store.read_pointer("LATEST") == OLD
        snap = GlobalSnapshot(store.snapshot_path(OLD))
        snap.verify()
        signer.check(open(f"{snap.path}/{fmt.COMMIT_NAME}", "rb").read(),
                     path=snap.path, what="commit record")
        for rank in range(2):   # bit for bit what each rank wrote at step 10
            (got,) = snap.part(rank).load_object("model")
            assert got.numpy().tobytes() == weights(rank, OLD.step).numpy().tobytes()
    # Without a key the same remote gives the newest commit, as before.
    fresh = [str(tmp_path / "keyless-a"), str(tmp_path / "keyless-b")]
    assert pull_on_two_roots(fresh, remote.url, None)[0] == [{NEW.name}] * 2
