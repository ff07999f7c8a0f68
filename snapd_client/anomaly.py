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

import math
from collections import deque
from dataclasses import dataclass
from statistics import median
from typing import Deque, Dict, Iterable, Optional

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


class AnomalyDetector:
    """Watches the scalars of each logged step (the module's rule)."""

    def __init__(self, z_threshold: float, window: int) -> None:
        self.z_threshold, self.window = z_threshold, window
        self._losses: Deque[float] = deque(maxlen=window)
        self._in_episode = False

    def observe(self, step: int, scalars: Dict[str, float]) -> Optional[Anomaly]:
        """The anomaly ``step`` begins, or None (a normal step, or one more step of
        an episode already reported)."""
        found = self._judge(step, scalars)
        if found is None:
            self._in_episode = False
            if "loss" in scalars:
                self._losses.append(float(scalars["loss"]))
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
        z = robust_z(loss, self._losses)
        if z is not None and z > self.z_threshold:
            return Anomaly(step, "spike", loss, z=z, median=median(self._losses))
        return None
