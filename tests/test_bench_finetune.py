"""scripts/bench_finetune.py: a tiny run through the real daemon (integration: the
structure of its figures, and that sharing staged far fewer bytes than the whole
state), and its report and section of docs/benchmarks.md from given figures."""

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


def figures(stall, staged, written, durable):
    per = {"stall_s": [stall] * 3, "backpressure_s": [0.0] * 3, "staged": [staged] * 3,
           "written": [written] * 3, "daemon_write_s": [durable / 2] * 3}
    return {"first": {"stall_s": 0.5, "durable_s": 2.0, "staged": 100 << 20,
                      "written": 100 << 20, "daemon_write_s": 1.0},
            "stall": per, "durable": {**per, "durable_s": [durable] * 3},
            "disk_bytes": 7 << 20, "trainable_bytes": 1 << 20, "base_bytes": 100 << 20}


def data(results):
    info = {"date": "2026-12-01 12:00 UTC", "nproc": 2, "cpu": "cpu", "mem_total": 1 << 34,
            "python": "3.11", "torch": "2", "kernel": "6", "tmp_disk": "/dev/x",
            "load_before": (0.1, 0, 0), "load_after": (0.2, 0, 0), "elapsed_s": 60,
            "busy_before": [], "busy_after": []}
    cfg = {"width": 4096, "layers": 2, "rank": 7, "base_mb": 100, "snapshots": 3,
           "threads": 2, "trainable_bytes": 1 << 20, "base_bytes": 100 << 20,
           "command": ".venv/bin/python scripts/bench_finetune.py --base-mb 100"}
    return {"machine": info, "config": cfg, "results": results,
            "summary": bench_finetune.summarize(results)}


def test_the_report_compares_each_method_with_torch_save_in_the_same_run():
    results = {"snapd_shared": figures(0.002, 1 << 20, 1 << 20, 0.05),
               "snapd_full": figures(0.040, 101 << 20, 101 << 20, 1.0),
               "torch_save": {"stall_s": [0.02] * 3, "durable_s": [0.02] * 3,
                              "written": [1 << 20] * 3}}
    text = bench_finetune.report(data(results))
    rows = {}   # the first table's rows (the first snapshot's table follows it)
    for line in text.splitlines():
        if line.startswith("| "):
            rows.setdefault(line.split(" | ")[0].lstrip("| "), line.split(" | "))
    shared = rows[bench_finetune.LABEL["snapd_shared"]]
    assert shared[1:] == ["2 ms", "0 ms", "1.00", "1.00", "50 ms", "0.100 (1/10)",
                          "2.50 |"]
    assert rows[bench_finetune.LABEL["snapd_full"]][3] == "101"
    assert rows[bench_finetune.LABEL["torch_save"]][3] == "–"   # no staging
    assert text.startswith(bench_finetune.SECTION)
    assert "--base-mb 100" in text


def test_a_failed_method_is_named_and_the_others_still_reported():
    results = {"snapd_shared": figures(0.002, 1 << 20, 1 << 20, 0.05),
               "snapd_full": {"error": "OSError: no space"},
               "torch_save": {"stall_s": [0.02], "durable_s": [0.02], "written": [1]}}
    text = bench_finetune.report(data(results))
    assert f"| {bench_finetune.LABEL['snapd_full']} | error" in text
    assert f"| {bench_finetune.LABEL['snapd_shared']} | 2 ms" in text


def test_section_replaces_its_own_and_keeps_the_others(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"# Benchmarks\n\n## Staging copy (x)\n\nstaging\n\n"
                   f"{bench_finetune.SECTION}\n\nplaceholder\n\n## Remote tier (y)\n\nremote\n")
    bench_finetune.bench.write_doc(str(doc), bench_finetune.SECTION + "\n\nmeasured\n",
                                   heading=bench_finetune.SECTION)
    text = doc.read_text()
    assert "placeholder" not in text and "measured" in text
    assert text.index("staging") < text.index("measured") < text.index("remote")
