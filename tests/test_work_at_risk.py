"""Work at risk and the snapshot cadence as status and watch show them: the updates
and the seconds of training since the newest committed snapshot, and the newest
"cadence" record's decision, read from real log records (never a tensor file)."""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from snapd import format as fmt, liveview, statelog
from snapd.cli import main
from snapd.commands.watch import format_record
from snapd.logwriter import LogWriter
from snapd.progress import read_progress
from snapd.remote import layout
from snapd.remote.layout import RemoteFile, RemoteRoot
from snapd.store import RunStore, SnapshotId

from snapd_client import Client

from helpers import small_model_and_opt, small_train_step, text_of

T0 = 1_800_000_000.0
STEP_S = 0.5                # seconds of training per step in these logs
DECISION = {"interval_s": 12.0, "interval_steps": 40, "bound": "overhead",
            "expected_loss_s": 7.5, "mtbf_s": 86400.0, "mtbf_from": "default"}


def at(step: int) -> float:
    return T0 + step * STEP_S


def step_record(step: int, t: float | None = None) -> dict:
    return {"kind": "step", "step": step, "time": at(step) if t is None else t,
            "cursor": None, "rng": {}, "scalars": {"loss": 1.0 / step}}


def cadence_record(step: int, **decision) -> dict:
    return {"kind": "cadence", "time": at(step), "step": step, **DECISION,
            "stall_s": 0.12, "step_s": STEP_S, **decision}


def snapshot_taken(log: LogWriter, store: RunStore, step: int, cadence: dict | None,
                   written_over: int = 0) -> None:
    """What the client logs of a snapshot at ``step``: "staged", its cadence record
    (under every="auto"), the steps trained while it is written, "committed"."""
    log.append({"kind": "snapshot", "event": "staged", "step": step, "time": at(step),
                "stall": 0.12})
    if cadence is not None:
        log.append(cadence)
    for later in range(step + 1, step + 1 + written_over):
        log.append(step_record(later))
    log.append({"kind": "snapshot", "event": "committed", "step": step,
                "time": at(step + written_over) + 0.1, "name": f"{step:08d}",
                "bytes": 1000, "seconds": 0.4})
    os.makedirs(store.snapshot_path(SnapshotId(0, step)))
    store.write_pointer("LATEST", SnapshotId(0, step))


def auto_run(root: str, run: str = "gpt", reached: int = 52) -> RunStore:
    """Steps 1..``reached``, snapshots at 20 and 40 under a cadence that changed its
    mind (every 20 by the writer bound, then every 40 by the overhead bound)."""
    store = RunStore(root, run)
    store.ensure()
    with LogWriter(store.path, 0, flush_interval=None) as log:
        for step in range(1, reached + 1):
            log.append(step_record(step))
            if step == 20:
                snapshot_taken(log, store, 20, cadence_record(
                    20, interval_s=10.0, interval_steps=20, bound="writer"))
            if step == 40:
                snapshot_taken(log, store, 40, cadence_record(40))
    return store


