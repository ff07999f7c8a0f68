"""scripts/bench_ranks.py's arithmetic (no job is started: the per-rank figures are
given)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts"))
import bench_ranks  # noqa: E402  (a script, not a package)


def rank(r, stall, durable, start, seen, **extra):
    return {"rank": r, "state_bytes": 100, "stall_s": stall, "durable_s": durable,
            "start_t": start, "seen_t": seen, **extra}


def test_summary_is_the_median_rank_and_the_slowest_rank():
    job = {"ranks": [
        rank(0, [0.010, 0.030, 0.020], [1.0, 1.2, 1.1], [10.0, 20.0], [11.0, 21.5],
             disk_bytes=123, part_bytes=[50, 50]),
        rank(1, [0.040, 0.050, 0.060], [1.3, 1.4, 1.5], [10.2, 20.1], [11.1, 21.4],
             part_bytes=[48, 48]),
        rank(2, [0.001, 0.002, 0.003], [0.9, 0.8, 0.7], [10.1, 20.3], [11.2, 21.6],
             part_bytes=[2, 2])]}
    s = bench_ranks.summarize(job)
    # per-rank medians 0.020, 0.050, 0.002: median rank 0.020, slowest 0.050
    assert s["stall_s"] == pytest.approx((0.020, 0.050))
    assert s["durable_s"] == pytest.approx((1.1, 1.4))
    # first snapshot() call of any rank to the first rank that saw the commit:
    # 11.0 - 10.0 and 21.4 - 20.0, median of the two
    assert s["job_commit_s"] == pytest.approx((1.0 + 1.4) / 2)
    assert s["disk_bytes"] == 123 and s["part_bytes"] == [50, 48, 2]
