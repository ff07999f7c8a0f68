"""scripts/bench_frameworks.py on a tiny state, in this process: each way of each
framework's stock loop (scripts/stock_loops.py; snapd without a daemon, as no process
may start here), then the figures and the section made of them. Not a timing
assertion: each figure is there, counts what it says, and lies in its range."""

import math
import os
import sys

import pytest

pytest.importorskip("lightning.pytorch")
pytest.importorskip("transformers")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts"))
import bench_frameworks as bf  # noqa: E402  (a script, not a package)
import benchlib  # noqa: E402
from stock_loops import WAYS, run_way  # noqa: E402

# 5 steps, a checkpoint every 2: checkpoints at 2 and 4, the window from the start of
# step 3 to the start of step 5 holds the one of step 4.
TINY = ["--size", "200K", "--every", "2", "--steps", "5", "--rounds", "1",
        "--width", "32", "--batch", "2", "--seq", "8", "--vocab", "32",
        "--copy-reps", "1", "--no-probe"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One round of every way of both frameworks, run as a child would run it."""
    args = bf.parse(TINY)
    base = str(tmp_path_factory.mktemp("fw"))
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        # the reference copy's 50 ms of matmuls before it set a benchmark's conditions;
        # here the copy is timed and counted, not compared
        mp.setattr(benchlib, "train_briefly", lambda seconds=0.05: None)
        for framework in args.frameworks:
            ways = {}
            for way in bf.order(0):
                cfg = bf.child_config(args, framework, way, base, 0)
                cfg["client"]["daemon"] = False   # no daemon process in this lane
                ways[way] = run_way(cfg)
            out[framework] = [ways]
    return args, out


def test_each_way_trains_every_step_and_checkpoints_as_it_says(runs):
    args, out = runs
    for framework, (ways,) in out.items():
        for way, res in ways.items():
            where = f"{framework}/{way}"
            assert res["framework"] == framework and res["way"] == way
            assert res["global_step"] == 5, where
            assert res["state_bytes"] >= args.size, where   # weights + both moments
            assert res["window"] == [3, 5], where
            assert len(res["step_times"]) == 4 and min(res["step_times"]) > 0, where
            assert res["window_s"] == pytest.approx(sum(res["step_times"][2:4]))
            assert 0 < res["window_s"] < res["fit_s"], where
            assert len(res["copy_s"]) == 1 and min(res["copy_s"]) > 0, where
            assert res["trainer_cpu_s"] > 0 and res["daemon_cpu_s"] is None, where
        assert ways["none"]["saves"] == [] and ways["snapd"]["saves"] == []
        # the Trainer saves at the last step too, whatever save_steps says
        assert ways["own"]["saves"] == ([2, 4] if framework == "lightning" else [2, 4, 5])
        assert ways["none"]["snapshots"] == ways["own"]["snapshots"] == []
        snaps = ways["snapd"]["snapshots"]
        assert [s["step"] for s in snaps] == [2, 4], framework
        assert all(s["stall_s"] > 0 and s["waited_s"] >= 0 for s in snaps)
        # each staged during its step, durable after (written in-process: before the
        # call returned), on the clock the steps are stamped with
        walls = dict(zip(ways["snapd"]["stamped"], ways["snapd"]["step_walls"]))
        for snap in snaps:
            assert walls[snap["step"]] < snap["staged_at"] <= walls[snap["step"] + 1]
            assert snap["durable_at"] is not None
            assert snap["staged_at"] - snap["stall_s"] <= snap["durable_at"]
        assert len({ways[w]["state_bytes"] for w in WAYS}) == 1   # the same model


def test_the_summary_and_its_section_hold_every_figure(runs):
    args, out = runs
    info = benchlib.start_run(probe=False)
    benchlib.end_run(info, "bench_frameworks.py", TINY, probe=False)
    summary = {fw: bf.summarize(rounds) for fw, rounds in out.items()}
    for framework, s in summary.items():
        assert s["rounds"] == 1 and s["in_window"] == 1 and s["saves_in_window"] == 1
        assert s["snapshots"] == [2, 4]
        for group in ("fit_s", "window_s", "trainer_cpu_s"):
            assert set(s[group]) == set(WAYS) and min(s[group].values()) > 0
        assert s["daemon_cpu_per_snapshot_s"] is None   # no daemon in this lane
        for group in ("fit_ratio", "window_ratio"):
            assert min(s[group].values()) > 0
            assert s[group]["snapd"] == pytest.approx(
                s[group.replace("ratio", "s")]["snapd"] / s[group.replace("ratio", "s")]["none"])
        (ways,) = out[framework]
        assert s["snapd_per_snapshot_s"] == pytest.approx(
            ways["snapd"]["window_s"] - ways["none"]["window_s"])
        assert s["own_per_checkpoint_s"] == pytest.approx(
            ways["own"]["window_s"] - ways["none"]["window_s"])
        for key in ("stall_s", "first_stall_s", "copy_s", "step_s"):
            assert s[key] > 0, (framework, key)
        assert math.isfinite(s["overhead_vs_copy"])
        # a window of one step, the snapshot's: no calm step to judge it against
        assert s["in_run_per_snapshot_s"] is None and s["target_by"] == "between"
        assert s["target_met"] is (s["overhead_vs_copy"] <= bf.TARGET)
    config = {k: getattr(args, k) for k in ("size", "every", "steps", "rounds", "threads",
                                            "mode", "batch", "seq", "vocab", "width")}
    text = bf.report({"machine": info, "config": config, "summary": summary})
    assert text.startswith(bf.SECTION)
    assert "the start of step 3 to the start of step 5" in text
    for framework, s in summary.items():
        row = next(line for line in text.splitlines()
                   if line.startswith(f"| {bf.LABEL[framework]} | {bf.OWN[framework]}"))
        assert row.endswith("| pass |" if s["target_met"] else "| **fail** |")
        assert f"{s['overhead_vs_copy']:.2f}× / –" in row


def test_a_failed_way_leaves_its_round_out_and_the_error_is_reported():
    ok = {"fit_s": 2.0, "window_s": 1.0, "step_s": 0.5, "window": [3, 5], "saves": [],
          "snapshots": [], "copy_s": [0.1], "state_bytes": 10, "layers": 1,
          "trainer_cpu_s": 0.9, "daemon_cpu_s": None}
    failed = [{"none": ok, "own": {**ok, "saves": [2, 4]}, "snapd": {"error": "exit 1: boom"}}]
    assert bf.summarize(failed) == {"error": "exit 1: boom"}
    stamps = run_of([0.5, 0.5, 0.65, 0.65], [(2, 0.5, 0.6), (4, 0.25, 0.6)])
    stamps["snapshots"][1]["waited_s"] = 0.01
    snapd = {**ok, "window_s": 1.3, "fit_s": 3.0, "copy_s": [0.2, 0.4, 0.3],
             "daemon_cpu_s": 0.125, **stamps}
    s = bf.summarize(failed + [{"none": ok, "own": {**ok, "window_s": 3.0, "saves": [2, 4]},
                                "snapd": snapd}])
    assert s["rounds"] == 1
    assert s["snapd_per_snapshot_s"] == pytest.approx(0.3)   # 1.3 - 1.0, one in window
    assert s["own_per_checkpoint_s"] == pytest.approx(2.0)
    assert s["copy_s"] == pytest.approx(0.3) and s["overhead_vs_copy"] == pytest.approx(1.0)
    assert s["stall_s"] == 0.25 and s["first_stall_s"] == 0.5 and s["waited_s"] == 0.01
    assert s["target_met"] is True and s["daemon_cpu_per_snapshot_s"] == 0.125
    assert s["in_run_per_snapshot_s"] is None and s["target_by"] == "between"
    assert s["trainer_cpu_s"] == {"none": 0.9, "own": 0.9, "snapd": 0.9}
    assert s["window_ratio"] == pytest.approx({"own": 3.0, "snapd": 1.3})


def run_of(times, snaps):
    """A snapd way's stamps: steps 1.. taking ``times``, starting at wall time 100."""
    walls = [100.0]
    for t in times:
        walls.append(walls[-1] + t)
    return {"stamped": list(range(1, len(times) + 2)), "step_walls": walls,
            "step_times": list(times),
            "snapshots": [{"step": s, "stall_s": stall, "waited_s": 0.0,
                           "staged_at": walls[s - 1] + 0.9 * times[s - 1],
                           "durable_at": None if d is None else walls[s - 1] + d}
                          for s, stall, d in snaps]}


def test_in_run_overhead_sets_the_window_against_its_own_calm_steps():
    # Steps of 1 s; snapshots at steps 4 and 8 (window 5..13): each adds 0.3 s to its
    # own step and 0.2 s to the next, and is durable 1.5 s after its step began, in
    # the next step, whose end is within the one-step guard.
    times = [1.0] * 12
    for s in (4, 8):
        times[s - 1] += 0.3
        times[s] += 0.2
    run = run_of(times, [(4, 0.3, 1.5), (8, 0.3, 1.5)])
    got = bf.in_run_overhead(run, [5, 13])
    # Window steps 5..12; disturbed: 5 (step 4's write), 8 and 9; calm: 6, 7, 10-12
    assert got["calm_steps"] == 5
    # step 5's 0.2 s (step 4's write, before the window) counts as the window's, and
    # step 8's snapshot is the one in it, as between runs
    assert got["per_snapshot_s"] == pytest.approx(0.2 + 0.3 + 0.2)
    # A snapshot never committed disturbs every step after it: no calm step is left.
    never = run_of(times, [(4, 0.3, 1.5), (8, 0.3, None)])
    assert bf.in_run_overhead(never, [9, 13]) == {"per_snapshot_s": None, "calm_steps": 0}
    # Noise that is not a snapshot's does not count against it: a slow calm step
    # raises the baseline, and the overhead falls.
    slow = list(times)
    slow[10] += 0.6
    assert bf.in_run_overhead(run_of(slow, [(4, 0.3, 1.5), (8, 0.3, 1.5)]),
                              [5, 13])["per_snapshot_s"] == pytest.approx(0.7 + 0.6 - 8 * 0.6 / 5)


def test_rounds_alternate_and_the_window_needs_a_checkpoint_after_the_first():
    assert bf.order(0) == WAYS and bf.order(1) == tuple(reversed(WAYS))
    assert bf.window(5, 41) == (6, 41) and bf.window(10, 45) == (11, 41)
    with pytest.raises(SystemExit):
        bf.parse(["--every", "10", "--steps", "20"])
    with pytest.raises(SystemExit):
        bf.parse(["--frameworks", "keras"])
