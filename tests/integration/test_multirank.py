"""Many ranks, real jobs: torchrun starts the scripts of tests/multirank/ (gloo, CPU)
and tests/integration/jobs.py kills them whole. Issue 14's acceptance cases:

1. DDP on 2 ranks, SIGKILLed between two snapshots and restarted, ends bit for bit
   on an uninterrupted run without snapd: every rank's weights, optimizer state, RNG
   streams and the samples it consumed.
2. FSDP2 saved at 4 ranks restores at 2, and saved at 2 restores at 4: the full
   tensors equal those saved, and training goes on. Restored at 2 with overlap, it
   ends 4 steps later bit for bit as without; with one byte of a saved optimizer
   shard flipped, both ranks raise CorruptSnapshot at their first step, no weight
   moved, and both fall back at the next start.
3. A snapshot one rank never submitted its part of is never restored; close() on the
   other rank says so within its bounded wait.
4. One damaged part makes every rank fall back together, the warning naming the
   rank and the file.
5. A 4-rank DDP snapshot takes about one copy of model and optimizer on disk.
6. ``snapd repro`` of step 19 of the killed-and-resumed DDP run, under torchrun with
   2 ranks: every rank's state after step 19, bit for bit, committed globally in a new
   run; the run's files untouched; the report names each rank's batch.

Jobs are slow to start (torch on every rank): each module-scoped fixture runs its
jobs once and several tests read their output, and jobs that do not depend on each
other run side by side where a core would otherwise wait (two 2-rank jobs; a job in
its bounded wait beside a 4-rank one).
"""

from __future__ import annotations

import glob
import hashlib
import json
import math
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile

import numpy as np
import psutil
import pytest
import torch

from helpers import flip_byte, read_manifest, stop_daemons_under
from jobs import (MULTIRANK, Job, files_exist, job_env, logged_step, newest_snapshot,
                  part_files, parts_dir, run_job, snapshot_dir, tensor_file_bytes)
from rankstate import (load_close, load_progress, load_state, sample_differences,
                       state_differences, with_prefix)
from snapd.progress import read_progress
from snapd.store import RunStore
from snapd_client.distrestore import Parts

DDP = {"steps": 30, "snapshot_every": 8, "batch_size": 4, "samples": 96}
KILL_AT, RESUMED_AT = 20, 16       # killed after step 20: between snapshots 16 and 24
REPRO_AT = 19                      # reproduced from 16; the killed job dumps its state
FINAL = ("param/", "opt/", "rng/", "lr", "step")
TAG = f"mr{secrets.token_hex(3)}"   # run names' prefix: this session's hot copies only


@pytest.fixture(scope="module")
def base():
    """A short directory (daemon sockets live under the roots) for the module."""
    path = tempfile.mkdtemp(prefix="sdmr-", dir="/tmp")
    yield path
    stop_daemons_under(path)
    for seg in glob.glob(f"/dev/shm/snapd-hot-{os.getuid()}-{TAG}-*"):
        os.unlink(seg)
    shutil.rmtree(path, ignore_errors=True)


def folder(base: str, name: str) -> str:
    path = os.path.join(base, name)
    os.makedirs(path)
    return path


def ddp(base: str, name: str, run: str, nproc: int = 2, **cfg):
    """Settings of a DDP job writing to a fresh folder ``name``; the root is shared."""
    return {**DDP, "root": os.path.join(base, "root"), "run": f"{TAG}-{run}",
            "out": folder(base, name), **cfg}, nproc


@pytest.fixture(scope="module")
def ddp_runs(base):
    """The uninterrupted run, without snapd, side by side with the same run with snapd:
    SIGKILLed whole once snapshot 16 is globally committed and every rank has done
    step 20; restarted, run to the end."""
    ref, n = ddp(base, "reference", "ref", snapd=False)
    uninterrupted = Job("ddp_job.py", n, ref, os.path.join(base, "reference.log"))
    try:
        cut = killed_and_resumed(base)
    except BaseException:
        uninterrupted.kill()
        raise
    uninterrupted.expect_ok()
    return {"reference": ref["out"], **cut}


