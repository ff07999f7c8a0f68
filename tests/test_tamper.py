"""Tamper evidence: a snapshot forged so that every xxh3 digest holds is refused by its
SHA-256s (the manifest's, and the state log's record of the manifest), and restore
falls back to the previous snapshot, bit for bit. ``snapd verify`` checks the SHA-256s, ``--sha256`` audits them against the log, and
option ``sha256=False`` records none. (``sha256sum`` against ``snapd inspect``:
tests/integration/test_sha256sum.py.)"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings

import pytest
import torch
import xxhash
from click.testing import CliRunner

from snapd import format as fmt
from snapd import statelog
from snapd.cli import main
from snapd.errors import CorruptSnapshot
from snapd.reader import SnapshotReader
from snapd_client import Client
from snapd_client.restore import FallbackWarning

from helpers import (assert_equal, read_manifest, small_model_and_opt, small_train_step,
                     write_manifest_raw)


def snapshot_dir(root: str, step: int) -> str:
    return os.path.join(root, "r", "snapshots", f"{step:08d}")


def train(root: str, **options):
    """Steps 1-4, snapshots at 2 and 4 (in process, logged); returns the state the
    snapshot of step 2 holds, cloned."""
    model, opt = small_model_and_opt()
    client = Client(root, "r", daemon=False, **options)
    client.track(model=model, optimizer=opt)
    at_two = None
    for step in range(1, 5):
        loss = small_train_step(model, opt, step)
        client.log(step, loss=loss)
        if step % 2 == 0:
            client.snapshot(step).wait()
        if step == 2:
            at_two = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                      "optimizer": _cloned(opt.state_dict())}
    client.close()
    return at_two


def _cloned(tree):
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, dict):
        return {k: _cloned(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_cloned(v) for v in tree]
    return tree


def forge(directory: str, file_name: str, *, rewrite_sha256: bool) -> None:
    """Replace every tensor of ``file_name`` with other bytes (each element 0.25), and
    rewrite the manifest's xxh3 digests to match: chunk, tensor, file. With
    ``rewrite_sha256`` the file's SHA-256 too, so that the manifest is whole again."""
    manifest = read_manifest(directory)
    path = os.path.join(directory, file_name)
    data = bytearray(open(path, "rb").read())
    obj = next(o for o in manifest["objects"].values() if o.get("file") == file_name)
    file_digest = fmt.FileDigest(manifest["format"])
    file_digest.header(bytes(data[:fmt.HEADER_BYTES]))
    for t in obj["tensors"]:
        raw = b""
        for chunk in t["chunks"]:
            offset, stored = chunk[0], chunk[1]
            assert chunk[3] == fmt.CODEC_RAW
            forged = torch.full((stored // 4,), 0.25).numpy().tobytes()
            data[offset:offset + stored] = forged
            chunk[4] = xxhash.xxh3_64_intdigest(forged)
            file_digest.chunk(b"", chunk[4])
            raw += forged
        t["xxh3"] = xxhash.xxh3_64_intdigest(raw)
    manifest["files"][file_name]["xxh3"] = file_digest.intdigest()
    if rewrite_sha256:
        manifest["files"][file_name]["sha256"] = hashlib.sha256(data).digest()
    with open(path, "wb") as f:
        f.write(data)
    write_manifest_raw(directory, manifest)


def restore_fresh(root: str):
    model, opt = small_model_and_opt()
    client = Client(root, "r", daemon=False)
    client.track(model=model, optimizer=opt)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        step = client.restore()
    client.close()
    refusals = [str(w.message) for w in seen if issubclass(w.category, FallbackWarning)]
    return step, model, opt, refusals


@pytest.mark.parametrize("rewrite_sha256", [False, True],
                         ids=["file-sha256-no-log", "manifest-rewritten-whole"])
def test_a_forged_snapshot_is_refused_and_the_previous_one_restored_bit_for_bit(
        tmp_path, rewrite_sha256):
    """Rewritten whole, the manifest is caught by the log's record of it; with only
    its xxh3 digests rewritten, by the file's SHA-256, even with no log at all (a
    snapshot copied to another machine)."""
    root = str(tmp_path)
    at_two = train(root)
    four = snapshot_dir(root, 4)
    forge(four, "model.tensors", rewrite_sha256=rewrite_sha256)
    if not rewrite_sha256:
        shutil.rmtree(os.path.join(root, "r", "log"))
    forged = SnapshotReader(four)
    if rewrite_sha256:
        forged.verify()   # whole by its own digests: only the log can tell
    else:
        with pytest.raises(CorruptSnapshot) as caught:
            forged.verify()
        assert caught.value.field == "files['model.tensors'].sha256"

    step, model, opt, refusals = restore_fresh(root)

    assert step == 2
    assert len(refusals) == 1 and four in refusals[0]
    said = "manifest_sha256" if rewrite_sha256 else "files['model.tensors'].sha256"
    assert said in refusals[0]
    assert_equal(model.state_dict(), at_two["model"], "model")
    assert_equal(_cloned(opt.state_dict()), at_two["optimizer"], "optimizer")


def test_the_log_records_each_committed_manifests_sha256(tmp_path):
    root = str(tmp_path)
    train(root)
    records = [r for r in statelog.read_records(os.path.join(root, "r"), 0)
               if r.get("event") == "committed"]
    assert [r["name"] for r in records] == ["00000002", "00000004"]
    for r in records:
        manifest = os.path.join(root, "r", "snapshots", r["name"], fmt.MANIFEST_NAME)
        assert r["manifest_sha256"] == hashlib.sha256(open(manifest, "rb").read()).hexdigest()
    listed = CliRunner().invoke(main, ["ls", "--root", root, "--json"])
    assert {row["name"]: row["sha256"] for row in json.loads(listed.output)["snapshots"]} \
        == {r["name"]: r["manifest_sha256"] for r in records}


def test_verify_checks_sha256_and_audits_against_the_log(tmp_path):
    root = str(tmp_path)
    train(root)
    ok = CliRunner().invoke(main, ["verify", "--all", "--root", root])
    assert ok.exit_code == 0, ok.output
    assert ok.output.count("SHA-256 checked, manifest as logged") == 2, ok.output
    audit = CliRunner().invoke(main, ["verify", "--sha256", "--all", "--root", root])
    assert audit.exit_code == 0, audit.output
    assert audit.output.count("2 files match their SHA-256; manifest against the log: "
                              "match") == 2, audit.output
    forge(snapshot_dir(root, 4), "model.tensors", rewrite_sha256=True)
    for quick in ([], ["--sha256"]):   # the manifest alone would vouch for it: the log
        caught = CliRunner().invoke(main, ["verify", *quick, "r@4", "--root", root,
                                           "--json"])
        assert caught.exit_code == 1, caught.output
        [verdict] = json.loads(caught.output)["snapshots"]
        assert verdict["field"] == "manifest_sha256" and \
            verdict["file"] == os.path.join(snapshot_dir(root, 4), fmt.MANIFEST_NAME)


def test_with_sha256_off_nothing_is_recorded_and_verify_says_so(tmp_path):
    root = str(tmp_path)
    train(root, sha256=False)
    manifest = read_manifest(snapshot_dir(root, 4))
    assert all("sha256" not in entry for entry in manifest["files"].values())
    records = [r for r in statelog.read_records(os.path.join(root, "r"), 0)
               if r.get("event") == "committed"]
    assert records and all("manifest_sha256" not in r for r in records)
    result = CliRunner().invoke(main, ["verify", "r@4", "--root", root])
    assert result.exit_code == 0 and "no SHA-256 recorded" in result.output, result.output
    step, *_ = restore_fresh(root)
    assert step == 4
