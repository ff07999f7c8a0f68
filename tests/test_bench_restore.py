"""scripts/bench_restore.py's arithmetic and tables (issue 15's targets), and its
section in scripts/bench.py's report (no worker is started: the figures are given)."""

import json
import os
import sys
from types import SimpleNamespace

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts"))
import bench  # noqa: E402  (scripts, not a package)
import bench_restore as br  # noqa: E402

GiB, MiB = 1 << 30, 1 << 20


def test_a_segment_seen_several_ways_counts_once_at_its_largest():
    named = {11: 100, 12: 50}          # in /dev/shm: allocated bytes
    trainer = {11: 80}                 # mapped by the trainer: resident bytes
    daemon = {11: 120, 13: 30}         # 13: unlinked, held only by the daemon
    assert br.segments_total(named, trainer, daemon) == 120 + 50 + 30
    assert br.segments_total() == 0


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
    assert br.parse_smaps(SMAPS) == {501: (4 << 20) + (1 << 20), 502: 256 << 10}


def per_size(**over):
    per = {
        "ref": {"state_bytes": GiB, "direct_read_s": [0.5, 0.6, 0.7],
                "shm_read_s": [0.02, 0.02, 0.02]},
        "torch_save": {"restore_warm_s": [0.30], "restore_cold_s": [0.80]},
        "dcp_save": {"restore_warm_s": [0.20], "restore_cold_s": [0.90]},
        "snapd_wait": {"restore_warm_s": [0.19, 0.21, 0.20],
                       "restore_cold_s": [0.70, 0.75, 0.80],
                       "restore_hot_s": [0.03], "paired_hot_copy_s": [0.01],
                       "first_call_s": 0.05, "stall_s": [0.02, 0.03, 0.02]},
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
    rows = by_id(br.size_targets("1G", per_size()))
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
    rows = by_id(br.size_targets("100M", per_size()))
    assert rows["hot"]["ratio"] == pytest.approx(1.5) and rows["hot"]["ok"]


def test_hot_restore_at_100m_prefers_the_paired_pread():
    # measured after each hot restore, its source as stale as the hot copy: 0.025 s
    per = per_size(snapd_wait={"paired_shm_read_s": [0.025, 0.02, 0.03]})
    rows = by_id(br.size_targets("100M", per))
    assert rows["hot"]["ratio"] == pytest.approx(0.03 / 0.025)
    assert "25 ms" in rows["hot"]["measured"]


def test_a_figure_not_measured_gives_no_row():
    per = per_size()
    del per["mem_hot"], per["ref"]["direct_read_s"]
    per["dcp_save"] = {"error": "exit 1"}
    rows = by_id(br.size_targets("2G", per))
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


def test_the_table_keeps_the_issue_order_with_old_figures_beside():
    rows = br.size_targets("1G", per_size()) + br.size_targets("100M", per_size())
    table = br.issue_table(rows, {("first", "1G"): "9.9× (1 s vs 0.1 s) ✗"}, "then")
    assert table[0] == "| target | size | 15:07 run | before (then) | this run | result |"
    body = table[2:]
    ids = [next(tid for tid, label in br.TARGETS if line.startswith(f"| {label} |"))
           for line in body]
    order = [tid for tid, _ in br.TARGETS]
    assert ids == sorted(ids, key=order.index)
    first_1g = next(line for line in body if "first snapshot" in line and "| 1G |" in line)
    assert br.OLD_1507[("first", "1G")] in first_1g and "9.9× (1 s vs 0.1 s) ✗" in first_1g
    assert first_1g.endswith("| **fail** |")
    direct = next(line for line in body if "O_DIRECT" in line and "| 1G |" in line)
    assert "| – | – |" in direct                      # measured by neither earlier run
    # no earlier run given: no 'before' column
    assert "before" not in br.issue_table(rows, {})[0]


def test_an_earlier_runs_json_becomes_the_before_column(tmp_path):
    rows = br.size_targets("1G", per_size())
    path = tmp_path / "before.json"
    path.write_text(json.dumps({"issue_targets": rows,
                                "machine": {"date": "2026-12-01 14:30 UTC"}}))
    args = SimpleNamespace(before=str(path))
    text = "\n".join(bench.issue_section(rows, args))
    assert "before (2026-12-01 14:30 UTC)" in text
    warm = next(line for line in text.splitlines()
                if "file restore, warm" in line and "| 1G |" in line)
    # the earlier figure with its verdict, then this run's
    assert "1.00× (200 ms vs 200 ms) ✓ | 1.00× (200 ms vs 200 ms) | pass |" in warm


def test_cold_restore_is_set_against_each_workers_own_raw_read():
    per = per_size(snapd_wait={"paired_direct_s": [0.5, 0.6, 0.7]},
                   torch_save={"paired_direct_s": [0.4]})
    line = br.cold_against_own_raw(per)
    # snapd 0.75 / 0.6; torch 0.80 / 0.40; dcp has no raw read of its own: left out
    assert "snapd 1.25× (750 ms vs 600 ms)" in line
    assert "torch.load + load_state_dict 2.00× (800 ms vs 400 ms)" in line
    assert "dcp.load" not in line
    assert br.cold_against_own_raw(per_size()) is None
