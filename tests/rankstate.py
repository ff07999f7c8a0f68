"""Reading and comparing what the multi-rank jobs (tests/multirank/) leave: each
rank's final state (``rank-<R>.npz``, keys in tests/multirank/dump.py), its per-step
progress lines and what its close() raised. Pure functions: the unit lane tests them
(tests/test_rankstate.py), the integration tests use them on real jobs' output.
"""

from __future__ import annotations

import json
import os
from typing import Dict, Iterable, List

import numpy as np


def load_state(out: str, rank: int) -> Dict[str, np.ndarray]:
    """A rank's final state; no pickle: an object array is refused."""
    with np.load(os.path.join(out, f"rank-{rank}.npz"), allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def load_progress(out: str, rank: int) -> List[dict]:
    """The step lines a rank wrote, in order (a killed job's last line may be torn)."""
    path = os.path.join(out, f"rank-{rank}.steps.jsonl")
    lines = []
    with open(path) as f:
        for line in f:
            if line.endswith("\n"):
                lines.append(json.loads(line))
    return lines


def load_close(out: str, rank: int) -> dict:
    with open(os.path.join(out, f"rank-{rank}.close.json")) as f:
        return json.load(f)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal dtype, shape and bytes (NaN equals the same NaN, -0.0 differs from 0.0)."""
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def state_differences(got: Dict[str, np.ndarray], want: Dict[str, np.ndarray],
                      keys: Iterable[str] | None = None) -> List[str]:
    """What differs, one line per key (empty when bit for bit equal): keys missing
    on either side, then values whose bits differ, with the largest difference."""
    names = sorted(set(got) | set(want)) if keys is None else list(keys)
    found = []
    for key in names:
        if key not in got or key not in want:
            found.append(f"{key}: only in {'expected' if key in want else 'actual'} state")
        elif not same_bits(got[key], want[key]):
            found.append(f"{key}: {describe(got[key], want[key])}")
    return found


def describe(a: np.ndarray, b: np.ndarray) -> str:
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{a.dtype}{list(a.shape)} against {b.dtype}{list(b.shape)}"
    if a.dtype.kind in "fc":
        return f"max |difference| {float(np.max(np.abs(a.astype(np.float64) - b))):.3g}"
    return f"{int(np.count_nonzero(a != b))} of {a.size} elements differ"


def with_prefix(state: Dict[str, np.ndarray], *prefixes: str) -> List[str]:
    return sorted(k for k in state if k.startswith(prefixes))


def sample_differences(got: List[int], want: List[int]) -> List[str]:
    """How a sequence of consumed samples departs from the reference's: the first
    position that differs, and samples seen twice or never within the span."""
    found = []
    if got != want:
        first = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w),
                     min(len(got), len(want)))
        found.append(f"first difference at position {first} of {len(want)} "
                     f"(got {got[first:first + 4]}, want {want[first:first + 4]})")
        twice = sorted(i for i in set(got) if got.count(i) > want.count(i))
        skipped = sorted(i for i in set(want) if want.count(i) > got.count(i))
        if twice:
            found.append(f"seen more often than in the reference: {twice[:10]}")
        if skipped:
            found.append(f"seen less often than in the reference: {skipped[:10]}")
    return found
