"""Fuzzing the manifest and skeleton decoders with mutations of a real manifest.

Seeded, a few thousand inputs, bounded in time: bit flips, each field's type
swapped, deep nesting, huge declared sizes, msgpack extension types. Each input goes
through decode_manifest, the skeleton decoder and the reader's open (as a real file
in a real snapshot directory). Every outcome must be a value or CorruptSnapshot:
no crash, no hang, no exception from outside the snapd error tree.
"""

from __future__ import annotations

import copy
import os
import random
import shutil
import time

import msgpack
import pytest
import torch

from snapd import format as fmt
from snapd.errors import CorruptSnapshot
from snapd.reader import SnapshotReader
from snapd_client import Client
from snapd.skeleton import unflatten

SEED = 11
ROUNDS = 4000
BUDGET_S = 60.0   # ~3 s here; generous for a loaded machine: it catches a blowup

SWAPS = [None, True, -1, 1 << 70, 3.5, float("nan"), "x" * 3, b"\0" * 5, [], [1, [2]],
         {}, {"a": {"b": 1}}, msgpack.ExtType(2, b"\x91\x01"), msgpack.ExtType(99, b""),
         msgpack.Timestamp(1, 2), 4 << 40, [4 << 40, 4 << 40]]


def deep(depth: int, ext: bool) -> bytes:
    """{"s": [[[...1...]]]} or the same of tuples, built as bytes (no recursion)."""
    if not ext:
        return b"\x81\xa1s" + b"\x91" * depth + b"\x01"
    inner = b"\x01"
    for _ in range(depth):
        inner = msgpack.packb(msgpack.ExtType(2, b"\x91" + inner))
    return b"\x81\xa1s" + inner


@pytest.fixture(scope="module")
def snapshot_dir(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("fuzz") / "root")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    client = Client(root, "f", daemon=False)
    client.track(model=model, optimizer=opt)
    client.snapshot(1).wait()
    client.close()
    return os.path.join(root, "f", "snapshots", "00000001")


def leaves(tree, path=()):
    """(path, value) of every map value and list item of a decoded manifest."""
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) \
        if isinstance(tree, list) else ()
    for key, value in items:
        yield path + (key,), value
        yield from leaves(value, path + (key,))


def set_at(tree, path, value):
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value


def mutate(rng: random.Random, manifest: dict, encoded: bytes) -> bytes:
    kind = rng.randrange(5)
    if kind == 0:  # bit flips in the payload, re-signed so that the checksum holds
        payload = bytearray(encoded[fmt.HEADER_BYTES:])
        for _ in range(rng.randint(1, 8)):
            payload[rng.randrange(len(payload))] ^= 1 << rng.randrange(8)
        return resign(bytes(payload))
    m = copy.deepcopy(manifest)
    paths = [p for p, _ in leaves(m)]
    path = rng.choice(paths)
    if kind == 1:    # a field's type swapped
        set_at(m, path, rng.choice(SWAPS))
    elif kind == 2:  # a skeleton nested deep, as lists or as tuples
        obj = rng.choice(list(m["objects"]))
        m["objects"][obj]["skeleton"] = deep(rng.choice([31, 33, 200, 5000]),
                                             rng.random() < 0.5)
    elif kind == 3:  # a huge declared size
        sizes = [p for p in paths if p[-1] in ("size", "nbytes", 1, 2) or
                 (len(p) > 1 and p[-2] == "shape")]
        set_at(m, rng.choice(sizes or paths), rng.choice([1 << 40, (1 << 64) - 1, -5]))
    else:            # skeleton bytes damaged inside
        obj = rng.choice(list(m["objects"]))
        sk = bytearray(m["objects"][obj]["skeleton"])
        sk[rng.randrange(len(sk))] = rng.randrange(256)
        m["objects"][obj]["skeleton"] = bytes(sk)
    try:
        return fmt.encode_manifest(m)
    except (TypeError, ValueError, OverflowError):
        return resign(msgpack.packb(m, use_bin_type=True, default=str))


def resign(payload: bytes) -> bytes:
    header = fmt._MANIFEST_HEADER.pack(fmt.MANIFEST_MAGIC, fmt.FORMAT_VERSION, 0,
                                       len(payload), fmt.checksum(payload))
    return header + payload


def exercise(directory: str, data: bytes) -> None:
    """Everything a reader does before touching a tensor; CorruptSnapshot allowed."""
    path = os.path.join(directory, fmt.MANIFEST_NAME)
    try:
        manifest = fmt.decode_manifest(data, path=path)
        for entry in manifest["objects"].values():
            unflatten(entry["skeleton"], None, source=path)
    except CorruptSnapshot:
        pass
    with open(path, "wb") as f:
        f.write(data)
    try:
        SnapshotReader(directory)
    except CorruptSnapshot:
        pass


def test_mutated_manifests_only_ever_raise_corrupt_snapshot(snapshot_dir, tmp_path):
    directory = str(tmp_path / "00000001")
    shutil.copytree(snapshot_dir, directory)
    with open(os.path.join(snapshot_dir, fmt.MANIFEST_NAME), "rb") as f:
        encoded = f.read()
    manifest = fmt.decode_manifest(encoded, path="original")
    rng = random.Random(SEED)
    started = time.perf_counter()
    for i in range(ROUNDS):
        data = mutate(rng, manifest, encoded)
        try:
            exercise(directory, data)
        except Exception as e:  # noqa: BLE001 - the assertion is that none escapes
            pytest.fail(f"input {i} (seed {SEED}) escaped the error tree: {e!r}")
        assert time.perf_counter() - started < BUDGET_S, f"input {i}: over budget"
