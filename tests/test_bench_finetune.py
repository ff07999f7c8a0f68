"""scripts/bench_finetune.py: a tiny run through the real daemon (integration: the
structure of its figures, and that sharing staged far fewer bytes than the whole
state), and its summary of given figures."""

import json
import os
import sys

import psutil
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts"))
import bench_finetune  # noqa: E402  (a script, not a package)

TINY = ["--base-mb", "4", "--width", "512", "--snapshots", "2", "--threads", "1",
        "--no-probe"]


@pytest.mark.integration
def test_a_tiny_run_shares_the_frozen_base_and_reports_every_method(tmp_path):
    out = tmp_path / "figures.json"
    data = bench_finetune.main(TINY + ["--tmp", str(tmp_path), "--json", str(out)])
    assert json.loads(out.read_text())["summary"] == json.loads(json.dumps(data["summary"]))
    cfg, results, summary = data["config"], data["results"], data["summary"]
    assert set(summary) == set(bench_finetune.METHODS), results
    trainable, base = cfg["trainable_bytes"], cfg["base_bytes"]
    assert base > 20 * trainable > 0

    shared, full = results["snapd_shared"], results["snapd_full"]
    for r in (shared, full):
        assert r["first"]["staged"] >= base            # the first snapshot copies the base
        for key in ("stall_s", "backpressure_s", "staged", "written"):
            assert len(r["stall"][key]) == 2
        for key in ("stall_s", "durable_s", "staged", "written"):
            assert len(r["durable"][key]) == 2
        assert not psutil.pid_exists(r["daemon_stopped"])   # its daemon was stopped
    for staged in shared["stall"]["staged"] + shared["durable"]["staged"]:
        assert staged <= 2 * trainable
    for staged in full["stall"]["staged"] + full["durable"]["staged"]:
        assert staged >= base
    # Tiny tensors are padded to 4 KiB blocks on disk: far below the base, not 2x.
    assert summary["snapd_shared"]["written"] < base / 10
    assert len(results["torch_save"]["stall_s"]) == 2
    assert 0 < summary["torch_save"]["written"] < base
    assert os.listdir(tmp_path) == ["figures.json"]   # roots and files removed


def test_the_summary_is_the_median_of_snapshots_two_to_n_and_skips_a_failure():
    per = {"stall_s": [0.002, 0.004, 0.003], "backpressure_s": [0.0] * 3,
           "staged": [1 << 20] * 3, "written": [2 << 20] * 3, "daemon_write_s": [0.1] * 3}
    results = {"snapd_shared": {"first": {"stall_s": 0.5}, "disk_bytes": 7 << 20,
                                "stall": per, "durable": {**per, "durable_s": [0.05] * 3}},
               "snapd_full": {"error": "OSError: no space"},
               "torch_save": {"stall_s": [0.02, 0.01], "durable_s": [0.02, 0.01],
                              "written": [1, 3]}}
    summary = bench_finetune.summarize(results)
    assert set(summary) == {"snapd_shared", "torch_save"}
    shared = summary["snapd_shared"]
    assert shared["stall_s"] == pytest.approx(0.003)
    assert shared["staged"] == 1 << 20 and shared["written"] == 2 << 20
    assert shared["durable_s"] == pytest.approx(0.05)
    assert shared["first"] == {"stall_s": 0.5} and shared["disk_bytes"] == 7 << 20
    ts = summary["torch_save"]
    assert ts["stall_s"] == pytest.approx(0.015) and ts["staged"] is None
    assert ts["written"] == 2
