"""Anomalies in the logged loss: what ``Client.log`` notices, by a rule simple enough
to state in one paragraph (docs/operations.md, "Anomalies and pins").

A step is anomalous when

- its ``loss`` or ``grad_norm`` is not finite (NaN or an infinity): cause
  ``nonfinite:loss`` / ``nonfinite:grad_norm``; or
- its ``loss`` spikes: the robust z-score of the loss against the window of the last
  ``anomaly_window`` finite losses before it,
  ``z = 0.6745 * (loss - median) / MAD`` (MAD: the median of the absolute deviations
  from the median; 0.6745 makes it comparable to a standard score for normal noise),
  exceeds ``anomaly_z`` (default 6): cause ``spike``. Only upward spikes count (a loss
  that falls is no anomaly); the window must hold at least ``MIN_WINDOW`` losses; a
  window with no spread (MAD 0) judges no spike. ``anomaly_z=0`` turns spikes off
  (non-finite values are still noticed).

Why robust statistics: a mean and a standard deviation over a window that holds one
spike are dragged by it, so the next spike hides; the median and MAD are not moved by
a few outliers, and the slow fall of the loss over a window moves them only slowly.

An anomaly is one episode: the steps right after it that are anomalous too (a NaN
stays NaN) belong to it, and give no new record or warning; the first normal step
ends it. Anomalous losses never enter the window.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass
from statistics import median
from typing import Deque, Dict, Iterable, List, Optional

# Fewer losses than this in the window: no spike is judged (the first steps of a run
# move too fast for a median to mean anything).
MIN_WINDOW = 20
# 0.6745 = the normal distribution's 0.75 quantile: MAD / 0.6745 estimates sigma.
MAD_SCALE = 0.6745
WATCHED = ("loss", "grad_norm")   # the scalars whose non-finite values are anomalies


class AnomalyWarning(UserWarning):
    """A logged step is anomalous (a non-finite loss or grad norm, or a loss spike);
    the newest snapshot before it is pinned."""


@dataclass(frozen=True)
class Anomaly:
    step: int
    cause: str                      # "nonfinite:loss", "nonfinite:grad_norm", "spike"
    value: float
    z: Optional[float] = None       # spike: the robust z-score
    median: Optional[float] = None  # spike: the window's median loss

    def record(self) -> Dict[str, object]:
        """The fields of the log's "anomaly" record (docs/format.md)."""
        fields: Dict[str, object] = {"step": self.step, "cause": self.cause,
                                     "value": self.value}
        if self.z is not None:
            fields.update(z=self.z, median=self.median)
        return fields

    def describe(self) -> str:
        if self.cause == "spike":
            return (f"loss {self.value!r} is a spike: robust z-score {self.z:.1f} against "
                    f"the window's median {self.median!r}")
        return f"{self.cause.split(':', 1)[1]} is {self.value!r}"


def robust_z(value: float, window: Iterable[float]) -> Optional[float]:
    """``value``'s robust z-score against ``window``; None when the window is shorter
    than MIN_WINDOW or has no spread (MAD 0)."""
    values = list(window)
    if len(values) < MIN_WINDOW:
        return None
    mid = median(values)
    mad = median(abs(v - mid) for v in values)
    if mad == 0:
        return None
    return MAD_SCALE * (value - mid) / mad


class SortedWindow:
    """The last ``size`` values, kept sorted too, so that a step costs a few
    microseconds, not a sort: the median is read off the middle, and the MAD, needed
    only for a value above the median, is the k-th smallest deviation, found by
    walking outwards from the median (the deviations on each side come in order)."""

    def __init__(self, size: int) -> None:
        self._order: Deque[float] = deque()
        self._sorted: List[float] = []
        self.size = size

    def __len__(self) -> int:
        return len(self._sorted)

    def add(self, value: float) -> None:
        if len(self._order) == self.size:
            old = self._order.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]
        self._order.append(value)
        bisect.insort(self._sorted, value)

    def median(self) -> float:
        a, n = self._sorted, len(self._sorted)
        return a[n // 2] if n % 2 else (a[n // 2 - 1] + a[n // 2]) / 2

    def mad(self, mid: float) -> float:
        """The median of |v - mid| over the window (``mid``: its median)."""
        a, n = self._sorted, len(self._sorted)
        i = bisect.bisect_left(a, mid) - 1    # left side, walking down
        j = i + 1                             # right side, walking up
        wanted = (n // 2,) if n % 2 else (n // 2 - 1, n // 2)
        found: List[float] = []
        for k in range(wanted[-1] + 1):
            if j >= n or (i >= 0 and mid - a[i] <= a[j] - mid):
                d, i = mid - a[i], i - 1
            else:
                d, j = a[j] - mid, j + 1
            if k in wanted:
                found.append(d)
        return sum(found) / len(found)

    def z(self, value: float) -> Optional[float]:
        """:func:`robust_z` of ``value`` against the window, None below its median."""
        if len(self._sorted) < MIN_WINDOW:
            return None
        mid = self.median()
        if value <= mid:
            return None   # not a rise: never a spike
        mad = self.mad(mid)
        return None if mad == 0 else MAD_SCALE * (value - mid) / mad


class AnomalyDetector:
    """Watches the scalars of each logged step (the module's rule)."""

    def __init__(self, z_threshold: float, window: int) -> None:
        self.z_threshold, self.window = z_threshold, window
        self._losses = SortedWindow(window)
        self._in_episode = False

    def observe(self, step: int, scalars: Dict[str, float]) -> Optional[Anomaly]:
        """The anomaly ``step`` begins, or None (a normal step, or one more step of
        an episode already reported)."""
        found = self._judge(step, scalars)
        if found is None:
            self._in_episode = False
            if "loss" in scalars:
                self._losses.add(float(scalars["loss"]))
            return None
        if self._in_episode:
            return None
        self._in_episode = True
        return found

    def _judge(self, step: int, scalars: Dict[str, float]) -> Optional[Anomaly]:
        for name in WATCHED:
            if name in scalars and not math.isfinite(float(scalars[name])):
                return Anomaly(step, f"nonfinite:{name}", float(scalars[name]))
        if "loss" not in scalars or not self.z_threshold:
            return None
        loss = float(scalars["loss"])
        z = self._losses.z(loss)
        if z is not None and z > self.z_threshold:
            return Anomaly(step, "spike", loss, z=z, median=self._losses.median())
        return None
