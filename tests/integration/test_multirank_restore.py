"""restore() on many ranks, with real jobs under torchrun (gloo, CPU), of parts the
in-process writer wrote: the same world size bit for bit, and a damaged part making
every rank fall back together. The job is restore_job.py. (FSDP2 saved at one world
size and restored at another: test_multirank.py, through the daemon.)"""

import os
import subprocess
import sys

import pytest
import torch

from helpers import assert_equal, flip_byte, private_copy, read_manifest, trained_root

JOB = os.path.join(os.path.dirname(__file__), "restore_job.py")


def torchrun(root, out, phase, nproc):
    os.makedirs(out, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "SNAPD_MIN_FREE_BYTES": "0"}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc-per-node={nproc}", JOB, root, out, phase],
        env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stderr


def result(out, phase, rank):
    return torch.load(os.path.join(out, f"{phase}-rank{rank}.pt"), weights_only=False)


@pytest.fixture(scope="module")
def plain_root(tmp_path_factory):
    """Two ranks trained to step 6, parts at 2 and 4; their final states in out/."""
    out = str(tmp_path_factory.mktemp("plain-out"))
    root = trained_root(tmp_path_factory, "plain",
                        lambda r: torchrun(r, out, "train", 2))
    return root, out


def test_two_ranks_resume_bit_for_bit(plain_root, tmp_path):
    pristine, trained = plain_root
    root, out = private_copy(pristine, tmp_path), str(tmp_path / "out")
    torchrun(root, out, "resume", 2)
    for rank in range(2):
        got = result(out, "resume", rank)
        assert got["start"] == 4
        assert_equal(got["state"], result(trained, "train", rank)["state"], f"rank {rank}")


def test_a_damaged_part_makes_both_ranks_fall_back_together(plain_root, tmp_path):
    pristine, _ = plain_root
    root, out = private_copy(pristine, tmp_path), str(tmp_path / "out")
    part = os.path.join(root, "job", "snapshots", "00000004", "rank-00001")
    damaged = os.path.join(part, "model.tensors")
    weight = read_manifest(part)["objects"]["model"]["tensors"][0]
    flip_byte(damaged, weight["chunks"][0][0] + 3)   # a byte of the weight
    err = torchrun(root, out, "resume", 2)
    assert [result(out, "resume", r)["start"] for r in range(2)] == [2, 2]
    warned = [line for line in err.splitlines() if "FallbackWarning" in line]
    assert len(warned) == 2, err[-3000:]   # one per rank, each naming rank and file
    assert all("rank 1" in w and damaged in w for w in warned)
