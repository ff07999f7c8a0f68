"""Fuzzing the manifest and skeleton decoders with mutations of a real manifest.

About a thousand inputs, bounded in time: bit flips, each field's type swapped, deep
nesting, huge declared sizes, msgpack extension types. Each input goes
through decode_manifest, the skeleton decoder and the reader's open (as a real file
in a real snapshot directory). Every outcome must be a value or CorruptSnapshot:
no crash, no hang, no exception from outside the snapd error tree.
"""

from __future__ import annotations

import copy
import functools
import itertools
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
# Seeded samples of the two classes whose inputs have no end (random bytes); the other
# classes are finite and every one of their inputs is tried (see ``inputs``).
FLIP_ROUNDS, SKELETON_BYTE_ROUNDS = 400, 200
DEPTHS = (31, 33, 200, 5000)
HUGE = (1 << 40, (1 << 64) - 1, -5)
BUDGET_S = 60.0   # ~1 s here; generous for a loaded machine: it catches a blowup

SWAPS = [None, True, -1, 1 << 70, 3.5, float("nan"), "x" * 3, b"\0" * 5, [], [1, [2]],
         {}, {"a": {"b": 1}}, msgpack.ExtType(2, b"\x91\x01"), msgpack.ExtType(99, b""),
         msgpack.Timestamp(1, 2), 4 << 40, [4 << 40, 4 << 40]]


@functools.lru_cache(maxsize=None)   # 5000 nested extensions take ~10 ms to build
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


def encoded_manifest(m: dict) -> bytes:
    """``m`` as a signed manifest; re-signed raw msgpack where the encoder refuses it."""
    try:
        return fmt.encode_manifest(m)
    except (TypeError, ValueError, OverflowError):
        return resign(msgpack.packb(m, use_bin_type=True, default=str))


def changed(manifest: dict, change) -> bytes:
    m = copy.deepcopy(manifest)
    change(m)
    return encoded_manifest(m)


def inputs(rng: random.Random, manifest: dict, encoded: bytes):
    """(what, bytes) of every input. Why these cover the ground of thousands of
    random draws: four of the five classes are finite, and each of their inputs is
    tried once (a draw would repeat them many times and miss some): every field's
    type swapped (every leaf, two swaps each, the swaps in turn so that each meets a
    dozen fields), each object's skeleton nested at each depth as lists and as
    tuples, each size field given each huge value. Bit flips and damaged skeleton
    bytes have no end of inputs: a seeded sample of each."""
    paths = [p for p, _ in leaves(manifest)]
    turn = itertools.cycle(range(len(SWAPS)))
    for path in paths:   # a field's type swapped
        for swap in (SWAPS[next(turn)], SWAPS[next(turn)]):
            yield f"{path} = {swap!r}", changed(manifest, lambda m: set_at(m, path, swap))
    for obj in manifest["objects"]:   # a skeleton nested deep, as lists or as tuples
        for depth, ext in itertools.product(DEPTHS, (False, True)):
            yield f"{obj} skeleton {depth} deep (ext {ext})", changed(
                manifest, lambda m: m["objects"][obj].update(skeleton=deep(depth, ext)))
    sizes = [p for p in paths if p[-1] in ("size", "nbytes", 1, 2) or
             (len(p) > 1 and p[-2] == "shape")]
    for path, value in itertools.product(sizes, HUGE):   # a huge declared size
        yield f"{path} = {value}", changed(manifest, lambda m: set_at(m, path, value))
    for i in range(FLIP_ROUNDS):   # bit flips in the payload, re-signed: checksum holds
        payload = bytearray(encoded[fmt.HEADER_BYTES:])
        for _ in range(rng.randint(1, 8)):
            payload[rng.randrange(len(payload))] ^= 1 << rng.randrange(8)
        yield f"bit flips {i}", resign(bytes(payload))
    for i in range(SKELETON_BYTE_ROUNDS):   # skeleton bytes damaged inside
        obj = rng.choice(list(manifest["objects"]))
        sk = bytearray(manifest["objects"][obj]["skeleton"])
        sk[rng.randrange(len(sk))] = rng.randrange(256)
        yield f"{obj} skeleton byte {i}", changed(
            manifest, lambda m: m["objects"][obj].update(skeleton=bytes(sk)))


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
    started = time.perf_counter()
    count = 0
    for what, data in inputs(random.Random(SEED), manifest, encoded):
        try:
            exercise(directory, data)
        except Exception as e:  # noqa: BLE001 - the assertion is that none escapes
            pytest.fail(f"input {what} (seed {SEED}) escaped the error tree: {e!r}")
        assert time.perf_counter() - started < BUDGET_S, f"input {what}: over budget"
        count += 1
    assert count > 1000   # every class was reached
