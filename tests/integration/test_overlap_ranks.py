"""restore(overlap=True) on 2 ranks under torchrun (gloo, CPU): the same run bit for
bit as without overlap; and rank 1's optimizer part damaged, found by the background
read, stops both ranks at their first step with no update, sets the snapshot aside,
and the next start falls back on both ranks together. Also what status reads of it
(the resume's phases, the set-aside snapshot no longer counted). The same on a DDP
model from the remote tier (a moto S3 server on 127.0.0.1): fresh roots pull the
newest commit while the first step computes, bit for bit the restore without overlap;
a damaged optimizer file on the remote stops both ranks, and the next start of both
passes that commit over. The job is overlap_ranks_job.py; one trained root of each
kind serves every case, in two launches."""

import json
import os
import subprocess
import sys

import pytest
import torch

from helpers import assert_equal, flip_byte, private_copy, read_manifest, trained_root
from snapd.progress import read_progress
from snapd.remote.layout import RemoteRoot
from snapd.remote.upload import upload_snapshot
from snapd.store import RunStore, SnapshotId

JOB = os.path.join(os.path.dirname(__file__), "overlap_ranks_job.py")


def torchrun(out, env=None, **roots):
    """One launch of 2 ranks running each phase (keyword) on its root, in turn."""
    os.makedirs(out, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "SNAPD_MIN_FREE_BYTES": "0", **(env or {})}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         "--nproc-per-node=2", JOB, out] + [f"{p}={r}" for p, r in roots.items()],
        env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def result(out, phase, rank):
    return torch.load(os.path.join(out, f"{phase}-rank{rank}.pt"), weights_only=True)


@pytest.fixture(scope="module")
def restarted(tmp_path_factory, s3_server):
    """Two ranks trained to step 6 with Adam, parts at 2 and 4 (their states in
    out/), and the same on a DDP model, uploaded to two remotes; then one launch
    restarting two copies with overlap: ``clean`` trains on to 6, ``damaged`` (rank 1's
    optimizer part at step 4 damaged) tries its first step, and is then started again
    without overlap (``plain``: new clients, models and optimizers in the same
    processes; the fallback is decided on disk alone); and from the remotes, on fresh
    roots: ``remote`` (one root for both ranks) and ``remote_whole`` (the same without
    overlap), ``remote_damaged`` then ``remote_plain`` (a root of each rank's own)."""
    out = str(tmp_path_factory.mktemp("overlap-out"))
    base = tmp_path_factory.mktemp("overlap-roots")
    ddp = str(base / "ddp")
    pristine = trained_root(tmp_path_factory, "overlap",
                            lambda r: torchrun(out, train=r, ddp_train=ddp))
    clean = private_copy(pristine, tmp_path_factory.mktemp("clean"))
    damaged = private_copy(pristine, tmp_path_factory.mktemp("damaged"))
    part = os.path.join(damaged, "job", "snapshots", "00000004", "rank-00001")
    entry = read_manifest(part)["objects"]["optimizer"]
    damaged_file = os.path.join(part, entry["file"])
    flip_byte(damaged_file, entry["tensors"][0]["chunks"][0][0] + 3)   # optimizer state
    urls, remote_file = uploaded(ddp, s3_server)
    torchrun(out, env={**s3_server.env, "OVERLAP_JOB_REMOTES": json.dumps(urls)},
             overlap=clean, damaged=damaged, plain=damaged,
             remote=str(base / "fresh"), remote_whole=str(base / "fresh-whole"),
             remote_damaged=str(base / "node-{rank}"),
             remote_plain=str(base / "node-{rank}"))
    return {"out": out, "clean": clean, "damaged": damaged, "file": damaged_file,
            "base": str(base), "remote_file": remote_file}


def uploaded(root, s3_server):
    """The DDP run's snapshots uploaded to two prefixes of the server, by the uploader's
    own upload_snapshot; in the second, the optimizer file of step 4 (of the first part
    that stores one: a replicated tensor is stored once) damaged. Each phase's URL,
    and the damaged file as the remote names it."""
    store = RunStore(root, "job")
    clean, damaged = s3_server.url(), s3_server.url()
    with pytest.MonkeyPatch.context() as env:
        for key, value in s3_server.env.items():
            env.setenv(key, value)
        for url in (clean, damaged):
            for sid in store.committed():
                upload_snapshot(RemoteRoot(url), store, sid.name)
        snapshot = store.snapshot_path(SnapshotId(0, 4))
        part = next(p for p in sorted(os.listdir(snapshot)) if p.startswith("rank-")
                    and read_manifest(os.path.join(snapshot, p))["objects"]["optimizer"]
                    .get("file"))
        entry = read_manifest(os.path.join(snapshot, part))["objects"]["optimizer"]
        remote = RemoteRoot(damaged)
        path = remote.file_path("job", "00000004", f"{part}/{entry['file']}")
        data = bytearray(remote.fs.cat_file(path))
        stored = next(t for t in entry["tensors"] if t.get("chunks"))   # not a ref
        data[stored["chunks"][0][0] + 3] ^= 0xFF
        remote.fs.pipe_file(path, bytes(data))
    return ({"remote": clean, "remote_whole": clean, "remote_damaged": damaged,
             "remote_plain": damaged}, remote.where(path))