def killed_and_resumed(base: str) -> dict:
    cfg, n = ddp(base, "killed", "cut", pause_at=KILL_AT, dump_at=REPRO_AT)
    job = Job("ddp_job.py", n, cfg, os.path.join(base, "killed.log"))
    committed = os.path.join(snapshot_dir(cfg["root"], cfg["run"], RESUMED_AT), "commit.snapd")
    job.wait_until(files_exist(committed, *(os.path.join(cfg["out"], f"paused-{r}")
                                            for r in range(n))),
                   90, f"snapshot {RESUMED_AT}'s global commit and step {KILL_AT} on every rank")
    workers = job.workers()
    job.kill()
    survivors = [w for w in workers if w.is_running() and w.status() != psutil.STATUS_ZOMBIE]
    assert logged_step(cfg["root"], cfg["run"], 0) == KILL_AT
    again, _ = ddp(base, "resumed", "cut")
    run_job("ddp_job.py", n, again, os.path.join(base, "resumed.log"))
    return {"root": cfg["root"], "run": cfg["run"], "killed": cfg["out"],
            "resumed": again["out"], "nproc": n, "workers": workers,
            "returncode": job.proc.returncode, "survivors": survivors}


@pytest.fixture(scope="module")
def reference(ddp_runs):
    return ddp_runs["reference"]


@pytest.fixture(scope="module")
def resumed(ddp_runs):
    return ddp_runs


def test_a_job_is_killed_whole(reference, resumed):
    """The harness's SIGKILL reaches every rank (torchrun gives each a session of its
    own), and a paused job has done exactly the steps of the uninterrupted one: the job
    killed at step 20 (the daemon its ranks started detaches, and is no worker)."""
    n = resumed["nproc"]
    assert len(resumed["workers"]) >= n
    assert resumed["returncode"] == -signal.SIGKILL
    assert resumed["survivors"] == []
    for rank in range(n):
        killed = load_progress(resumed["killed"], rank)
        assert killed == load_progress(reference, rank)[:KILL_AT]


@pytest.mark.parametrize("rank", [0, 1])
def test_ddp_killed_whole_resumes_bit_for_bit(reference, resumed, rank):
    want, got = load_state(reference, rank), load_state(resumed["resumed"], rank)
    assert int(got["first_step"]) == RESUMED_AT
    keys = with_prefix(want, *FINAL)
    assert len(with_prefix(want, "opt/")) >= 12 and len(with_prefix(want, "rng/")) >= 5
    assert state_differences(got, want, keys) == []
    # the recomputed and later steps saw the same losses, to the bit
    assert got["losses"].tobytes() == want["losses"][RESUMED_AT:].tobytes()


@pytest.mark.parametrize("rank", [0, 1])
def test_ddp_resume_sees_no_sample_twice_and_skips_none(reference, resumed, rank):
    want = load_progress(reference, rank)
    killed = load_progress(resumed["killed"], rank)
    assert [s["step"] for s in killed] == list(range(1, KILL_AT + 1))
    assert killed == want[:KILL_AT]
    after = load_state(resumed["resumed"], rank)["samples"].tolist()
    # what the job consumed up to the snapshot, then what the resumed job consumed
    seen = [i for s in killed[:RESUMED_AT] for i in s["samples"]] + after
    assert sample_differences(seen, [i for s in want for i in s["samples"]]) == []


def test_ddp_ranks_saw_each_sample_once_per_epoch(reference):
    """The reference itself shuffles per epoch (set_epoch) and splits the data."""
    per_epoch = DDP["samples"] // DDP["batch_size"] // 2   # steps in one epoch
    steps = [load_progress(reference, r) for r in (0, 1)]
    first = sorted(i for r in (0, 1) for s in steps[r][:per_epoch] for i in s["samples"])
    second = [i for r in (0, 1) for s in steps[r][per_epoch:2 * per_epoch] for i in s["samples"]]
    assert first == list(range(DDP["samples"]))
    assert sorted(second) == first
    assert second != [i for r in (0, 1) for s in steps[r][:per_epoch] for i in s["samples"]]


# --- snapd repro under torchrun ---------------------------------------------------

def run_files(path: str) -> dict:
    """Every file under ``path``, relative, with the SHA-256 of its bytes."""
    found = {}
    for folder_, _dirs, names in os.walk(path):
        for name in names:
            with open(os.path.join(folder_, name), "rb") as f:
                found[os.path.relpath(os.path.join(folder_, name), path)] = \
                    hashlib.sha256(f.read()).hexdigest()
    return found


