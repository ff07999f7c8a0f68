"""scripts/bench_resume.py's figures, from given processes' figures: the medians, the
ratios its goals are set on, the cold restore against each method's own raw read, the
target rows and the section. (The processes themselves: ``--quick``.)"""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts"))
import bench_resume as br  # noqa: E402  (scripts, not a package)


def proc(ready, first, raw=None, digest="same", **extra):
    """One restarted process's figures."""
    out = {"ready_s": ready, "first_update_s": first, "forward_backward_s": 0.2,
           "step_s": 0.1, "digest": digest, **extra}
    if raw is not None:
        out["paired_direct_s"] = raw
    return out


def size_run(hot=None, cold=None):
    """A size's run: every method once hot and once cold, ``hot``/``cold`` replacing."""
    base = {"snapd_overlap": [proc(0.3, 0.6, 0.5)], "snapd": [proc(0.8, 1.0, 0.5)],
            "torch_load": [proc(1.1, 1.2, 0.5)], "dcp_load": [proc(1.4, 1.5, 0.6)]}
    return {"saved": {"digest": "same"},
            "runs": {"hot": {**base, **(hot or {})}, "cold": {**base, **(cold or {})}}}


def test_first_update_is_set_against_no_overlap_and_the_faster_peer():
    fig = br.figures(size_run())
    cold = fig["ratios"]["cold"]
    assert cold["vs_plain"] == pytest.approx(0.6)        # 0.6 / 1.0
    assert cold["peer"] == "torch_load"                  # 1.2 < dcp's 1.5
    assert cold["vs_peer"] == pytest.approx(0.5)         # 0.6 / 1.2
    assert cold["ready"] == pytest.approx(0.375)         # 0.3 / snapd's full 0.8
    faster_dcp = br.figures(size_run(cold={"torch_load": [proc(1.1, 2.0, 0.5)]}))
    assert faster_dcp["ratios"]["cold"]["peer"] == "dcp_load"
    assert faster_dcp["ratios"]["cold"]["vs_peer"] == pytest.approx(0.4)   # 0.6 / 1.5


def test_medians_leave_out_the_processes_that_failed_and_name_them():
    runs = size_run(cold={"snapd": [proc(0.7, 0.9), proc(0.8, 1.0), proc(0.9, 3.0),
                                    {"error": "exit 1: boom"}]})
    fig = br.figures(runs)
    assert fig["medians"]["cold"]["snapd"]["first_update_s"] == pytest.approx(1.0)
    assert fig["medians"]["cold"]["snapd"]["ready_s"] == pytest.approx(0.8)
    assert fig["errors"] == ["snapd (cold)"]
    assert fig["medians"]["hot"]["snapd"]["paired_direct_s"] == pytest.approx(0.5)


def test_a_process_that_ends_its_first_update_elsewhere_is_named():
    fig = br.figures(size_run(hot={"dcp_load": [proc(1.4, 1.5, digest="other")]}))
    assert fig["digest_differs"] == ["dcp_load (hot)"]
    assert br.figures(size_run())["digest_differs"] == []


def test_cold_restore_is_each_full_restore_over_its_own_raw_read():
    raw = br.figures(size_run())["cold_raw"]
    assert set(raw) == {"snapd", "torch_load", "dcp_load"}   # overlap's is not a full one
    assert raw["snapd"] == pytest.approx((0.8, 0.5, 1.6))
    assert raw["torch_load"] == pytest.approx((1.1, 0.5, 2.2))
    assert raw["dcp_load"] == pytest.approx((1.4, 0.6, 1.4 / 0.6))
    # A method with no raw read of its own is left out, not set against another's.
    no_raw = br.figures(size_run(cold={"dcp_load": [proc(1.4, 1.5)]}))["cold_raw"]
    assert set(no_raw) == {"snapd", "torch_load"}


@pytest.mark.parametrize("snapd_ready,ok", [(0.80, True), (0.81, False)])
def test_snapd_against_the_best_peers_own_ratio_may_be_at_most_1_1(snapd_ready, ok):
    # the best peer: torch 1.1 / 0.5 = 2.2; dcp 1.4 / 0.6 = 2.33. 1.1 × 2.2 = 2.42
    raw = {"snapd": (snapd_ready * 1.5, 0.5, snapd_ready * 3.0),
           "torch_load": (1.1, 0.5, 2.2), "dcp_load": (1.4, 0.6, 1.4 / 0.6)}
    row = br.raw_target("1G", raw)
    assert row["ok"] is ok and row["ratio"] == pytest.approx(snapd_ready * 3.0 / 2.2)
    assert "(torch.load + load_state_dict)" in row["id"]
    assert br.raw_target("1G", {"snapd": (1, 1, 1)}) is None