def invoke(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


# --- read_progress -----------------------------------------------------------------

def test_steps_and_seconds_at_risk_count_from_the_committed_step(tmp_path):
    progress = read_progress(auto_run(str(tmp_path)))
    assert progress.committed == SnapshotId(0, 40)
    assert progress.at_risk == 12
    assert progress.at_risk_seconds == pytest.approx(12 * STEP_S)
    assert progress.cadence == DECISION          # the newest record, its decision only


def test_nothing_at_risk_is_zero_seconds_and_no_cadence_is_none(tmp_path):
    store = RunStore(str(tmp_path), "plain")
    store.ensure()
    with LogWriter(store.path, 0, flush_interval=None) as log:
        for step in range(1, 31):
            log.append(step_record(step))
            if step % 10 == 0:
                snapshot_taken(log, store, step, cadence=None)
    progress = read_progress(store)
    assert (progress.at_risk, progress.at_risk_seconds, progress.cadence) == (0, 0.0, None)


def test_with_nothing_committed_everything_since_the_first_record_is_at_risk(tmp_path):
    store = RunStore(str(tmp_path), "young")
    store.ensure()
    with LogWriter(store.path, 0, flush_interval=None) as log:
        log.append({"kind": "cadence", "time": at(1), "step": 1, **DECISION,
                    "bound": "first"})
        for step in range(1, 9):
            log.append(step_record(step))
    progress = read_progress(store)
    assert progress.committed is None and progress.at_risk == 8
    assert progress.at_risk_seconds == pytest.approx(at(8) - at(1))
    assert progress.cadence["bound"] == "first"


def test_the_cadence_of_a_snapshot_still_being_written_is_the_current_one(tmp_path):
    """Taken at 60, not yet durable: the interval it was taken by is the one in force,
    while the work at risk still counts from 40, the newest committed snapshot."""
    store = auto_run(str(tmp_path), reached=60)
    with LogWriter(store.path, 0, flush_interval=None) as log:
        log.append({"kind": "snapshot", "event": "staged", "step": 60, "time": at(60)})
        log.append(cadence_record(60, interval_steps=20, interval_s=10.0, bound="max_loss"))
        for step in range(61, 64):
            log.append(step_record(step))
    progress = read_progress(store)
    assert progress.cadence["bound"] == "max_loss" and progress.cadence["interval_steps"] == 20
    assert progress.at_risk == 23
    assert progress.at_risk_seconds == pytest.approx(23 * STEP_S)


def test_a_resume_restarts_the_count_the_time_down_is_not_training(tmp_path):
    """Killed at 52 with 40 committed; resumed 1000 s later and recomputed 41..45."""
    store = auto_run(str(tmp_path))
    resumed_at = at(52) + 1000.0
    with LogWriter(store.path, 0, flush_interval=None) as log:
        log.append({"kind": "resume", "time": resumed_at, "step": 40,
                    "snapshot": "00000040", "mode": "resume", "reached": 52})
        for step in range(41, 46):
            log.append(step_record(step, resumed_at + (step - 40) * STEP_S))
    progress = read_progress(store)
    assert progress.at_risk == 5
    assert progress.at_risk_seconds == pytest.approx(5 * STEP_S)


def test_a_write_longer_than_the_walk_finds_the_step_by_bisection(tmp_path):
    """5000 steps trained while snapshot 100 was written: its own records lie further
    back than the walk goes past the commit record; the step's record is found."""
    store = RunStore(str(tmp_path), "slow")
    store.ensure()
    with LogWriter(store.path, 0, flush_interval=None) as log:
        for step in range(1, 101):
            log.append(step_record(step))
        snapshot_taken(log, store, 100, cadence_record(100), written_over=5000)
        for step in range(5101, 5111):
            log.append(step_record(step))
    progress = read_progress(store)
    assert progress.at_risk == 5010
    assert progress.at_risk_seconds == pytest.approx(5010 * STEP_S)
    assert progress.bytes_read < 1 << 20, progress.bytes_read


def test_a_hostile_cadence_record_reads_as_unknown_fields(tmp_path):
    store = RunStore(str(tmp_path), "odd")
    store.ensure()
    with LogWriter(store.path, 0, flush_interval=None) as log:
        log.append(step_record(1))
        log.append({"kind": "cadence", "time": at(1), "interval_steps": "40",
                    "interval_s": True, "bound": 3, "mtbf_s": 5.0, "mtbf_from": "option"})
    cadence = read_progress(store).cadence
    assert cadence == {"interval_s": None, "interval_steps": None, "bound": None,
                       "expected_loss_s": None, "mtbf_s": 5.0, "mtbf_from": "option"}
    assert liveview.cadence_text(cadence) == "every - (-, -)"


# --- status ------------------------------------------------------------------------

def test_status_json_and_table_show_the_risk_and_the_cadence(tmp_path):
    root = str(tmp_path)
    auto_run(root)
    (row,) = json.loads(invoke("status", root, "--json").output)["runs"]
    assert row["at_risk"] == 12 and row["at_risk_seconds"] == pytest.approx(6.0)
    assert row["cadence"] == DECISION
    text = invoke("status", root).output
    assert "12 (6.0s)" in text
    assert "every 40 (12s, overhead)" in text
    assert ("gpt r0: cadence every 40 steps (12s), set by the overhead bound; expected "
            "loss per failure 7.5s; MTBF 1.0d (default)") in text


def test_status_of_a_run_without_cadence_says_null_and_dash(tmp_path):
    root = str(tmp_path)
    store = RunStore(root, "plain")
    store.ensure()
    with LogWriter(store.path, 0, flush_interval=None) as log:
        for step in range(1, 16):
            log.append(step_record(step))
            if step == 10:
                snapshot_taken(log, store, 10, cadence=None)
    (row,) = json.loads(invoke("status", root, "--json").output)["runs"]
    assert row["cadence"] is None and row["at_risk_seconds"] == pytest.approx(2.5)
    text = invoke("status", root).output
    assert "5 (2.5s)" in text and "cadence every" not in text


# --- watch ---------------------------------------------------------------------------

def test_watch_model_and_view_show_the_risk_and_the_cadence(tmp_path):
    root = str(tmp_path)
    auto_run(root)
    model = liveview.collect(root, None, now=at(52) + 1)
    (row,) = model["runs"]
    assert row["at_risk"] == 12 and row["at_risk_seconds"] == pytest.approx(6.0)
    assert row["cadence"] == DECISION
    json.dumps(model)   # --json prints it as is
    text = text_of(liveview.render(model), 100)
    assert "12 (6.0s)" in text and "every 40 (12s, overhead)" in text
    assert "gpt r0: cadence every 40 steps (12s), set by the overhead bound" in text
    assert max(len(line) for line in text.splitlines()) <= 100


def test_watch_pipe_prints_a_line_per_cadence_record():
    line = format_record("gpt", 0, cadence_record(40))
    assert "run=gpt rank=0 cadence step=40 interval_s=12 interval_steps=40 " \
           "bound=overhead expected_loss_s=7.5 mtbf_s=8.64e+04 mtbf_from=default" in line


def test_watch_on_a_narrow_terminal_wraps_the_cadence_never_cuts_it(tmp_path):
    root = str(tmp_path)
    auto_run(root)
    text = text_of(liveview.render(liveview.collect(root, None, now=at(52) + 1), 80), 80)
    assert "overhead)" in text and "12 (6.0s)" in text and "1s ago" in text
    assert max(len(line) for line in text.splitlines()) <= 80


# --- behind a URL ------------------------------------------------------------------

def trained_and_uploaded(node: str, remote: RemoteRoot, steps: int, snapshot_at: tuple,
                         uploaded: str) -> None:
    """A real run (log() every step) whose remote holds only snapshot ``uploaded``
    (files, then its commit record, as the daemon uploads) and the whole log."""
    model, opt = small_model_and_opt()
    client = Client(node, "gpt", daemon=False)
    client.track(model=model, optimizer=opt)
    for step in range(1, steps + 1):
        client.log(step, loss=small_train_step(model, opt, step))
        if step in snapshot_at:
            client.snapshot(step).wait()
    client.close()
    store, sid = RunStore(node, "gpt"), SnapshotId.parse(uploaded)
    local, files = store.snapshot_path(sid), []
    for rel in sorted(os.listdir(local)):
        remote.fs.put_file(os.path.join(local, rel), remote.file_path("gpt", uploaded, rel))
        files.append(RemoteFile(rel, os.path.getsize(os.path.join(local, rel))))
    with open(os.path.join(local, fmt.MANIFEST_NAME), "rb") as f:
        record = layout.make_record("gpt", sid, 1, files, f.read())
    remote.write_record("gpt", uploaded, record)
    for seg in statelog.list_segments(store.path, 0):
        remote.fs.put_file(str(seg), f"{remote.log_path('gpt')}/{seg.parent.name}/{seg.name}")


def test_status_of_a_remote_root_measures_the_seconds_from_the_remote_commit(tmp_path):
    """The log knows snapshot 5; the remote holds only 3: a restore from there loses
    steps 4..6, and the seconds they took, read from the replicated log."""
    node, url = str(tmp_path / "node-a"), f"file://{tmp_path}/remote"
    trained_and_uploaded(node, RemoteRoot(url), steps=6, snapshot_at=(3, 5),
                         uploaded="00000003")
    log_dir = os.path.join(node, "gpt")
    took = statelog.find_step(log_dir, 0, 6)["time"] - statelog.find_step(log_dir, 0, 3)["time"]
    (local,) = json.loads(invoke("status", node, "--json").output)["runs"]
    assert (local["committed"], local["at_risk"]) == ("00000005", 1)
    (row,) = json.loads(invoke("status", url, "--json").output)["runs"]
    assert (row["committed"], row["at_risk"]) == ("00000003", 3)
    assert row["at_risk_seconds"] == pytest.approx(took)
