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
    bench.time_saves(method, [0])
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
    bench.time_saves(raw, [0, 1])
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
