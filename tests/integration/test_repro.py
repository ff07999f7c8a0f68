"""snapd repro: a logged step recomputed from the snapshot before it by the run's own,
unchanged training command (tests/trainer.py), checked against the log, its state
written to a new run, and nothing of the original run touched.

Three runs of 60 steps with a snapshot every 20, through the daemon, trained side by
side: "r" with keep_last=3, whose trainer dumps the state after step 37 as a side
channel (``dump_at``); "nan", whose weights turn NaN at step 45 (``nan_at``), with
keep_last=1, dumping the state after step 44; and "live", r's twin, which waits after
step 40 (``gate_at``) while it is reproduced, then trains on. ``snapd repro`` runs as
the real command line, starting the trainer as its own process; the reproductions run
side by side too."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from helpers import stop_daemons_under, wait_until

from snapd import pins, statelog
from snapd.cli import main
from snapd.reader import SnapshotReader
from snapd.store import RunStore, SnapshotId

pytestmark = pytest.mark.integration

TRAINER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "trainer.py")
DAEMON_ENV = {k: v for k, v in os.environ.items() if k != "SNAPD_DAEMON"}


def start_repro(root, *args, cfg):
    """``snapd repro ROOT ARGS -- python trainer.py CFG``, started."""
    return subprocess.Popen([sys.executable, "-m", "snapd", "repro", root, *args, "--",
                             sys.executable, TRAINER, json.dumps(cfg)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=DAEMON_ENV)


def files_of(path):
    """Every regular file under ``path`` (a root: its runs' files; the daemon's socket
    and lock file aside): its relative name -> digest of its bytes."""
    found = {}
    for folder, _dirs, names in os.walk(path):
        for name in names:
            full = os.path.join(folder, name)
            if folder == path and name.startswith(".") or not os.path.isfile(full):
                continue
            with open(full, "rb") as f:
                found[os.path.relpath(full, path)] = hashlib.sha256(f.read()).hexdigest()
    return found


def dumped(path):
    with np.load(path, allow_pickle=False) as arrays:
        return {k: arrays[k].tobytes() for k in arrays.files}


def snapshot_tensors(path):
    """Each tracked object's tensors, keyed as tests/trainer.py's dump_state keys them."""
    reader = SnapshotReader(path)
    return reader, {f"{name}/{i}": t.contiguous().reshape(-1).view(torch.uint8).numpy()
                    .tobytes()
                    for name in ("model", "optimizer", "scheduler")
                    for i, t in enumerate(reader.load_object(name))}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, warm):
    """(root, {run: its config}), both runs trained to the end."""
    base = tmp_path_factory.mktemp("repro")
    root = str(base / "root")
    common = {"root": root, "model": "momentum", "steps": 60, "snapshot_at": [20, 40, 60]}
    cfgs = {"r": {**common, "run": "r", "options": {"keep_last": 3}, "dump_at": 37},
            "nan": {**common, "run": "nan", "options": {"keep_last": 1}, "dump_at": 44,
                    "nan_at": 45},
            "live": {**common, "run": "live", "options": {"keep_last": 3}, "gate_at": 40,
                     "gate": str(base / "gate")}}
    for run, cfg in cfgs.items():
        cfg.update(out=str(base / f"{run}.json"), dump=str(base / f"{run}.npz"))
    started = {}
    try:
        for run, cfg in cfgs.items():
            log = base / f"{run}.log"
            started[run] = (warm["first"].start(TRAINER, [json.dumps(cfg)], DAEMON_ENV,
                                                 str(log)), log)
        for run in ("r", "nan"):
            proc, log = started[run]
            assert proc.wait(timeout=240) == 0, log.read_text()[-3000:]
        proc, log = started["live"]
        wait_until(lambda: os.path.exists(cfgs["live"]["gate"] + ".reached")
                   or proc.poll() is not None, 240, "the live run at its gate")
        assert proc.poll() is None, log.read_text()[-3000:]
        yield root, cfgs, started["live"]
    finally:
        for proc, _log in started.values():
            proc.kill()
            proc.wait()
        stop_daemons_under(root)


def settled(root):
    """The files of the root that no one writes while the live run waits at its gate:
    all but the live run's log (its flush thread may still add a sync mark)."""
    return {k: v for k, v in files_of(root).items()
            if not k.startswith(os.path.join("live", "log"))}


@pytest.fixture(scope="module")
def repros(trained):
    """The four reproductions, side by side (each reads its run only), while the live
    run waits at its gate: name -> (exit code, stdout, stderr); the settled files of
    the root before and after them; then the live run let go, to its end."""
    root, cfgs, (live, live_log) = trained
    before = settled(root)
    dumps = {run: os.path.getsize(cfg["dump"]) for run, cfg in cfgs.items()
             if run != "live"}
    changed = {**cfgs["r"], "perturb_from": 30, "dump": cfgs["r"]["dump"] + ".unused.npz"}
    started = {"r@37": start_repro(root, "r@37", cfg=cfgs["r"]),   # the run's own command
               "changed": start_repro(root, "r@38", cfg=changed),
               "anomaly": start_repro(root, "nan@anomaly", "--before", cfg=cfgs["nan"]),
               "live@37": start_repro(root, "live@37", "--steps", "2", cfg=cfgs["live"])}
    done = {}
    try:
        for name, proc in started.items():
            out, err = proc.communicate(timeout=300)
            done[name] = (proc.returncode, out, err)
    finally:
        for proc in started.values():
            proc.kill()
            proc.wait()
    after = settled(root)
    open(cfgs["live"]["gate"], "w").close()   # the live run trains on, to step 60
    assert live.wait(timeout=240) == 0, live_log.read_text()[-3000:]
    yield done, before, after, dumps


