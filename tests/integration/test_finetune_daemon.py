"""Fine-tuning through the real daemon: a LoRA model snapshotted every step stages and
writes only its trainable state after the first snapshot; a trainer SIGKILLed mid-run
resumes bit for bit from snapshots that share the base's bytes, and every snapshot
left verifies. The trainers are children forked by the warm parents (warm.py, the
``warm`` fixture): the resume by another parent than the run it is compared with."""

from __future__ import annotations

import json
import os

import torch

from snapd.reader import SnapshotReader
from snapd.store import RunStore

from helpers import stop_daemons_under, wait_for

JOB = os.path.join(os.path.dirname(__file__), "finetune_job.py")
STEPS, PAUSE = 8, 5


def start(parent, tmp_path, name, **cfg):
    """The job as a child of ``parent``, its output in ``<name>.log``."""
    out = tmp_path / name
    out.mkdir()
    cfg = {"root": str(tmp_path / "root"), "out": str(out), "steps": STEPS, **cfg}
    return parent.start(JOB, [json.dumps(cfg)], None, str(tmp_path / f"{name}.log")), out


def finish(proc, out, tmp_path, name):
    assert proc.wait(timeout=120) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
    with open(out / "snapshots.json") as f:
        return json.load(f), torch.load(out / "final.pt", weights_only=True)


def assert_only_trainable_after_the_first(report):
    limit = 2 * report["trainable"]
    first, *later = report["snapshots"]
    assert first["staged"] > 5 * report["trainable"]   # the base, once
    for snap in later:
        assert snap["staged"] <= limit and snap["written"] <= limit, snap


def test_lora_every_step_killed_and_resumed_bit_for_bit(tmp_path, warm):
    procs = []
    try:
        # the uninterrupted run and the one killed side by side (two runs of one root)
        whole, whole_out = start(warm["first"], tmp_path, "whole", run="whole")
        killed, out = start(warm["first"], tmp_path, "killed", run="cut", pause_at=PAUSE)
        procs += [whole, killed]   # neither outlives a failure (killed waits forever)
        assert wait_for(lambda: os.path.exists(out / "paused"), timeout=60)
        killed.kill()   # SIGKILL
        killed.wait(timeout=30)
        report, reference = finish(whole, whole_out, tmp_path, "whole")
        assert_only_trainable_after_the_first(report)

        resumed, out = start(warm["resumed"], tmp_path, "resumed", run="cut", seed=1)
        procs.append(resumed)
        report, state = finish(resumed, out, tmp_path, "resumed")
        assert report["first_step"] == PAUSE + 1
        assert_only_trainable_after_the_first(report)   # the base once more, then shared

        for key, value in reference["model"].items():
            assert torch.equal(value, state["model"][key]), key
        for a, b in zip(reference["opt"], state["opt"]):
            assert all(torch.equal(a[k], b[k]) for k in a)
        store = RunStore(str(tmp_path / "root"), "cut")
        for sid in store.committed():   # every snapshot kept reads whole
            SnapshotReader(store.snapshot_path(sid)).verify()
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        stop_daemons_under(str(tmp_path))
