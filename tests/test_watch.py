"""snapd watch: the pure render of a status model, collect() on a real root, the line
printer of piped mode, the daemon probe against a fake daemon, and the refresh loop."""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import threading
import time

import pytest
from click.testing import CliRunner

from snapd import protocol as proto
from snapd import liveview as view
from snapd.cli import main
from snapd.commands.watch import (LogFollower, StepLimiter, format_record,
                                  lines_for_new_records)
from snapd.logwriter import LogWriter
from snapd.store import RunStore, SnapshotId

from helpers import text_of

T0 = 1_800_000_000.0   # a fixed clock for hand-built models and records


def run_row(**over):
    row = {"run": "gpt", "rank": 0, "error": None, "step": 1357, "steps_per_s": 12.5,
           "step_age_s": 1.0, "loss": 2.31, "losses": [3.0, 2.8, 2.9, 2.5, 2.4, 2.31],
           "at_risk": 57, "stall": {"last": 0.012, "p50": 0.015, "max": 0.25, "count": 9},
           "skipped": 3, "failed": 1, "records_read": 500,
           "last_committed": {"name": "00001300", "step": 1300, "bytes": 10**8,
                              "seconds": 1.5, "time": T0 - 42},
           "committed_age_s": 42.0, "last_resume": None, "last_replay": None,
           "retention": {"committed": 4, "tmp": 1, "latest": "00001300",
                         "best": "00001200"}}
    row.update(over)
    return row


def model(**over):
    m = {"root": "/ckpt", "time": T0, "disk": {"free": 120 * 10**9, "total": 500 * 10**9},
         "daemon": {"running": False, "answering": False, "pid": None},
         "runs": [run_row()], "in_flight": []}
    m.update(over)
    return m


# --- render ------------------------------------------------------------------------

def test_render_shows_progress_loss_snapshots_and_no_daemon():
    text = text_of(view.render(model(), 100))
    assert "gpt" in text and "1357" in text and "12.50" in text and "2.31" in text
    assert "▁" in text and "█" in text                      # the loss sparkline
    assert "00001300  42s ago" in text                      # last committed, its age
    assert "57" in text                                     # updates at risk
    assert "12/15/250 ms" in text                           # stall last/p50/max
    assert "3/1" in text                                    # skips/fails
    assert "00001200" in text                               # BEST
    assert "disk free 120.0 GB of 500.0 GB" in text
    assert "daemon: not running" in text
    assert "in flight: none" in text
    assert max(len(line) for line in text.splitlines()) <= 100


def test_render_in_flight_progress_bar_rate_and_eta():
    flight = view.flight_model({"run": "gpt", "rank": 0, "step": 1400,
                                "bytes_total": 200 * 10**6, "bytes_written": 126 * 10**6,
                                "accepted": T0 - 5, "started": T0 - 3}, T0)
    assert flight["fraction"] == pytest.approx(0.63)
    assert flight["mb_s"] == pytest.approx(42.0)
    assert flight["eta_s"] == pytest.approx(74 / 42)
    text = text_of(view.render(model(in_flight=[flight]), 100))
    assert "gpt r0 step 1400" in text
    assert "63%" in text and "126.0 MB / 200.0 MB" in text
    assert "42.0 MB/s" in text and "ETA 2s" in text
    assert "█" * 10 in text and "░" in text


def test_render_queued_snapshot_and_running_daemon():
    queued = view.flight_model({"run": "gpt", "rank": 1, "step": 1500, "bytes_total": 10,
                                "bytes_written": 0, "accepted": T0 - 4, "started": None}, T0)
    daemon = {"running": True, "answering": True, "pid": 4242, "cpu_percent": 3.5,
              "rss": 85 * 10**6, "started": T0 - 60, "clients": 2, "stopping": False}
    text = text_of(view.render(model(daemon=daemon, in_flight=[queued]), 100))
    assert "gpt r1 step 1500  queued 4s" in text
    assert "daemon pid 4242  cpu 3.5%  rss 85.0 MB  2 clients" in text


def test_render_daemon_not_answering_resume_and_empty_root():
    daemon = {"running": True, "answering": False, "pid": 77, "cpu_percent": None,
              "rss": None}
    row = run_row(last_resume={"snapshot": "00001200", "step": 1200, "mode": "resume",
                               "recompute": 100, "time": T0},
                  last_replay={"verdict": "match", "checked": 100, "step": 1300,
                               "cause": None}, stall=None, losses=[], loss=None)
    text = text_of(view.render(model(daemon=daemon, runs=[row]), 100))
    assert "daemon pid 77" in text and "not answering" in text
    assert "resumed from 00001200 (resume, 100 to recompute); replay match" in text
    assert "no runs under this root yet" in text_of(view.render(model(runs=[])))