def test_repro_37_writes_the_state_the_run_had_after_37(trained, repros):
    root, cfgs, _live = trained
    cfg = cfgs["r"]
    done, before, after, dumps = repros
    code, out, err = done["r@37"]
    assert code == 0, err[-3000:]
    snapshot = os.path.join(root, "r.repro-37", "snapshots", "00000037")
    assert out.splitlines() == [
        "repro of r@37",
        "  started from: snapshot 00000020 (step 20)",
        "  recomputed: 17 steps, 17 checked against the log, all matched",
        "  step 37 consumed: epoch 9 batch 0",   # 4 batches an epoch: the 37th batch
        f"  state after step 37: run r.repro-37, {snapshot}"]

    # The original runs' files are byte for byte what they were (nothing else was
    # added to the root but the reproductions' runs), and the command ended at step
    # 37: it did not reach its own dump again.
    assert {k: v for k, v in after.items() if ".repro-" not in k} == before
    assert {k.split(os.sep)[0] for k in after if ".repro-" in k} == \
        {"r.repro-37", "nan.repro-45-before", "live.repro-37"}
    assert {run: os.path.getsize(cfgs[run]["dump"]) for run in dumps} == dumps

    reader, tensors = snapshot_tensors(snapshot)
    assert tensors == dumped(cfg["dump"])
    assert reader.manifest["step"] == 37 and reader.manifest["cursor"]["epoch"] == 9
    assert reader.manifest["lineage"] == {
        "id": 0, "mode": "repro", "parent": {"run": "r", "snapshot": "00000020", "step": 20}}


def test_a_changed_script_diverges_naming_step_and_field_and_writes_nothing(trained,
                                                                            repros):
    root = trained[0]
    code, out, err = repros[0]["changed"]
    assert code == 1 and out == ""
    assert "snapd: error: ReplayDivergence: repro of run r: step 30 differs from the " \
           "run's log: loss was" in err, err[-3000:]
    assert "(cause scalar:loss); nothing was written" in err
    assert not os.path.exists(os.path.join(root, "r.repro-38"))


def test_nan_at_45_kept_40_pinned_and_repro_anomaly_before_gives_its_input(trained,
                                                                            repros):
    root, cfgs, _live = trained
    cfg = cfgs["nan"]
    store = RunStore(root, "nan")
    # keep_last=1 would have left 60 alone: 40, before the NaN, is pinned
    assert [s.name for s in store.committed()] == ["00000040", "00000060"]
    assert pins.pinned(store.path) == [SnapshotId(0, 40)]

    code, out, err = repros[0]["anomaly"]
    assert code == 0, err[-3000:]
    snapshot = os.path.join(root, "nan.repro-45-before", "snapshots", "00000044")
    assert out.splitlines() == [
        "repro of nan@45 --before (the anomaly: nonfinite:loss, value nan)",
        "  started from: snapshot 00000040 (step 40)",
        "  recomputed: 4 steps, 4 checked against the log, all matched",
        "  step 45 consumed: epoch 11 batch 0",
        f"  state before step 45's update (after step 44): run nan.repro-45-before, "
        f"{snapshot}"]
    _reader, tensors = snapshot_tensors(snapshot)
    assert tensors == dumped(cfg["dump"])   # the state step 45's batch met


def step_records(root, run):
    """What a run's log says of each step, and the kinds of its other records, in
    order (times aside)."""
    return [(r["kind"], r.get("step"), r.get("cursor"), r.get("rng"), r.get("scalars"))
            if r["kind"] == "step" else (r["kind"], r.get("event"), r.get("step"))
            for r in statelog.read_records(os.path.join(root, run), 0)]


def test_a_live_run_reproduced_meanwhile_is_untouched_and_trains_on_exactly(trained,
                                                                           repros):
    """live@37 --steps 2 while the live run waited after step 40 (its snapshots 20
    and 40 committed): the states after 37 (the same as r@37's) and 38, the live run's
    files unchanged by it, and the live run, let go, ends as its twin r did, its log
    holding its own records only."""
    root, cfgs, _live = trained
    code, out, err = repros[0]["live@37"]
    assert code == 0, err[-3000:]
    written = os.path.join(root, "live.repro-37", "snapshots")
    assert out.splitlines()[2:] == [
        "  recomputed: 18 steps, 18 checked against the log, all matched",
        "  step 37 consumed: epoch 9 batch 0",
        f"  states after steps 37 to 38: run live.repro-37, {written}/ (00000037, 00000038)"]
    _reader, tensors = snapshot_tensors(os.path.join(written, "00000037"))
    assert tensors == dumped(cfgs["r"]["dump"])
    assert SnapshotReader(os.path.join(written, "00000038")).manifest["step"] == 38
    with open(cfgs["live"]["out"]) as f_live, open(cfgs["r"]["out"]) as f_r:
        live, twin = json.load(f_live), json.load(f_r)
    assert live["trace"] == twin["trace"] and live["final"] == twin["final"]
    assert step_records(root, "live") == step_records(root, "r")


def test_a_command_that_stops_before_the_step_fails_naming_its_exit_code(trained):
    """nan@anomaly names step 45; a command that never logs it is reported."""
    result = CliRunner().invoke(main, ["repro", trained[0], "nan@anomaly", "--",
                                       sys.executable, "-c", "raise SystemExit(3)"])
    assert result.exit_code == 1
    assert "repro of nan@45: the command exited with code 3 before reaching step 45" \
        in result.output, result.output
