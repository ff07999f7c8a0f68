"""The bytes on disk are what docs/format.md says, and round-trip bit for bit."""

from __future__ import annotations

import hashlib
import os
import struct

import msgpack
import pytest
import torch
import xxhash

from snapd.options import Options
from snapd.reader import SnapshotReader
from snapd.store import RunStore, SnapshotId
from snapd.writer import write_snapshot
from snapd.skeleton import unflatten

from helpers import plan_for


STATE = {
    "bf16": torch.randn(300, 70).to(torch.bfloat16),
    "zeros": torch.zeros(1 << 18),               # compressible
    "scalar": torch.tensor(7.5),
    "empty": torch.empty(0, 3),
    "noncontig": torch.arange(40.0).reshape(5, 8).t(),
    "bool": torch.rand(33) > 0.5,
    "int": torch.arange(-5, 5, dtype=torch.int64),
}


@pytest.mark.parametrize("compression", ["off", 3, "auto"])
def test_roundtrip_bit_for_bit_with_small_chunks(tmp_path, monkeypatch, compression):
    # 'auto' with a given zstd rate: the zeros compress, the rest stays raw, every run
    monkeypatch.setattr("snapd.compression.measured_zstd_rate", lambda: 1e9)
    store = RunStore(str(tmp_path), "r")
    result = write_snapshot(store, plan_for(STATE),
                            Options(compression=compression, chunk_bytes=4096))
    reader = SnapshotReader(result.path)
    back = unflatten(reader.objects["model"]["skeleton"], reader.load_object("model"),
                     source="t")
    for key, value in STATE.items():
        assert back[key].dtype == value.dtype and back[key].shape == value.shape
        assert torch.equal(back[key], value), key
    chunks = reader.objects["model"]["tensors"][0]["chunks"]
    assert len(chunks) == -(-300 * 70 * 2 // 4096)  # the bf16 tensor spans many chunks
    codecs = {c[3] for t in reader.objects["model"]["tensors"] for c in t["chunks"]}
    assert codecs == ({"raw"} if compression == "off" else {"raw", "zstd"})


def test_chunk_and_tensor_digests_of_a_tensor_of_many_chunks_and_pieces(tmp_path):
    """The writer hashes a raw chunk in pieces for its digest and the tensor's at
    once (writer.HASH_PIECE): each chunk's digest is its stored bytes', the tensor's
    its whole raw bytes'."""
    big = torch.randn(655_360 + 17)                  # 2.5 MiB + 68 bytes
    result = write_snapshot(RunStore(str(tmp_path), "r"), plan_for({"big": big}),
                            Options(chunk_bytes=1 << 20))
    payload = SnapshotReader(result.path).objects["model"]
    entry = payload["tensors"][0]
    raw = big.numpy().tobytes()
    assert len(entry["chunks"]) == 3 and entry["xxh3"] == xxhash.xxh3_64_intdigest(raw)
    data = open(os.path.join(result.path, "model.tensors"), "rb").read()
    at = 0
    for offset, stored, length, codec, digest in entry["chunks"]:
        assert codec == "raw" and data[offset:offset + stored] == raw[at:at + length]
        assert digest == xxhash.xxh3_64_intdigest(raw[at:at + length])
        at += length


def test_manifest_bytes_match_the_documented_offsets(tmp_path):
    result = write_snapshot(RunStore(str(tmp_path), "r"), plan_for(STATE), Options())
    data = open(os.path.join(result.path, "manifest.snapd"), "rb").read()
    assert data[0:8] == b"SNAPDMF\0"
    assert struct.unpack_from("<I", data, 8)[0] == 5
    assert struct.unpack_from("<I", data, 12)[0] == 0
    length = struct.unpack_from("<Q", data, 16)[0]
    assert length == len(data) - 32
    assert struct.unpack_from("<Q", data, 24)[0] == xxhash.xxh3_64_intdigest(data[32:])
    payload = msgpack.unpackb(data[32:], raw=False, strict_map_key=False)
    assert set(payload) == {"format", "run", "step", "rank", "world_size", "session", "created",
                            "data_version", "metric", "lineage", "rng", "cursor",
                            "objects", "files", "shared", "base"}
    assert payload["format"] == 5 and payload["shared"] == [] and payload["base"] is None
    tensors = open(os.path.join(result.path, "model.tensors"), "rb").read()
    assert tensors[:8] == b"SNAPDTN\0" and struct.unpack_from("<I", tensors, 8)[0] == 5
    assert tensors[16:32] == bytes(16)
    # v2 file digest: the header, then each chunk's digest (u64 LE), in file order.
    chain = tensors[:32] + b"".join(struct.pack("<Q", c[4])
                                    for t in payload["objects"]["model"]["tensors"]
                                    for c in t["chunks"])
    entry = payload["files"]["model.tensors"]
    # v5: and the SHA-256 of every byte of the file, as sha256sum computes it.
    assert entry == {"size": len(tensors), "xxh3": xxhash.xxh3_64_intdigest(chain),
                     "sha256": hashlib.sha256(tensors).digest()}
    for t, (key, value) in zip(payload["objects"]["model"]["tensors"], STATE.items()):
        raw = value.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() \
            if value.numel() else b""
        assert t["xxh3"] == xxhash.xxh3_64_intdigest(raw), key  # the raw bytes' digest
    first = payload["objects"]["model"]["tensors"][0]["chunks"][0]
    assert first[0] == 4096 and first[3] == "raw"
    raw = tensors[4096:4096 + first[1]]
    assert xxhash.xxh3_64_intdigest(raw) == first[4]
    assert len(first) == 5   # a tensor that trains: no identity
    assert raw == STATE["bf16"].reshape(-1).view(torch.uint8).numpy().tobytes()[:first[1]]
    # Every chunk on a 4096-byte boundary, the first after the previous one ends; the
    # gaps zero; the file ends on a boundary.
    covered, end = bytearray(len(tensors)), 32
    for t in payload["objects"]["model"]["tensors"]:
        for offset, stored, *_ in t["chunks"]:
            assert offset == -(-end // 4096) * 4096
            covered[offset:offset + stored] = b"\1" * stored
            end = offset + stored
    assert len(tensors) == -(-end // 4096) * 4096
    assert all(b == 0 for b, c in zip(tensors[32:], covered[32:]) if not c)


def test_version_1_snapshots_still_read_bit_for_bit(tmp_path):
    """A v1 tensor file has its chunks back to back; rewrite a v2 snapshot that way."""
    result = write_snapshot(RunStore(str(tmp_path), "r"), plan_for(STATE),
                            Options(chunk_bytes=4096))
    path = os.path.join(result.path, "model.tensors")
    v2 = open(path, "rb").read()
    manifest_path = os.path.join(result.path, "manifest.snapd")
    manifest = msgpack.unpackb(open(manifest_path, "rb").read()[32:], raw=False,
                               strict_map_key=False)
    v1 = bytearray(struct.pack("<8sII16x", b"SNAPDTN\0", 1, 0))
    for t in manifest["objects"]["model"]["tensors"]:
        for chunk in t["chunks"]:
            data = v2[chunk[0]:chunk[0] + chunk[1]]
            chunk[0] = len(v1)
            del chunk[5:]   # v1 chunks carry no identity
            v1 += data
    open(path, "wb").write(v1)
    manifest["format"] = 1
    for key in ("shared", "base"):
        del manifest[key]
    manifest["files"]["model.tensors"] = {"size": len(v1),
                                          "xxh3": xxhash.xxh3_64_intdigest(bytes(v1))}
    payload = msgpack.packb(manifest, use_bin_type=True)
    open(manifest_path, "wb").write(struct.pack("<8sIIQQ", b"SNAPDMF\0", 1, 0,
                                                len(payload),
                                                xxhash.xxh3_64_intdigest(payload)) + payload)
    assert len(v1) < len(v2)
    reader = SnapshotReader(result.path)
    back = unflatten(reader.objects["model"]["skeleton"], reader.load_object("model"),
                     source="t")
    for key, value in STATE.items():
        assert torch.equal(back[key], value), key


def test_commit_leaves_no_tmp_and_moves_latest(tmp_path):
    store = RunStore(str(tmp_path), "r")
    write_snapshot(store, plan_for(STATE, step=3), Options())
    write_snapshot(store, plan_for(STATE, step=4), Options())
    assert store.tmp_dirs() == []
    assert store.committed() == [SnapshotId(0, 3), SnapshotId(0, 4)]
    assert open(os.path.join(store.path, "LATEST")).read() == "00000004\n"


def test_failed_write_publishes_nothing(tmp_path):
    store = RunStore(str(tmp_path), "r")
    write_snapshot(store, plan_for(STATE, step=1), Options())
    bad = plan_for(STATE, step=2)
    # Plans are frozen; this one is broken on purpose: the writer fails midway.
    object.__setattr__(bad.objects[0].tensors[0], "data", None)
    with pytest.raises(TypeError):
        write_snapshot(store, bad, Options())
    assert store.committed() == [SnapshotId(0, 1)]
    assert store.read_pointer("LATEST") == SnapshotId(0, 1)
    assert len(store.tmp_dirs()) == 1  # left for collection, never read
    assert store.collect_tmp() == 1 and store.tmp_dirs() == []


def test_snapshot_names_order_by_lineage_then_step():
    names = ["00000100", "00000020.L1", "00000900", "00000005.L2", ".tmp-00000999-ab", "x"]
    ids = sorted(i for i in map(SnapshotId.parse, names) if i)
    assert [i.name for i in ids] == ["00000100", "00000900", "00000020.L1", "00000005.L2"]


def test_the_torch_free_size_table_matches_torch():
    """ITEMSIZES lets the daemon check plans without torch; it must agree with it."""
    from snapd import format as fmt
    assert set(fmt.ITEMSIZES) == set(fmt.DTYPES)
    for name, dtype in fmt.DTYPES.items():
        assert fmt.ITEMSIZES[name] == dtype.itemsize, name
        assert fmt.dtype_name(dtype) == name



def test_a_frozen_tensors_chunks_carry_their_identity(tmp_path):
    """v4: each chunk of a tensor marked frozen carries the xxh3-128 of its raw bytes."""
    result = write_snapshot(RunStore(str(tmp_path), "r"), plan_for(STATE, frozen=True),
                            Options(chunk_bytes=4096))
    reader = SnapshotReader(result.path)
    data = open(os.path.join(result.path, "model.tensors"), "rb").read()
    for t in reader.objects["model"]["tensors"]:
        assert t["frozen"] is True
        for c in t["chunks"]:
            assert c[5] == xxhash.xxh3_128_digest(data[c[0]:c[0] + c[1]])   # raw codec
