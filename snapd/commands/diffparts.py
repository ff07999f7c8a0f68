"""The parts ``snapd diff`` gives a verdict on: weights, optimizer, RNG, cursor.

A verdict is ``equal``, ``different``, ``never-drawn`` (RNG only: the streams differ
but each side is as its seeding left it, nothing drawn since: two runs of a script
that never seeds or uses ``random``/``np.random`` differ only there) or ``none``
(no object of that part on either side).

Whether a stream is at its seeded start is read from its encoding (docs/format.md):
a Mersenne Twister seeded from an array (``random.seed(anything)``, the seeding at
import, ``np.random.seed(None or a list)``) has state word 0 set to 0x80000000, and
one seeded from an int (``np.random.seed(n)``) words that follow from word 0 by the
generator's init recurrence; the position is then at the end of the state (624; the
623 of numpy's seeding at import). The first draw regenerates the state, so any draw
moves it away, except numpy's first 32-bit word after its import-time seeding. torch
streams are not judged (torch seeds the same constant in every process).
"""

from __future__ import annotations

import struct
from typing import Any, Dict, List, Mapping, Optional

import numpy as np

EQUAL, DIFFERENT, NEVER_DRAWN, NONE = "equal", "different", "never-drawn", "none"
WORDING = {EQUAL: "equal", DIFFERENT: "different", NONE: "none tracked",
           NEVER_DRAWN: "seeded differently, never drawn from"}

_N = 624                          # Mersenne Twister state words
_ARRAY_SEEDED_WORD0 = 0x80000000  # init_by_array's last assignment
_PY_FORMAT = f"<I{_N + 1}I?d"     # version, 624 words and the position, has gauss, gauss
_NP_FORMAT = f"<{_N}Iiid"         # keys, pos, has_gauss, cached gaussian


def _init_genrand(seed: int) -> np.ndarray:
    """The state an int seed gives (MT19937's init_genrand recurrence)."""
    words = [seed & 0xFFFFFFFF]
    for i in range(1, _N):
        prev = words[-1]
        words.append((1812433253 * (prev ^ (prev >> 30)) + i) & 0xFFFFFFFF)
    return np.array(words, dtype=np.uint32)


def seeded_start(name: str, blob: Any) -> bool:
    """Is this encoded stream as seeding left it (nothing drawn from it since)?"""
    if not isinstance(blob, (bytes, bytearray)):
        return False
    if name == "python" and len(blob) == struct.calcsize(_PY_FORMAT):
        values = struct.unpack(_PY_FORMAT, blob)
        words, has_gauss = values[1:_N + 1], values[_N + 2]
        return words[0] == _ARRAY_SEEDED_WORD0 and values[_N + 1] == _N and not has_gauss
    if name == "numpy" and len(blob) == struct.calcsize(_NP_FORMAT):
        keys = np.frombuffer(bytes(blob[:_N * 4]), dtype="<u4")
        pos, has_gauss = struct.unpack_from("<ii", blob, _N * 4)
        if has_gauss or pos not in (_N - 1, _N):
            return False
        return int(keys[0]) == _ARRAY_SEEDED_WORD0 or \
            bool(np.array_equal(keys, _init_genrand(int(keys[0]))))
    return False


def stream_verdict(name: str, a: Any, b: Any) -> str:
    if a == b:
        return EQUAL
    if a is not None and b is not None and seeded_start(name, a) and seeded_start(name, b):
        return NEVER_DRAWN
    return DIFFERENT


def part_verdict(verdicts: List[str]) -> str:
    """A part is different if any piece is; never-drawn if that is all that differs."""
    if DIFFERENT in verdicts:
        return DIFFERENT
    return NEVER_DRAWN if NEVER_DRAWN in verdicts else EQUAL


def rng_part(a: Mapping[str, Any], b: Mapping[str, Any]) -> Dict[str, Any]:
    """Each stream's verdict (one side only: different) and the part's."""
    streams = {name: stream_verdict(name, a.get(name), b.get(name))
               for name in sorted(set(a) | set(b))}
    return {"verdict": part_verdict(list(streams.values())), "streams": streams}


def _shown(value: Any) -> Any:
    """A cursor value as JSON shows it: bytes by their length, not their contents."""
    return f"<{len(value)} bytes>" if isinstance(value, (bytes, bytearray)) else value


def _fields(value: Any, prefix: str) -> Dict[str, Any]:
    """Leaves of a cursor (sub)tree by dotted field name."""
    if isinstance(value, Mapping) and value:
        out: Dict[str, Any] = {}
        for key, item in value.items():
            out.update(_fields(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    if isinstance(value, list) and value:
        out = {}
        for i, item in enumerate(value):
            out.update(_fields(item, f"{prefix}[{i}]"))
        return out
    return {prefix: value}


def cursor_part(a: Optional[Mapping[str, Any]], b: Optional[Mapping[str, Any]]
                ) -> Dict[str, Any]:
    """The differing cursor fields by name (epoch, index, epoch_rng.numpy,
    loader_state..., docs/cursor.md), each with its verdict and both values."""
    if a is None and b is None:
        return {"verdict": NONE, "fields": {}}
    if a is None or b is None:
        return {"verdict": DIFFERENT, "fields": {"cursor": {
            "verdict": DIFFERENT, "a": None if a is None else "a cursor",
            "b": None if b is None else "a cursor"}}}
    fa, fb = _fields(a, ""), _fields(b, "")
    fields: Dict[str, Any] = {}
    for name in sorted(set(fa) | set(fb)):
        x, y = fa.get(name), fb.get(name)
        if x == y and (name in fa) == (name in fb):
            continue
        stream = name.split(".", 1)[1] if name.startswith(("epoch_rng.", "iter_rng.")) else ""
        verdict = stream_verdict(stream, x, y) if stream else DIFFERENT
        fields[name] = {"verdict": verdict, "a": _shown(x), "b": _shown(y)}
    return {"verdict": part_verdict([f["verdict"] for f in fields.values()]),
            "fields": fields}


def is_optimizer(entry: Mapping[str, Any], tree: Any = None) -> bool:
    """An optimizer's state: the state_dict every optimizer returns (``state`` and
    ``param_groups``), whatever class wrote it; without the tree (an object on one
    side only, not loaded), a torch.optim type other than a scheduler."""
    if tree is not None:
        return isinstance(tree, Mapping) and "state" in tree and "param_groups" in tree
    kind = str(entry.get("type") or "")
    return kind.startswith("torch.optim.") and ".lr_scheduler." not in kind \
        and ".swa_utils." not in kind
