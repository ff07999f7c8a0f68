"""scripts/bench.py's workers, as the bench runs them: every method's worker writes
every figure the tables are made of, and saves the whole state.

One process runs every method's worker in turn (``bench.main`` in worker mode, as
the orchestrator's subprocesses do), so the test pays for one interpreter and one
torch import, not six.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "scripts")

FIGURES = {   # what each worker must write: every figure the tables are made of
    "ref": {"copy_s", "shm_read_s", "durable_s", "direct_durable_s", "peak"},
    "torch_save": {"stall_s", "durable_s", "file_bytes", "peak", "restore_warm_s",
                   "restore_cold_s", "cold_dropped", "paired_direct_s"},
    "dcp_save": {"stall_s", "durable_s", "file_bytes", "peak", "restore_warm_s",
                 "restore_cold_s", "cold_dropped", "paired_direct_s"},
    "dcp_async": {"return_s", "stall_s", "durable_s", "file_bytes", "peak", "stager"},
    "snapd_wait": {"track_s", "fresh_restore_s", "first_call_s", "first_snapshot_s",
                   "call_s", "stall_s", "durable_s", "daemon_write_s", "file_bytes",
                   "paired_copy_s", "paired_stall_s", "stall_after_gap_s",
                   "restore_hot_s", "restore_hot_from", "paired_hot_copy_s",
                   "paired_shm_read_s", "warmed_bytes", "restore_warm_s",
                   "restore_cold_s", "cold_dropped", "paired_direct_s", "peak"},
    "snapd_overlap": {"call_s", "blocked_s", "step_s", "stall_s", "step_baseline_s",
                      "durable_s", "paired_copy_s", "paired_stall_s", "file_bytes", "peak"},
}


DRIVER = """
import sys
sys.path.insert(0, sys.argv[1])
import bench
root, out = sys.argv[2], sys.argv[3]
for method in sys.argv[4:]:
    bench.main(["--method", method, "--size", "8M", "--root", f"{root}/{method}",
                "--out", f"{out}/{method}.json", "--reps", "2", "--cold-reps", "1",
                "--first-gap", "0"])
"""


def test_each_worker_writes_every_figure_and_saves_the_whole_state(tmp_path):
    proc = subprocess.run([sys.executable, "-c", DRIVER, SCRIPTS, str(tmp_path / "roots"),
                           str(tmp_path), *FIGURES], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for method, figures in FIGURES.items():
        res = json.loads((tmp_path / f"{method}.json").read_text())
        assert figures <= set(res), (method, figures - set(res))
        for key in figures & {"stall_s", "durable_s", "restore_warm_s", "copy_s"}:
            assert len(res[key]) >= 2 and all(x > 0 for x in res[key]), (method, key)
        if "file_bytes" in res:   # every method saved every byte of the state
            assert res["file_bytes"] >= res["state_bytes"], method
        if method == "snapd_wait":
            assert set(res["restore_hot_from"]) == {"hot"}
        assert res["shm_left"] == [], method