def test_the_targets_of_a_size_in_order_with_their_limits():
    rows = br.size_targets("1G", br.figures(size_run()))
    assert [(r["id"], r["ok"]) for r in rows] == [
        ("overlap first update ≤ 0.75× without overlap, cold", True),       # 0.60
        ("overlap first update ≤ 0.6× the faster peer's "
         "(torch.load + load_state_dict), cold", True),                        # 0.50
        ("overlap ready ≤ 0.45× the full restore (snapd), hot", True),        # 0.375
        ("overlap ready ≤ 0.45× the full restore (snapd), cold", True),
        ("snapd cold restore / own raw read ≤ 1.1× the best peer's "
         "(torch.load + load_state_dict)", True)]                              # 1.6 / 2.2
    assert rows[0]["measured"] == "0.60× (600 ms vs 1.00 s)"
    slow = br.size_targets("1G", br.figures(size_run(
        cold={"snapd_overlap": [proc(0.5, 0.9, 0.5)]})))
    assert [r["ok"] for r in slow[:2]] == [False, False]   # 0.90 and 0.75


def test_a_figure_not_measured_gives_no_row():
    fig = br.figures(size_run(cold={"snapd_overlap": [{"error": "exit 1"}]}))
    ids = [r["id"] for r in br.size_targets("2G", fig)]
    assert not any("cold" in i and "overlap" in i for i in ids)
    assert "overlap ready ≤ 0.45× the full restore (snapd), hot" in ids


MACHINE = {"date": "2026-12-03 17:00 UTC", "command": ".venv/bin/python "
           "scripts/bench_resume.py", "nproc": 2, "cpu": "cpu", "mem_total": 1 << 34,
           "python": "3.11", "torch": "2", "kernel": "6", "tmp_disk": "disk",
           "load_before": (1.0, 1.0, 1.0), "load_after": (1.0, 1.0, 1.0),
           "elapsed_s": 600}


def test_the_section_shows_every_method_every_target_and_the_state_check():
    sizes = {"1G": size_run(), "2G": size_run(cold={"dcp_load": [{"error": "exit 1"}]})}
    data = {"machine": MACHINE, "config": {"batch": 64, "threads": 2, "reps": 3},
            "figures": {s: br.figures(r) for s, r in sizes.items()}}
    text = br.report(data)
    assert text.startswith(br.SECTION + "\n")
    assert "| 1G | snapd, restore(overlap=True) | 300 ms | 600 ms | 300 ms | 600 ms | " \
           "500 ms |" in text
    assert "| 2G | dcp.load | 1.40 s | 1.50 s | – | – | – |" in text
    assert text.count("| overlap first update ≤ 0.75× without overlap, cold |") == 2
    assert ("- 1G: every process (8) ended its first update with the save process's "
            "state") in text
    assert "- 2G: **failed**: dcp_load (cold) (see the JSON)." in text


def test_quick_is_one_small_state_once():
    quick = br.parse(["--quick"])
    assert (quick.sizes, quick.reps) == (["32M"], 1)
    full = br.parse([])
    assert (full.sizes, full.reps, full.batch) == (["1G", "2G"], 3, 64)


def test_a_failed_save_is_said_and_no_state_is_claimed_checked():
    failed = {"saved": {"error": "exit 1: no space left on device"},
              "runs": {t: {m: [] for m in br.METHODS} for t in br.TEMPS}}
    data = {"machine": MACHINE, "config": {"batch": 64, "threads": 2, "reps": 3},
            "figures": {"1G": br.figures(failed)}}
    text = br.report(data)
    assert "- 1G: **the save process failed**, nothing was restored: exit 1: no space " \
           "left on device" in text
    assert "bit for bit" not in text
    assert br.size_targets("1G", data["figures"]["1G"]) == []


def test_a_hot_snapd_restore_that_read_the_files_is_said():
    fig = br.figures(size_run(hot={"snapd": [proc(0.8, 1.0, restored_from="disk")],
                                   "snapd_overlap": [proc(0.3, 0.6, restored_from="hot")]}))
    assert fig["hot_from_disk"] == ["snapd"]
    data = {"machine": MACHINE, "config": {"batch": 64, "threads": 2, "reps": 3},
            "figures": {"1G": fig}}
    assert "- 1G: **hot restores that read the files**, not the daemon's copy: snapd." \
        in br.report(data)
