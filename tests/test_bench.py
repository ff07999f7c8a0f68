"""scripts/bench.py's methods and timing loop, scripts/bench_loops.py's shared-memory
accounting, and scripts/bench_render.py's figures and targets: from given figures, or
a tiny state saved and loaded in this process; and (integration) one real worker per
method, each writing every figure the tables are made of."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts"))
import bench  # noqa: E402  (scripts, not a package)
import bench_loops  # noqa: E402
import bench_render as br  # noqa: E402
import benchlib  # noqa: E402

GiB, MiB = 1 << 30, 1 << 20


# --- the method interface and its one loop -----------------------------------------

class Scripted(bench.Method):
    """A method whose save and wait take no time and report what they are told."""
    restores = False

    def __init__(self, synchronous):
        super().__init__("/nonexistent", None, None)
        self.synchronous, self.saved = synchronous, []

    def save(self, i):
        self.saved.append(i)
        return {"return_s": 0.5, "stall_s": 7.0} if i == 2 else {"return_s": 0.5}

    def wait(self):
        return {"daemon_write_s": 0.25}


def test_the_loop_times_every_save_and_keeps_each_methods_own_figures():
    method, before = Scripted(synchronous=False), []
    out = bench.time_saves(method, [1, 2, 3], before=lambda: before.append(1))
    assert before == [1, 1, 1]                # training before every save
    assert method.saved == [1, 2, 3]
    assert len(out["stall_s"]) == len(out["durable_s"]) == 3
    assert out["stall_s"][1] == 7.0          # a method's own stall wins (overlap mode)
    assert out["return_s"] == [0.5] * 3 and out["daemon_write_s"] == [0.25] * 3
    assert all(d >= s for s, d in zip(out["stall_s"], out["durable_s"]) if s != 7.0)
    assert out["start_t"] == sorted(out["start_t"])
    sync = bench.time_saves(Scripted(synchronous=True), [1], before=lambda: None)
    assert sync["durable_s"] == sync["stall_s"]   # durable when save() returns


def tiny_state():
    import torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    return model, opt


@pytest.mark.parametrize("name", ["torch_save", "dcp_save"])
def test_a_file_method_restores_the_bytes_it_saved(tmp_path, name):
    import torch
    model, opt = tiny_state()
    method = bench.make_method(name, str(tmp_path), model, opt)
    saved = [t.clone() for t in benchlib.state_tensors(model, opt)]
    bench.time_saves(method, [0], before=lambda: None)   # bytes asserted, not times
    assert method.file_bytes() > benchlib.nbytes_of(saved)   # every tensor is on disk
    with torch.no_grad():
        for t in benchlib.state_tensors(model, opt):
            t.add_(1.0)
    assert method.load() > 0
    for before, after in zip(saved, benchlib.state_tensors(model, opt)):
        assert torch.equal(before, after)
    dropped, files = method.cold_files()
    assert files and all(f.startswith(dropped) for f in files)


def test_raw_file_writes_exactly_the_states_bytes(tmp_path):
    import torch
    model, opt = tiny_state()
    tensors = benchlib.state_tensors(model, opt)
    views = [memoryview(t.reshape(-1).view(torch.uint8).numpy()) for t in tensors]
    raw = bench.RawFile(str(tmp_path), "raw", views)
    bench.time_saves(raw, [0, 1], before=lambda: None)   # bytes asserted, not times
    assert raw.file_bytes() == benchlib.nbytes_of(tensors)
    assert (tmp_path / "raw1.bin").read_bytes() == b"".join(bytes(v) for v in views)


# --- shared memory ------------------------------------------------------------------

def test_a_segment_seen_several_ways_counts_once_at_its_largest():
    named = {11: 100, 12: 50}          # in /dev/shm: allocated bytes
    trainer = {11: 80}                 # mapped by the trainer: resident bytes
    daemon = {11: 120, 13: 30}         # 13: unlinked, held only by the daemon
    assert bench_loops.segments_total(named, trainer, daemon) == 120 + 50 + 30
    assert bench_loops.segments_total() == 0


SMAPS = """\
7f0000000000-7f0000400000 rw-s 00000000 00:1b 501                        /dev/shm/snapd-0-42-ab (deleted)
Size:               4096 kB
Rss:                4096 kB
7f0000400000-7f0000600000 rw-s 00400000 00:1b 501                        /dev/shm/snapd-0-42-ab (deleted)
Size:               2048 kB
Rss:                1024 kB
7f0000600000-7f0000a00000 rw-s 00000000 00:1b 501                        /dev/shm/snapd-0-42-ab (deleted)
Size:               4096 kB
Rss:                4096 kB
7f0000a00000-7f0000b00000 rw-s 00000000 00:1b 777                        /dev/shm/torch_123_456
Size:               1024 kB
Rss:                1024 kB
7f0000b00000-7f0000c00000 r-xp 00000000 08:01 999                        /usr/lib/libc.so.6
Size:               1024 kB
Rss:                 512 kB
7f0000c00000-7f0000d00000 rw-s 00000000 00:1b 502                        /dev/shm/snapd-hot-0-bench-0-7x1f
Size:               1024 kB
Rss:                 256 kB
"""


def test_smaps_counts_snapd_segments_by_inode_and_range():
    # inode 501: two pieces (4 MiB at 0, 1 MiB resident at 4 MiB) and the first
    # range mapped a second time, which adds nothing; torch's segment and libc are
    # not snapd's.
    assert bench_loops.parse_smaps(SMAPS) == {501: (4 << 20) + (1 << 20), 502: 256 << 10}


# --- figures and targets ------------------------------------------------------------

def per_size(**over):
    per = {
        "ref": {"state_bytes": GiB, "direct_read_s": [0.5, 0.6, 0.7],
                "shm_read_s": [0.02, 0.02, 0.02], "copy_s": [0.01],
                "durable_s": [2.0]},
        "torch_save": {"restore_warm_s": [0.30], "restore_cold_s": [0.80],
                       "stall_s": [1.0], "durable_s": [1.0]},
        "dcp_save": {"restore_warm_s": [0.20], "restore_cold_s": [0.90],
                     "stall_s": [2.0], "durable_s": [2.0]},
        "snapd_wait": {"restore_warm_s": [0.19, 0.21, 0.20],
                       "restore_cold_s": [0.70, 0.75, 0.80],
                       "restore_hot_s": [0.03], "paired_hot_copy_s": [0.01],
                       "first_call_s": 0.05, "stall_s": [0.02, 0.03, 0.02],
                       "durable_s": [0.5]},
        "mem_hot": {"state_bytes": GiB, "meter": {"peak": {"shm": 2 * GiB,
                                                           "daemon_own": 40 * MiB}}},
        "mem_nohot": {"state_bytes": GiB, "meter": {"peak": {"shm": int(1.1 * GiB),
                                                             "daemon_own": 30 * MiB}}},
    }
    for k, v in over.items():
        per[k] = {**per.get(k, {}), **v}
    return per


def by_id(rows):
    return {r["id"]: r for r in rows}


def test_each_target_is_measured_against_its_own_reference():
    rows = by_id(br.restore_targets("1G", per_size()))
    # warm: 0.20 against the faster peer (dcp, 0.20); cold: 0.75 against torch's 0.80
    assert rows["restore_warm"]["ratio"] == pytest.approx(1.0)
    assert rows["restore_warm"]["ok"]
    assert rows["restore_cold"]["ratio"] == pytest.approx(0.75 / 0.80)
    assert rows["restore_direct"]["ratio"] == pytest.approx(0.75 / 0.6)
    assert not rows["restore_direct"]["ok"]            # 1.25 > 1.2
    assert rows["shm_hot"]["ratio"] == pytest.approx(2.0) and rows["shm_hot"]["ok"]
    assert rows["shm_nohot"]["ratio"] == pytest.approx(1.1)
    assert not rows["shm_nohot"]["ok"]
    assert rows["daemon_rss"]["ok"] and rows["daemon_rss"]["measured"] == "40 MiB"
    assert rows["first"]["ratio"] == pytest.approx(0.05 / 0.02)
    assert not rows["first"]["ok"]                     # 2.5 > 2
    # 1G: hot restore against the paired memcpy (3x: fails)
    assert rows["hot"]["ratio"] == pytest.approx(3.0) and not rows["hot"]["ok"]


def test_hot_restore_at_100m_is_against_the_kernels_copy():
    rows = by_id(br.restore_targets("100M", per_size()))
    assert rows["hot"]["ratio"] == pytest.approx(1.5) and rows["hot"]["ok"]


def test_hot_restore_at_100m_prefers_the_paired_pread():
    # measured after each hot restore, its source as stale as the hot copy: 0.025 s
    per = per_size(snapd_wait={"paired_shm_read_s": [0.025, 0.02, 0.03]})
    rows = by_id(br.restore_targets("100M", per))
    assert rows["hot"]["ratio"] == pytest.approx(0.03 / 0.025)
    assert "25 ms" in rows["hot"]["measured"]


def test_a_figure_not_measured_gives_no_row():
    per = per_size()
    del per["mem_hot"], per["ref"]["direct_read_s"]
    per["dcp_save"] = {"error": "exit 1"}
    rows = by_id(br.restore_targets("2G", per))
    assert "shm_hot" not in rows and "daemon_rss" not in rows
    assert "restore_direct" not in rows
    # the warm target falls back on the one peer that ran
    assert rows["restore_warm"]["ratio"] == pytest.approx(0.20 / 0.30)


def test_the_loop_reports_the_increase_as_a_fraction_of_the_copy():
    r = {"base_s": [0.100, 0.102, 0.098], "snap_s": [0.104, 0.105, 0.103],
         "copy_s": [0.010, 0.011, 0.009], "call_s": [0.001] * 3,
         "blocked_s": [0.0] * 3, "fwd_bwd_s": [0.05] * 3}
    s = br.loop_summary(r)
    assert s["increase_s"] == pytest.approx(0.004)
    assert s["fraction"] == pytest.approx(0.4)
    t = br.loop_target("100M", r)
    assert t["id"] == "loop" and not t["ok"]          # 0.4 > 0.3
    assert br.loop_target("100M", {"base_s": [], "snap_s": []}) is None


def test_ratios_are_against_torch_save_and_dcp_save_of_the_same_run():
    vs = br.peer_ratios(per_size())
    # snapd wait: stall 0.02 against 1.0 and 2.0; durable 0.5 against 1.0 and 2.0
    assert vs["snapd_wait"]["stall_s_vs_torch_save"] == pytest.approx(0.02)
    assert vs["snapd_wait"]["stall_s_vs_dcp_save"] == pytest.approx(0.01)
    assert vs["snapd_wait"]["durable_s_vs_dcp_save"] == pytest.approx(0.25)
    assert vs["copy"]["stall_s_vs_torch_save"] == pytest.approx(0.01)
    assert vs["raw"]["durable_s_vs_torch_save"] == pytest.approx(2.0)
    assert vs["torch_save"]["stall_s_vs_torch_save"] == pytest.approx(1.0)


def test_cold_restore_is_set_against_each_workers_own_raw_read():
    per = per_size(snapd_wait={"paired_direct_s": [0.5, 0.6, 0.7]},
                   torch_save={"paired_direct_s": [0.4]})
    own = br.cold_against_own_raw(per)
    # snapd 0.75 / 0.6; torch 0.80 / 0.40; dcp has no raw read of its own: left out
    assert own == {"snapd_wait": pytest.approx((0.75, 0.6)),
                   "torch_save": pytest.approx((0.80, 0.40))}
    assert br.cold_against_own_raw(per_size()) == {}


def test_the_runs_json_carries_every_derived_figure():
    data = {"results": {"1G": per_size()}, "loops": {"100M": {
        "base_s": [0.1], "snap_s": [0.12], "copy_s": [0.1]}},
        "slowdown": {"size": "1G", "base_s": [3.0, 3.0], "snap_s": [3.03, 3.03]}}
    fig = json.loads(json.dumps(br.figures(data)))   # what bench.py stores, as stored
    assert set(fig["sizes"]["1G"]) == {"vs_peers", "cold_against_own_raw"}
    assert fig["slowdown"]["mean_pct"] == pytest.approx(1.0)
    slow = next(t for t in fig["targets"] if t["target"].startswith("training slowdown"))
    assert slow["ok"] and slow["measured"] == "+1.0%"
    assert {t["id"] for t in fig["restore_targets"]} >= {"restore_warm", "first", "loop"}
    stalls = [t for t in fig["targets"] if "1/15 of torch.save" in t["target"]]
    assert [t["ok"] for t in stalls] == [True]   # snapd wait: 1/50 of torch.save


def test_the_restore_table_keeps_its_order_with_old_figures_beside():
    rows = br.restore_targets("1G", per_size()) + br.restore_targets("100M", per_size())
    table = br.restore_table(rows, {("first", "1G"): "9.9× (1 s vs 0.1 s) ✗"}, "then")
    assert table[0] == "| target | size | 15:07 run | before (then) | this run | result |"
    ids = [next(tid for tid, label in br.TARGETS if line.startswith(f"| {label} |"))
           for line in table[2:]]
    order = [tid for tid, _ in br.TARGETS]
    assert ids == sorted(ids, key=order.index)
    first_1g = next(line for line in table if "first snapshot" in line and "| 1G |" in line)
    assert br.OLD_1507[("first", "1G")] in first_1g and "9.9× (1 s vs 0.1 s) ✗" in first_1g
    assert "before" not in br.restore_table(rows, {})[0]


def test_an_earlier_runs_json_becomes_the_before_column():
    rows = br.restore_targets("1G", per_size())
    before, date = br.before_column({"figures": {"restore_targets": rows},
                                     "machine": {"date": "2026-12-01 14:30 UTC"}})
    assert date == "2026-12-01 14:30 UTC"
    assert before[("restore_warm", "1G")] == "1.00× (200 ms vs 200 ms) ✓"
    # a JSON written before the renderer kept them under another name
    older, _ = br.before_column({"issue_targets": rows})
    assert older == before
    assert br.before_column(None) == (br.BEFORE, br.BEFORE_DATE)


def test_section_replaces_its_own_and_keeps_the_others(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n## Snapshots (scripts/bench.py)\n\nsingle\n\n"
                   "## Many ranks (scripts/bench_ranks.py)\n\nold figures\n\n"
                   "## State log (scripts/bench_log.py)\n\nlog\n")
    heading = "## Many ranks (scripts/bench_ranks.py)"
    benchlib.write_doc(str(doc), heading + "\n\nnew figures\n", heading=heading)
    text = doc.read_text()
    assert "old figures" not in text and "new figures" in text
    assert "single" in text and "log" in text
    assert text.index("new figures") < text.index("## State log")


# --- the automatic cadence (scripts/bench_cadence.py) -------------------------------

import bench_cadence as bc  # noqa: E402


def test_overhead_is_against_the_loop_without_snapshots_and_loss_adds_d():
    assert bc.overhead(10.3, 10.0) == pytest.approx(0.03)
    assert bc.overhead(9.9, 10.0) == pytest.approx(-0.01)    # noise reads as it is
    assert bc.expected_loss(4.0, 0.5) == pytest.approx(2.5)  # half an interval, plus D
    assert bc.expected_loss(None, 0.5) is None and bc.expected_loss(4.0, None) is None


def test_the_best_fixed_n_loses_least_at_no_more_overhead_in_its_loop():
    # "overhead" (against the loops without snapshots) is shown, never compared.
    fixed = {"10": {"in_loop": 0.050, "overhead": 0.0, "expected_loss_s": 1.0},
             "40": {"in_loop": 0.012, "overhead": 0.0, "expected_loss_s": 2.0},
             "160": {"in_loop": 0.003, "overhead": 0.0, "expected_loss_s": 5.0},
             "320": {"in_loop": None, "overhead": 0.0, "expected_loss_s": 0.1},
             "640": {"in_loop": 0.001, "overhead": 0.0, "expected_loss_s": None}}
    assert bc.best_fixed(fixed, 0.012) == "40"       # equal overhead still counts
    assert bc.best_fixed(fixed, 0.02) == "40"
    assert bc.best_fixed(fixed, 0.06) == "10"
    assert bc.best_fixed(fixed, 0.0009) is None
    assert bc.best_fixed(fixed, None) is None        # auto's own not measured


def test_in_loop_overhead_is_against_the_steps_no_snapshot_disturbed():
    # Ten steps: 1.0 s each, except steps 3 and 4 (a snapshot called at 3.5, durable
    # at 4.5) which took 1.5 s; a guard of 2 s after durable reaches into step 5.
    durations = [1.0, 1.0, 1.0, 1.5, 1.5, 1.0, 1.0, 1.0, 1.0, 1.2]
    marks = [0.0]
    for d in durations:
        marks.append(marks[-1] + d)
    windows = bc.busy_windows([{"called_at": 3.5, "durable_s": 1.0}], marks[-1])
    fig = bc.in_loop_overhead(marks, windows, guard_s=2.0)
    calm = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.2]         # steps 0-2, 6-9; 5 in the guard
    mean = sum(calm) / len(calm)
    assert fig["calm_steps"] == len(calm)
    assert fig["overhead"] == pytest.approx(sum(durations) / (10 * mean) - 1)
    assert fig["drift"] == pytest.approx(abs(sum(calm[3:]) / 4 - 1.0) / mean)
    # A snapshot never durable by the loop's end disturbs every step from its call.
    late = bc.busy_windows([{"called_at": 2.0}], marks[-1])
    assert bc.in_loop_overhead(marks, late, guard_s=0.0)["calm_steps"] == 2
    assert bc.in_loop_overhead(marks, [(0.0, marks[-1])], 0.0)["overhead"] is None


FIRST = {"kind": "cadence", "step": 0, "interval_steps": 1, "interval_s": 0.0,
         "bound": "first", "expected_loss_s": 0.0, "mtbf_s": 600.0, "mtbf_from": "option",
         "stall_s": 0.14}


def cadence_run(every, base_index, loop_s, durable, records=(), step_s=0.05,
                in_loop=0.0):
    return {"every": every, "base_index": base_index, "loop_s": loop_s, "step_s": step_s,
            "in_loop": {"overhead": in_loop, "drift": 0.004, "calm_steps": 150},
            "taken": [{"step": (40 if every == "auto" else every) * (i + 1),
                       "call_s": 0.03, "waited_s": 0.0, "durable_s": d}
                      for i, d in enumerate(durable)],
            "skip_call_s": 0.00008 if every == "auto" else 0.00005,
            "cadence": list(records)}


def cadence_results():
    record = {**FIRST, "step": 120, "interval_steps": 40, "interval_s": 1.9,
              "bound": "young-daly", "expected_loss_s": 1.4, "stall_s": 0.03}
    # One round whose configurations each sit between their own two loops without
    # snapshots (base_index): the neighbours are whichever two base_index names.
    return {"state_bytes": 100 << 20, "matmuls_per_step": 50,
            "base": [{"loop_s": s, "step_s": 0.05} for s in (10.0, 10.2, 10.0, 10.0, 9.8)],
            "rounds": [{
                "auto": {"0.01": cadence_run("auto", 0, 10.2, [0.4, 0.5, 0.6],
                                             [FIRST, {**record, "step": 80}, record],
                                             in_loop=0.01),
                         "0.05": {"every": "auto", "budget": 0.05, "base_index": 1,
                                  "error": "OSError: full"}},
                "fixed": {"10": cadence_run(10, 1, 11.0, [0.4, 0.4], in_loop=0.08),
                          "40": cadence_run(40, 2, 10.3, [0.5], in_loop=0.02),
                          "160": cadence_run(160, 3, 9.8, [0.5], in_loop=0.004)}}]}


def test_each_configuration_is_set_against_its_neighbours_and_its_best_fixed_n():
    fig = bc.size_figures(cadence_results())
    assert fig["base_s"] == pytest.approx(10.0)
    assert fig["noise"] == pytest.approx(0.4 / 10.0)           # max − min of all five
    auto = fig["auto"]["0.01"]
    # between the loops of 10.0 s and 10.2 s: against 10.1, with their 2% of drift
    assert auto["overhead"] == pytest.approx(10.2 / 10.1 - 1)
    assert auto["noise"] == pytest.approx(0.2 / 10.1)
    assert auto["taken"] == 3 and auto["durable_s"] == pytest.approx(0.5)
    # the cadence's final interval in steps, at the loop's own median step
    assert auto["interval_s"] == pytest.approx(40 * 0.05)
    assert auto["expected_loss_s"] == pytest.approx(1.0 + 0.5)
    assert auto["final_loss_s"] == pytest.approx(1.0 + 0.5)
    assert auto["mean_interval_steps"] == 40
    assert auto["bound"] == "young-daly" and auto["cadence_expected_loss_s"] == 1.4
    assert auto["mtbf_s"] == 600.0 and auto["first_stall_s"] == 0.14
    assert "0.05" not in fig["auto"]                     # failed: reported, not summed
    fixed = fig["fixed"]
    assert fixed["10"]["overhead"] == pytest.approx(11.0 / 10.1 - 1)
    assert fixed["160"]["overhead"] == pytest.approx(9.8 / 9.9 - 1)   # 10.0 and 9.8
    assert fixed["10"]["interval_s"] == pytest.approx(0.5)
    assert fixed["10"]["expected_loss_s"] == pytest.approx(0.25 + 0.4)
    assert (auto["in_loop"], auto["in_loop_drift"], auto["calm_steps"]) == (
        0.01, 0.004, 150)
    # In their loops every=10 and every=40 cost more than auto's +1.0%, every=160 less
    # (against the loops without snapshots every=40 reads cheaper than auto: drift)
    assert fig["versus"]["0.01"]["best_fixed"] == "160"
    assert fig["versus"]["0.01"]["loss_ratio"] == pytest.approx(1.5 / (4.0 + 0.5))


def test_the_expected_loss_is_taken_over_the_intervals_the_loop_took():
    # Equal intervals: half of one, plus D, as the formula at N has it.
    assert bc.taken_intervals([{"step": 40}, {"step": 80}]) == [40, 40]
    assert bc.measured_loss([40, 40], 0.05, 0.5) == pytest.approx(bc.expected_loss(
        40 * 0.05, 0.5))
    # Uneven ones: a failure falls in the long one three times as often, so the loss
    # is (10² + 30²) / (2 × 40) = 12.5 steps, more than the mean's half (10).
    assert bc.taken_intervals([{"step": 10}, {"step": 40}]) == [10, 30]
    assert bc.measured_loss([10, 30], 0.1, 0.2) == pytest.approx(1.25 + 0.2)
    assert bc.measured_loss([], 0.1, 0.2) is None
    assert bc.measured_loss([10], 0.1, None) is None
    # auto is set against fixed N by it, its final interval given beside it.
    per = cadence_results()
    run = per["rounds"][0]["auto"]["0.01"]
    run["taken"] = [{**t, "step": s} for t, s in zip(run["taken"], (10, 40, 120))]
    auto = bc.size_figures(per)["auto"]["0.01"]
    assert auto["expected_loss_s"] == pytest.approx(
        (10 ** 2 + 30 ** 2 + 80 ** 2) / (2 * 120) * 0.05 + 0.5)
    assert auto["final_loss_s"] == pytest.approx(40 * 0.05 / 2 + 0.5)
    assert auto["mean_interval_steps"] == 40


def test_the_section_names_the_rule_the_bound_and_a_failed_configuration():
    data = {"machine": {"date": "2026-12-03 14:00 UTC", "command": "bench_cadence.py",
                        "nproc": 2, "cpu": "cpu", "mem_total": 1 << 34,
                        "python": "3", "torch": "2", "kernel": "6", "tmp_disk": "d",
                        "load_before": (0.5,), "load_after": (0.6,), "elapsed_s": 60.0},
            "config": {"steps": 200, "step_ms": 50.0, "threads": 1, "mtbf": 600.0},
            "results": {"100M": cadence_results()}}
    data["figures"] = {"100M": bc.size_figures(data["results"]["100M"])}
    text = bc.report(data)
    assert text.startswith(bc.SECTION)
    assert "| none (5 loops) | 10.00 s (mean) | | 4.0% (max − min) |" in text
    assert "| `auto`, overhead=0.01 | 10.20 s | +1.0% | 2.0% | +1.0% | 0.4% | 3 | " \
           "40 steps, 2.00 s | young-daly | 500 ms | 1.50 s | 30 ms | 80 µs |" in text
    assert "| `every=160` | 9.80 s | -1.0% | 2.0% | +0.4% | 0.4% | 1 | 160 steps, " \
           "8.00 s | fixed |" in text and "| 50 µs |" in text
    assert "| `auto`, overhead=0.05 | error in round 1: OSError: full |" in text
    assert "Round by round" not in text                  # one round: nothing to count
    assert "CheckFreq's published bound, FAST '21: 3.5%" in text
    assert "interval 40 steps, 2.00 s set by `young-daly`, step 0's stall 140 ms " \
           "against 30 ms in the loop, cost per snapshot weighed (stall and slowdown) " \
           "– (M 600 s from option), intervals taken 40 steps on average, expected loss " \
           "1.50 s (at its final interval alone 1.50 s)" in text
    assert "measured +1.0% in its loop, +1.0% against the loops without snapshots" in text
    assert "the best fixed N at no more overhead is `every=160` (+0.4% in its loop)" \
        in text
    assert "M = 600 s (`mtbf=`)" in text


def test_an_auto_run_that_took_none_after_step_0_says_so_and_names_no_rule():
    per = cadence_results()
    per["rounds"][0]["auto"]["0.01"] = cadence_run("auto", 0, 10.1, [], [FIRST])
    fig = bc.size_figures(per)
    auto = fig["auto"]["0.01"]
    assert auto["taken"] == 0 and auto["bound"] is None     # not step 0's "first"
    assert auto["interval_s"] is None and auto["expected_loss_s"] is None
    table = "\n".join(bc.config_table(fig, per, 200))
    assert "| `auto`, overhead=0.01 | 10.10 s | +0.0% | 2.0% | +0.0% | 0.4% | 0 | " \
           "none taken in 200 steps | – | – | – |" in table
    line = bc.versus_lines(fig, 200)[0]
    assert "no snapshot after step 0 in 200 steps, step 0's stall 140 ms against – in " \
           "the loop, cost per snapshot weighed (stall and slowdown) – (M 600 s from " \
           "option)" in line


def test_rounds_reverse_the_order_and_each_starts_after_a_loop_alone(monkeypatch):
    ran = []
    monkeypatch.setattr(bc.benchlib, "build_state", lambda size, threads: (None, None))
    monkeypatch.setattr(bc.benchlib, "state_tensors", lambda model, opt: [])
    monkeypatch.setattr(bc.benchlib, "nbytes_of", lambda tensors: 0)
    monkeypatch.setattr(bc, "calibrate", lambda step_s: 1)
    monkeypatch.setattr(bc, "warm_up", lambda args, state: 0.0)
    monkeypatch.setattr(bc, "run_loop", lambda work, steps: ran.append("none") or
                        {"loop_s": 1.0, "step_s": 0.1})
    monkeypatch.setattr(bc, "guarded", lambda args, state, work, every, budget:
                        ran.append(f"{every}/{budget}") or {"every": every})
    args = bc.parse(["--sizes", "1M", "--budgets", "0.01", "--every", "10,40",
                     "--rounds", "3"])
    per = bc.one_size(args, "1M")
    assert ran == ["none", "auto/0.01", "10/None", "40/None", "none",
                   "40/None", "10/None", "auto/0.01", "none",
                   "auto/0.01", "10/None", "40/None", "none"]
    # each configuration of round r is set against the loops alone before and after it
    assert [sorted({res["base_index"] for g in done.values() for res in g.values()})
            for done in per["rounds"]] == [[0], [1], [2]]


def test_over_rounds_each_figure_is_a_median_and_the_rounds_are_counted():
    record = {**FIRST, "step": 120, "interval_steps": 40, "interval_s": 1.9,
              "bound": "young-daly", "expected_loss_s": 1.4, "stall_s": 0.03}

    def one_round(base_index, auto_in_loop, auto_durable, fixed_in_loop):
        return {"auto": {"0.01": cadence_run("auto", base_index, 10.2, [auto_durable],
                                             [FIRST, record], in_loop=auto_in_loop)},
                "fixed": {"40": cadence_run(40, base_index, 10.3, [0.5],
                                            in_loop=fixed_in_loop),
                          "160": cadence_run(160, base_index, 9.8, [0.5],
                                             in_loop=0.001)}}
    # auto: an interval of 40 steps (1.0 s of loss) + D; every=40 loses 1.0 + 0.5 s.
    per = {"base": [{"loop_s": 10.0, "step_s": 0.05}] * 4,
           "rounds": [one_round(0, 0.010, 0.3, 0.012),   # 40 dearer: auto vs 160, held
                      one_round(1, 0.010, 0.9, 0.008),   # vs 40: 1.9 / 1.5, not held
                      one_round(2, 0.011, 0.4, 0.009)]}  # vs 40: 1.4 / 1.5, held
    fig = bc.size_figures(per)
    auto = fig["auto"]["0.01"]
    assert auto["rounds"] == 3 and auto["bound"] == "young-daly"
    assert auto["in_loop"] == pytest.approx(0.010)             # median of 10, 10, 11
    assert auto["expected_loss_s"] == pytest.approx(1.0 + 0.4)  # median of the three
    assert fig["fixed"]["40"]["in_loop"] == pytest.approx(0.009)
    # by the medians: every=40 (+0.9%) is no dearer than auto (+1.0%) and loses 1.5 s
    assert fig["versus"]["0.01"] == {"best_fixed": "40",
                                     "loss_ratio": pytest.approx(1.4 / 1.5)}
    assert [r["versus"]["0.01"]["best_fixed"] for r in fig["rounds"]] == \
        ["160", "40", "40"]
    assert fig["held_in_rounds"] == {"0.01": 2}
    text = bc.rounds_text(fig, "0.01")
    assert "in 2 of 3 (+1.0%, 0.29× `every=160`; +1.0%, 1.27× `every=40`; " \
           "+1.1%, 0.93× `every=40`)" in text