@pytest.fixture(scope="module")
def reproduced(base, resumed):
    """``snapd repro ROOT RUN@19 -- python -m torch.distributed.run ... ddp_job.py``
    with the job's own settings (its side files to a folder of its own): the finished
    command, and the run's files before and after."""
    root, run = resumed["root"], resumed["run"]
    cfg, n = ddp(base, "repro", "cut")
    before = run_files(os.path.join(root, run))
    argv = [sys.executable, "-m", "snapd", "repro", root, f"{run}@{REPRO_AT}", "--",
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(n), os.path.join(MULTIRANK, "ddp_job.py"),
            json.dumps(cfg)]
    done = subprocess.run(argv, env=job_env(), capture_output=True, text=True,
                          timeout=120)
    return done, before, run_files(os.path.join(root, run))


def part_arrays(snapshot: str, rank: int) -> dict:
    """Rank ``rank``'s state in a multi-rank snapshot, keyed as dump.py's
    tracked_arrays keys it: a replicated tensor read from the part that stores it."""
    parts = Parts(snapshot)
    part = parts.part(rank)
    arrays = {f"{name}/{i}": parts.tensor(rank, name, t).contiguous().reshape(-1)
              .view(torch.uint8).numpy()
              for name in ("model", "optimizer", "scheduler")
              for i, t in enumerate(part.objects[name]["tensors"])}
    arrays.update({f"rng:{k}": np.frombuffer(v, dtype=np.uint8)
                   for k, v in part.manifest["rng"].items()})
    return arrays


def test_repro_of_a_ddp_step_writes_every_ranks_state_after_it(resumed, reproduced):
    """The run was killed after step 20 and resumed from 16: its log holds steps 17 to
    20 twice. repro @19 restores 16 on both ranks, checks 17-19 against each rank's
    own log, and commits the state after 19 as one snapshot of both ranks' parts:
    each equal, bit for bit, to what that rank dumped after step 19 (tensors and RNG
    streams); nothing of the run changed."""
    done, before, after = reproduced
    assert done.returncode == 0, done.stderr[-4000:]
    root, run = resumed["root"], resumed["run"]
    snapshot = snapshot_dir(root, f"{run}.repro-{REPRO_AT}", REPRO_AT)
    consumed = [load_progress(resumed["killed"], r)[REPRO_AT - 1]["samples"]
                for r in range(2)]
    # 96 samples, 2 ranks, batches of 4: 12 steps an epoch; step 19 is epoch 1's 7th
    assert done.stdout.splitlines() == [
        f"repro of {run}@{REPRO_AT} on 2 ranks",
        f"  started from: snapshot 00000016 (step {RESUMED_AT})",
        "  recomputed: 3 steps on each of 2 ranks, 6 checked against each rank's own "
        "log, all matched",
        f"  step {REPRO_AT} consumed:",
        f"    rank 0: epoch 1 batch 6; samples {consumed[0]}",
        f"    rank 1: epoch 1 batch 6; samples {consumed[1]}",
        f"  state after step {REPRO_AT}: run {run}.repro-{REPRO_AT}, {snapshot}"]
    assert after == before
    assert sorted(os.listdir(os.path.dirname(snapshot))) == [f"{REPRO_AT:08d}"]
    assert sorted(os.listdir(snapshot)) == ["commit.snapd", "rank-00000", "rank-00001"]
    for rank in range(2):
        with np.load(os.path.join(resumed["killed"], f"rank-{rank}.at-{REPRO_AT}.npz"),
                     allow_pickle=False) as z:
            want = {k: z[k].tobytes() for k in z.files}
        got = {k: v.tobytes() for k, v in part_arrays(snapshot, rank).items()}
        assert len(with_prefix(want, "optimizer/")) >= 12 and "rng:numpy" in want
        assert got == want, sorted(k for k in want if got.get(k) != want[k])
    manifest = Parts(snapshot).part(1).manifest
    assert (manifest["step"], manifest["world_size"], manifest["lineage"]) == (
        REPRO_AT, 2, {"id": 0, "mode": "repro",
                      "parent": {"run": run, "snapshot": "00000016", "step": RESUMED_AT}})


def restore_only(base: str, root: str, run: str, name: str, nproc: int = 2,
                 env=None) -> tuple:
    """A job that restores and stops at once (steps 0): the step every rank got."""
    cfg = {**DDP, "root": root, "run": run, "out": folder(base, name), "steps": 0}
    job = run_job("ddp_job.py", nproc, cfg, os.path.join(base, f"{name}.log"), env=env)
    return [int(load_state(cfg["out"], r)["first_step"]) for r in range(nproc)], job


