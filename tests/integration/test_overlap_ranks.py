"""restore(overlap=True) on 2 ranks under torchrun (gloo, CPU): the same run bit for
bit as without overlap; and rank 1's optimizer part damaged, found by the background
read, stops both ranks at their first step with no update, sets the snapshot aside,
and the next start falls back on both ranks together. Also what status reads of it
(the resume's phases, the set-aside snapshot no longer counted). The job is
overlap_ranks_job.py; one trained root serves every case."""

import os
import subprocess
import sys

import pytest
import torch

from helpers import assert_equal, flip_byte, private_copy, read_manifest, trained_root
from snapd.progress import read_progress
from snapd.store import RunStore

JOB = os.path.join(os.path.dirname(__file__), "overlap_ranks_job.py")


def torchrun(out, **roots):
    """One launch of 2 ranks running each phase (keyword) on its root, in turn."""
    os.makedirs(out, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "SNAPD_MIN_FREE_BYTES": "0"}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         "--nproc-per-node=2", JOB, out] + [f"{p}={r}" for p, r in roots.items()],
        env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def result(out, phase, rank):
    return torch.load(os.path.join(out, f"{phase}-rank{rank}.pt"), weights_only=True)


@pytest.fixture(scope="module")
def restarted(tmp_path_factory):
    """Two ranks trained to step 6 with Adam, parts at 2 and 4 (their states in
    out/); then one launch restarting two copies with overlap: ``clean`` trains on to
    6, ``damaged`` (rank 1's optimizer part at step 4 damaged) tries its first step,
    and is then started again without overlap (``plain``: new clients, models and
    optimizers in the same processes; the fallback is decided on disk alone)."""
    out = str(tmp_path_factory.mktemp("overlap-out"))
    pristine = trained_root(tmp_path_factory, "overlap", lambda r: torchrun(out, train=r))
    clean = private_copy(pristine, tmp_path_factory.mktemp("clean"))
    damaged = private_copy(pristine, tmp_path_factory.mktemp("damaged"))
    part = os.path.join(damaged, "job", "snapshots", "00000004", "rank-00001")
    entry = read_manifest(part)["objects"]["optimizer"]
    damaged_file = os.path.join(part, entry["file"])
    flip_byte(damaged_file, entry["tensors"][0]["chunks"][0][0] + 3)   # optimizer state
    torchrun(out, overlap=clean, damaged=damaged, plain=damaged)
    return {"out": out, "clean": clean, "damaged": damaged, "file": damaged_file}


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
