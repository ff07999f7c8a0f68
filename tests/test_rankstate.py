"""The comparisons the multi-rank tests make on their jobs' output (tests/rankstate.py):
bit for bit, with the differences named; samples seen twice or skipped named."""

from __future__ import annotations

import json

import numpy as np

from rankstate import (load_progress, load_state, same_bits, sample_differences,
                       state_differences, with_prefix)


def test_same_bits_tells_what_equality_would_not():
    assert same_bits(np.array([np.nan]), np.array([np.nan]))
    assert not same_bits(np.array([0.0]), np.array([-0.0]))
    assert not same_bits(np.zeros(2, np.float32), np.zeros(2, np.float64))
    assert not same_bits(np.zeros((2, 1)), np.zeros((1, 2)))


def test_state_differences_names_each_key():
    want = {"param/w": np.arange(4.0), "rng/torch": np.arange(3, dtype=np.uint8),
            "step": np.asarray(3)}
    assert state_differences(dict(want), want) == []
    got = {"param/w": np.arange(4.0) + [0, 0, 0.5, 0], "rng/torch": np.asarray([0, 1, 9], np.uint8),
           "extra": np.asarray(1)}
    found = state_differences(got, want)
    assert found == ["extra: only in actual state", "param/w: max |difference| 0.5",
                     "rng/torch: 1 of 3 elements differ", "step: only in expected state"]
    assert state_differences(got, want, keys=["param/w"]) == ["param/w: max |difference| 0.5"]
    assert with_prefix(want, "param/", "step") == ["param/w", "step"]


def test_sample_differences_names_repeats_and_skips():
    assert sample_differences([3, 1, 2], [3, 1, 2]) == []
    found = sample_differences([3, 1, 1, 4], [3, 1, 2, 4])
    assert found[0].startswith("first difference at position 2 of 4")
    assert found[1:] == ["seen more often than in the reference: [1]",
                         "seen less often than in the reference: [2]"]
    assert sample_differences([3, 1], [3, 1, 2])[-1] == "seen less often than in the reference: [2]"


def test_states_load_without_pickle_and_progress_drops_a_torn_line(tmp_path):
    np.savez(tmp_path / "rank-1.npz", step=np.asarray(5), samples=np.arange(3))
    assert sorted(load_state(str(tmp_path), 1)) == ["samples", "step"]
    lines = [json.dumps({"step": s, "loss": 1.0, "samples": [s]}) for s in (1, 2)]
    (tmp_path / "rank-0.steps.jsonl").write_text("\n".join(lines) + "\n" + '{"step": 3, "lo')
    assert [s["step"] for s in load_progress(str(tmp_path), 0)] == [1, 2]