def test_one_damaged_part_makes_every_rank_fall_back_together(base, resumed):
    """Rank 1's part of the newest snapshot (24) loses one byte: both ranks resume
    from 16, and the warning names rank 1 and the file."""
    stop_daemons_under(resumed["root"])   # the copy has no daemon and no hot copy
    root = folder(base, "damaged-root")
    shutil.copytree(os.path.join(resumed["root"], resumed["run"]),
                    os.path.join(root, resumed["run"]))
    newest = newest_snapshot(root, resumed["run"])
    assert int(os.path.basename(newest).split(".")[0]) == 24, newest
    victim = part_files(newest, 1)[0]
    flip_byte(victim, os.path.getsize(victim) // 2)
    before = tree(newest)
    steps, job = restore_only(base, root, resumed["run"], "damaged")
    assert steps == [RESUMED_AT, RESUMED_AT]
    lines = [line for line in job.output(200_000).splitlines()
             if os.path.basename(victim) in line]
    assert any("rank 1" in line or "rank-00001" in line for line in lines), \
        f"{job.output()}\nbefore the job: {before}\nafter it: {tree(newest)}"


def tree(path: str) -> list:
    """Every file under ``path``, relative: what a failure message shows of a snapshot."""
    return sorted(os.path.relpath(os.path.join(d, f), path)
                  for d, _, files in os.walk(path) for f in files)


MISSING_ENV = {"SNAPD_GLOBAL_COMMIT_TIMEOUT": "5"}


@pytest.fixture(scope="module")
def side_by_side(base):
    """Two jobs that share nothing but the root's daemon, at once: one whose rank 1
    never submits its part of snapshot 8 (rank 0's close() waits out its bounded 5 s
    meanwhile), and a 4-rank DDP job. name -> (settings, finished job)."""
    jobs = {"missing": ddp(base, "missing", "miss", steps=8, snapshot_every=4,
                           skip_part_at=8),
            "four": ddp(base, "four", "four", nproc=4, steps=2, snapshot_every=2,
                        hidden=128)}
    started = {name: Job("ddp_job.py", n, cfg, os.path.join(base, f"{name}.log"),
                         env=job_env(**MISSING_ENV) if name == "missing" else None)
               for name, (cfg, n) in jobs.items()}
    try:
        return {name: (jobs[name][0], job.expect_ok()) for name, job in started.items()}
    finally:
        for job in started.values():
            if job.proc.poll() is None:
                job.kill()


def test_a_snapshot_missing_a_part_is_never_restored(base, side_by_side):
    """Rank 1 never submits its part of snapshot 8: rank 0's close() raises
    IncompleteSnapshot within its bounded wait, snapshot 8 stays parts only, and the
    restart resumes both ranks from 4."""
    cfg, job = side_by_side["missing"]
    closed = [load_close(cfg["out"], r) for r in range(job.nproc)]
    assert closed[0]["error"] == "IncompleteSnapshot", closed
    parts = parts_dir(cfg["root"], cfg["run"], 8)
    message = closed[0]["message"]
    assert os.path.basename(parts) in message, message
    assert "rank" in message and re.search(r"\b1\b", message.replace(parts, "")), message
    assert closed[0]["seconds"] < 5 + 15, closed   # bounded: no hang
    assert closed[1]["error"] is None, closed       # its newest snapshot (4) committed
    assert not os.path.exists(snapshot_dir(cfg["root"], cfg["run"], 8))
    assert os.path.isdir(os.path.join(parts, "rank-00000"))
    assert not os.path.exists(os.path.join(parts, "rank-00001"))
    steps, _ = restore_only(base, cfg["root"], cfg["run"], "missing-restart",
                            env=job_env(**MISSING_ENV))
    assert steps == [4, 4]
    assert not os.path.exists(snapshot_dir(cfg["root"], cfg["run"], 8))


def test_a_4_rank_ddp_snapshot_takes_about_one_copy(side_by_side):
    cfg, job = side_by_side["four"]
    n = job.nproc
    assert "SnapshotWarning" not in job.output(200_000), job.output()
    assert [load_close(cfg["out"], r)["error"] for r in range(n)] == [None] * n
    snapshot = snapshot_dir(cfg["root"], cfg["run"], 2)
    listing = sorted(f for f in os.listdir(snapshot) if not f.startswith("."))
    assert listing == ["commit.snapd"] + [f"rank-{r:05d}" for r in range(n)]
    state = load_state(cfg["out"], 0)
    one_copy = sum(state[k].nbytes for k in with_prefix(state, "param/", "opt/"))
    on_disk = tensor_file_bytes(snapshot)
    assert 0.9 * one_copy <= on_disk < 1.5 * one_copy, (on_disk, one_copy)


# --- FSDP2: saved at one world size, restored at another -------------------------------

FSDP_RUN = f"{TAG}-fsdp"


@pytest.fixture(scope="module")
def fsdp(base):
    """Trained to 4 at 4 ranks (snapshots 2 and 4); restored at 2, trained to 8;
    restored at 4, to 10. The launch at 2 ranks also restores, with overlap, two
    copies of the run as at4 left it: ``overlap`` trains to 8 as at2 does;
    ``damaged`` (one byte of rank 3's optimizer part of snapshot 4 flipped) tries
    its first step, and is then started again without overlap (``fallback``)."""
    root, outs = os.path.join(base, "fsdp-root"), {}
    cfgs = {name: {"root": root, "run": FSDP_RUN, "out": folder(base, f"fsdp-{name}"),
                   "steps": steps, "snapshot_every": 4}
            for name, steps in (("at4", 4), ("at2", 8), ("back4", 10), ("overlap", 8),
                                ("damaged", 4), ("fallback", 2))}
    cfgs["at4"]["snapshot_every"] = 2
    run_job("fsdp_job.py", 4, cfgs["at4"], os.path.join(base, "fsdp-at4.log"), timeout=180)
    outs["damaged_file"] = overlap_roots(base, root, cfgs)
    phases = [cfgs["at2"]] + [{**cfgs[name], "overlap": name != "fallback",
                               "daemon": False, "snapshot_every": 100,
                               "first_step_only": name == "damaged"}
                              for name in ("overlap", "damaged", "fallback")]
    run_job("fsdp_job.py", 2, {"phases": phases}, os.path.join(base, "fsdp-at2.log"),
            timeout=180)
    run_job("fsdp_job.py", 4, cfgs["back4"], os.path.join(base, "fsdp-back4.log"),
            timeout=180)
    outs.update({name: cfg["out"] for name, cfg in cfgs.items()})
    return outs


def overlap_roots(base: str, root: str, cfgs: dict) -> str:
    """Two copies of the run as at4 left it (its daemon still serves ``root``: the
    run's folder is copied), for the phases that restore with overlap; in the one
    for ``damaged``, one byte of a moment in rank 3's optimizer part of snapshot 4
    flipped (a piece only the new rank 1 reads). The damaged file."""
    for name, copy in (("overlap", "fsdp-overlap-root"), ("damaged", "fsdp-damaged-root")):
        cfgs[name]["root"] = os.path.join(base, copy)
        shutil.copytree(os.path.join(root, FSDP_RUN), os.path.join(base, copy, FSDP_RUN))
    cfgs["fallback"]["root"] = cfgs["damaged"]["root"]
    part = os.path.join(snapshot_dir(cfgs["damaged"]["root"], FSDP_RUN, 4), "rank-00003")
    entry = read_manifest(part)["objects"]["optimizer"]
    moment = next(t for t in entry["tensors"]
                  if t["path"].endswith(".exp_avg") and "ref" not in t and t["chunks"])
    damaged = os.path.join(part, entry["file"])
    flip_byte(damaged, moment["chunks"][0][0] + 3)
    return damaged


def full_tensors(out: str, name: str) -> dict:
    with np.load(os.path.join(out, name), allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def went_on(out: str, nproc: int, first: int, last: int) -> None:
    """Every rank started at ``first``, trained to ``last``, losses finite."""
    for rank in range(nproc):
        info = load_json(os.path.join(out, f"rank-{rank}.json"))
        assert (info["world_size"], info["first_step"], info["step"]) == (nproc, first, last)
        assert len(info["losses"]) == last - first
        assert all(math.isfinite(x) for x in info["losses"]), info


def load_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


@pytest.mark.parametrize("saved, restored, was, world, first, last", [
    ("at4", "at2", 4, 2, 4, 8), ("at2", "back4", 2, 4, 8, 10)])
def test_fsdp_restores_at_another_world_size(base, fsdp, saved, restored, was, world,
                                             first, last):
    want = full_tensors(fsdp[saved], "final.npz")
    got = full_tensors(fsdp[restored], "restored.npz")
    assert int(want["step"]) == int(got["step"]) == first
    assert len(with_prefix(want, "opt/")) >= 3 * len(with_prefix(want, "param/"))
    assert state_differences(got, want) == []
    went_on(fsdp[restored], world, first, last)
    with open(os.path.join(base, f"fsdp-{restored}.log")) as f:   # every rank says so
        said = f.read()
    lines = [line for line in said.splitlines()   # the phases with overlap say more
             if f"resharded step {first} saved on {was} rank(s) onto {world}" in line
             and "arrives before the first step" not in line]
    assert len(lines) == world, said[-3000:]


def test_each_rank_logs_how_it_resumed(base, fsdp):
    """The state log keeps the last resume of every rank: back4's, a reshard from 2."""
    store = RunStore(os.path.join(base, "fsdp-root"), FSDP_RUN)
    for rank in range(4):
        resume = read_progress(store, rank).last_resume
        assert (resume["mode"], resume["old_world_size"]) == ("reshard", 2), resume


def test_fsdp_reshard_with_overlap_ends_bit_for_bit_as_without(base, fsdp):
    """Saved at 4, restored at 2 with overlap: restore returns with the weights in
    place and the moments still arriving; 4 steps later weights and optimizer state
    equal the same reshard's without overlap, bit for bit."""
    want = full_tensors(fsdp["at2"], "final.npz")
    got = full_tensors(fsdp["overlap"], "final.npz")
    assert int(got["step"]) == 8 and state_differences(got, want) == []
    restored = full_tensors(fsdp["overlap"], "restored.npz")   # before the first step
    saved = full_tensors(fsdp["at4"], "final.npz")
    assert with_prefix(restored, "opt/") == []   # the moments not applied yet
    params = with_prefix(saved, "param/")
    assert len(with_prefix(got, "opt/")) >= 3 * len(params)   # compared above, too
    assert state_differences(restored, saved, params) == []
    went_on(fsdp["overlap"], 2, 4, 8)
    with open(os.path.join(base, "fsdp-at2.log")) as f:
        said = f.read()
    assert said.count("resharded step 4 saved on 4 rank(s) onto 2: tensors exact, RNG "
                      "streams fresh, the data cursor continued from the global count of "
                      "consumed samples; not an exact resume, so no replay check; the "
                      "state of optimizer arrives before the first step") == 4, said[-3000:]
    store = RunStore(os.path.join(base, "fsdp-overlap-root"), FSDP_RUN)
    for rank in range(2):
        progress = read_progress(store, rank)
        assert progress.last_resume["mode"] == "reshard"
        phases = progress.resume_phases
        assert phases["overlap"] is True and phases["state"] == "complete", phases
        assert phases["started"] <= phases["ready"] <= phases["optimizer_state"]


def test_fsdp_reshard_with_a_damaged_shard_stops_every_rank_and_both_fall_back(base, fsdp):
    """Rank 3's optimizer part of snapshot 4 damaged, read by the new rank 1 only:
    both ranks raise CorruptSnapshot at their first step with no weight moved, the
    whole snapshot is set aside, and the next start of both resumes from 2."""
    damaged = fsdp["damaged_file"]
    for rank in range(2):
        info = load_json(os.path.join(fsdp["damaged"], f"rank-{rank}.json"))
        refused = info["refused"]
        assert info["first_step"] == 4 and info["unchanged"], (rank, info)
        assert refused["type"] == "CorruptSnapshot" and refused["path"] == damaged, refused
        assert damaged in refused["message"]
        assert "No update was applied on any rank" in refused["message"]
        assert refused["message"].endswith("Restart the job")
    told = load_json(os.path.join(fsdp["damaged"], "rank-0.json"))["refused"]["message"]
    assert "failed on another rank (rank 1: " in told
    snapshots = os.listdir(os.path.join(base, "fsdp-damaged-root", FSDP_RUN, "snapshots"))
    assert "00000004" not in snapshots            # the whole global snapshot set aside
    assert [n for n in snapshots if n.startswith(".damaged-00000004-")]
    for rank in range(2):
        info = load_json(os.path.join(fsdp["fallback"], f"rank-{rank}.json"))
        assert info["first_step"] == 2, info