def test_two_ranks_resume_with_overlap_bit_for_bit(restarted):
    out = restarted["out"]
    for rank in range(2):
        got = result(out, "overlap", rank)
        assert got["start"] == 4
        # The run without overlap ends as the trained one did (test_multirank_restore).
        assert_equal(got["state"], result(out, "train", rank)["state"], f"rank {rank}")
        phases = read_progress(RunStore(restarted["clean"], "job"), rank).resume_phases
        assert phases["overlap"] is True and phases["state"] == "complete"
        assert phases["started"] <= phases["ready"] <= phases["optimizer_state"]


def test_a_damaged_optimizer_part_stops_both_ranks_and_both_fall_back(restarted):
    out, root, damaged = restarted["out"], restarted["damaged"], restarted["file"]
    for rank in range(2):
        got = result(out, "damaged", rank)
        assert got["start"] == 4 and got["unchanged"], f"rank {rank}"
        assert got["error"]["type"] == "CorruptSnapshot", got["error"]
        assert damaged in got["error"]["message"] and got["error"]["path"] == damaged
        assert "No update was applied on any rank" in got["error"]["message"]
        assert got["error"]["message"].endswith("Restart the job")
    assert "failed on another rank (rank 1: " in result(out, "damaged", 0)["error"]["message"]
    snapshots = os.listdir(os.path.join(root, "job", "snapshots"))
    assert "00000004" not in snapshots            # the whole global snapshot set aside
    assert [n for n in snapshots if n.startswith(".damaged-00000004-")]
    assert [result(out, "plain", r)["start"] for r in range(2)] == [2, 2]


def test_status_does_not_count_the_set_aside_snapshot_on_any_rank(restarted):
    """Each rank's log says the snapshot was set aside (rank 1 found the damage, rank 0
    heard of it at the join): its commit record no longer counts in either row."""
    for rank in range(2):
        progress = read_progress(RunStore(restarted["damaged"], "job"), rank)
        assert progress.set_aside == ["00000004"], f"rank {rank}"
        assert progress.committed.name == "00000002", f"rank {rank}"


def test_two_ddp_ranks_resume_with_overlap_from_the_remote_bit_for_bit(restarted):
    out = restarted["out"]
    for rank in range(2):
        got, whole = result(out, "remote", rank), result(out, "remote_whole", rank)
        assert got["start"] == whole["start"] == 4
        assert got["restored_from"] == whole["restored_from"] == "remote"
        assert_equal(got["state"], whole["state"], f"rank {rank}: without overlap")
        assert_equal(got["state"], result(out, "ddp_train", rank)["state"], f"rank {rank}")
    # Rank 0 pulled for the shared root; committed once every rank's state arrived.
    store = RunStore(os.path.join(restarted["base"], "fresh"), "job")
    for rank in range(2):
        phases = read_progress(store, rank).resume_phases
        assert phases["overlap"] is True and phases["state"] == "complete"
        assert phases["started"] <= phases["ready"] <= phases["optimizer_state"]
    assert [sid.name for sid in store.committed()] == ["00000004"]
    assert store.read_pointer("LATEST").name == "00000004"
    assert not [n for n in os.listdir(store.snapshots_path) if n.startswith(".")]


def test_a_damaged_remote_optimizer_file_stops_both_ranks_and_both_fall_back(restarted):
    out, remote_file = restarted["out"], restarted["remote_file"]
    for rank in range(2):
        got = result(out, "remote_damaged", rank)
        assert got["start"] == 4 and got["unchanged"], f"rank {rank}"
        assert got["error"]["type"] == "CorruptSnapshot", got["error"]
        assert got["error"]["path"] == remote_file, got["error"]
        assert "No update was applied on any rank" in got["error"]["message"]
        store = RunStore(os.path.join(restarted["base"], f"node-{rank}"), "job")
        names = os.listdir(store.snapshots_path)
        assert [n for n in names if n.startswith(".damaged-00000004-remote-")], names
        assert not [n for n in names if n.startswith(".tmp-")]
        # The next start of each rank passed that commit over: the older one pulled.
        plain = result(out, "remote_plain", rank)
        assert plain["start"] == 2 and plain["restored_from"] == "remote"
        assert [sid.name for sid in store.committed()] == ["00000002"]