def test_sparkline_scales_lowest_to_highest():
    assert view.sparkline([1, 2, 3, 4, 5, 6, 7, 8]) == "▁▂▃▄▅▆▇█"
    assert view.sparkline([5.0, 5.0]) == "▄▄"
    assert view.sparkline([1, float("nan"), 2]) == "▁█"
    assert view.sparkline(list(range(100)), points=10) == view.sparkline(range(90, 100))
    assert view.sparkline([]) == ""


# --- collect on a real root -----------------------------------------------------------

def build_root(root: str, run: str = "gpt", steps: int = 120) -> RunStore:
    store = RunStore(root, run)
    store.ensure()
    with LogWriter(store.path, 0, flush_interval=None) as log:
        for step in range(1, steps + 1):
            log.append({"kind": "step", "step": step, "time": T0 + step * 0.1,
                        "cursor": None, "rng": {}, "scalars": {"loss": 10.0 / step}})
            if step % 50 == 0:
                log.append({"kind": "snapshot", "event": "staged", "step": step,
                            "time": T0 + step * 0.1, "stall": step / 1000})
                log.append({"kind": "snapshot", "event": "committed", "step": step,
                            "time": T0 + step * 0.1 + 1, "name": f"{step:08d}",
                            "bytes": 1000, "seconds": 0.5, "rng": {"torch": b"x"}})
                os.makedirs(store.snapshot_path(SnapshotId(0, step)))
        log.append({"kind": "snapshot", "event": "skipped", "step": 110,
                    "time": T0 + 11.05})
    store.write_pointer("LATEST", SnapshotId(0, 100))
    store.write_pointer("BEST", SnapshotId(0, 50))
    return store


def test_collect_reads_logs_pointers_and_listing(root):
    build_root(root)
    os.makedirs(os.path.join(root, "gpt", "snapshots", ".tmp-00000150-ab"))
    m = view.collect(root, None, now=T0 + 20)
    assert m["root"] == root and m["in_flight"] == []
    assert m["daemon"] == {"running": False, "answering": False, "pid": None}
    assert m["disk"]["free"] > 0
    (row,) = m["runs"]
    assert (row["run"], row["rank"], row["step"], row["at_risk"]) == ("gpt", 0, 120, 20)
    assert row["loss"] == pytest.approx(10 / 120)
    assert len(row["losses"]) == view.SPARK_POINTS and row["losses"][-1] == row["loss"]
    assert row["steps_per_s"] == pytest.approx(10.0)
    assert row["last_committed"]["name"] == "00000100"
    assert row["committed_age_s"] == pytest.approx(20 - 11)
    assert row["stall"] == {"last": 0.1, "p50": pytest.approx(0.075), "max": 0.1, "count": 2}
    assert (row["skipped"], row["failed"]) == (1, 0)
    assert row["retention"] == {"committed": 2, "tmp": 1, "latest": "00000100",
                                "best": "00000050", "pinned": []}
    json.dumps(m)   # plain data: --json prints it as is
    assert "00000100" in text_of(view.render(m))


def test_cli_once_json_help_and_missing_root(root):
    build_root(root)
    runner = CliRunner()
    out = runner.invoke(main, ["watch", root, "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["runs"][0]["step"] == 120
    out = runner.invoke(main, ["watch", root, "--once"])
    assert out.exit_code == 0 and "00000100" in out.output and "daemon: not running" \
        in out.output
    missing = runner.invoke(main, ["watch", os.path.join(root, "nope"), "--once"])
    assert missing.exit_code == 2 and "no such directory" in missing.output
    helptext = runner.invoke(main, ["watch", "--help"]).output
    assert "Examples:" in helptext and "snapd watch /data/ckpt" in helptext


# --- piped mode ---------------------------------------------------------------------

def test_format_record_lines():
    when = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(T0))
    assert format_record("gpt", 0, {"kind": "step", "step": 1357, "time": T0,
                                    "scalars": {"lr": 0.001, "loss": 2.31}}) == \
        f"{when} run=gpt rank=0 step=1357 loss=2.31 lr=0.001"
    assert format_record("gpt", 1, {"kind": "snapshot", "event": "committed", "step": 1300,
                                    "time": T0, "name": "00001300", "bytes": 5000,
                                    "seconds": 1.25, "rng": {}}) == \
        f"{when} run=gpt rank=1 snapshot committed step=1300 name=00001300 bytes=5000 " \
        "seconds=1.25"
    assert format_record("gpt", 0, {"kind": "snapshot", "event": "failed", "step": 9,
                                    "time": T0, "error": "disk full"}).endswith(
        'snapshot failed step=9 error="disk full"')
    assert format_record("gpt", 0, {"kind": "replay", "verdict": "diverged", "from": 5,
                                    "to": 9, "checked": 2, "step": 7, "cause": "rng:torch",
                                    "time": T0}).endswith(
        "replay verdict=diverged from=5 to=9 checked=2 step=7 cause=rng:torch")
    assert "resume step=1200 snapshot=00001200 mode=resume" in format_record(
        "gpt", 0, {"kind": "resume", "step": 1200, "snapshot": "00001200",
                   "mode": "resume", "time": T0})
    assert format_record("gpt", 0, {"kind": "restored", "objects": ["optimizer"],
                                    "waited_s": 0.25, "time": T0}).endswith(
        "restored objects=optimizer waited_s=0.25")
    assert format_record("gpt", 1, {"kind": "set_aside", "snapshot": "00000006", "by": 1,
                                    "said": "...", "time": T0}).endswith(
        "rank=1 set_aside snapshot=00000006 by=1")
    assert format_record("gpt", 0, {"kind": "mystery"}) is None


def test_step_lines_at_most_one_per_second_per_run():
    limiter = StepLimiter()
    steps = [("gpt", 0, {"kind": "step", "step": i, "time": T0 + i * 0.1, "scalars": {}})
             for i in range(30)] + \
            [("bert", 0, {"kind": "step", "step": 1, "time": T0 + 0.05, "scalars": {}})]
    lines = lines_for_new_records(sorted(steps, key=lambda s: s[2]["time"]), limiter)
    gpt = [line for line in lines if "run=gpt" in line]
    assert [int(line.rsplit("step=", 1)[1].split()[0]) for line in gpt] == [0, 10, 20]
    assert sum("run=bert" in line for line in lines) == 1
    assert limiter.flush(T0 + 2.5) == []           # step 29 is held back ...
    (late,) = limiter.flush(T0 + 3.1)              # ... and printed in its turn
    assert "step=29 " in late + " "


def test_follower_prints_a_backlog_then_only_new_records(root):
    store = build_root(root)
    follower = LogFollower(root)
    first = lines_for_new_records(follower.poll(), StepLimiter())
    assert any("snapshot committed step=100 name=00000100" in line for line in first)
    assert any("snapshot skipped step=110" in line for line in first)
    assert sum(" step=120 loss=" in line for line in first) == 1   # only the newest step
    assert follower.poll() == []
    with LogWriter(store.path, 0, flush_interval=None) as log:
        log.append({"kind": "step", "step": 121, "time": T0 + 30, "scalars": {"loss": 1.0}})
        log.append({"kind": "snapshot", "event": "committed", "step": 121,
                    "time": T0 + 30.5, "name": "00000121", "bytes": 1, "seconds": 0.1})
    lines = lines_for_new_records(follower.poll(), StepLimiter())
    assert len(lines) == 2 and "step=121 loss=1" in lines[0]
    assert "snapshot committed step=121 name=00000121" in lines[1]


# --- the daemon probe and the refresh loop ----------------------------------------------

def test_probe_skips_events_and_reconnects_after_the_daemon_goes():
    base = tempfile.mkdtemp(prefix="sdw-", dir="/tmp")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(os.path.join(base, view.SOCKET_NAME))
    listener.listen(1)

    def fake_daemon():
        conn, _ = listener.accept()
        with conn:
            hello = proto.recv(conn)
            assert hello["op"] == "hello" and hello["run"] == "" and hello["rank"] == 0
            proto.send(conn, proto.Welcome(1, 4242, base), re=hello["id"])
            request = proto.recv(conn)
            proto.send(conn, proto.Committed("gpt", 0, 5, 0, "00000005", 1, 0.1))  # event
            proto.send(conn, proto.StatusReply({"pid": 4242, "in_flight": []}),
                       re=request["id"])

    thread = threading.Thread(target=fake_daemon, daemon=True)
    thread.start()
    probe = view.DaemonProbe(base)
    try:
        assert probe.status() == {"pid": 4242, "in_flight": []}
        thread.join(5)
        listener.close()
        os.unlink(os.path.join(base, view.SOCKET_NAME))
        assert probe.status() is None        # gone: "daemon: not running", no raise
        assert probe.status() is None        # and no daemon is started
        assert not os.path.exists(os.path.join(base, view.SOCKET_NAME))
    finally:
        probe.close()
        shutil.rmtree(base)


def test_refresh_loop_wakes_on_a_file_change(root):
    ticks = []

    def tick(status, mode):
        ticks.append((time.monotonic(), status, mode))
        if len(ticks) == 1:   # the observer is watching by now: the change wakes the loop
            open(os.path.join(root, "LATEST"), "w").close()
        return len(ticks) < 2

    started = time.monotonic()
    # no debounce: the one change is the whole burst, and its wake is what is tested
    view.refresh_loop(root, tick, interval=120.0, debounce=0.0, min_gap=0.0)
    assert ticks[0][1] is None and ticks[0][2] == "events"
    assert ticks[1][0] - started < 60.0     # woken by the event, not the 120 s interval
