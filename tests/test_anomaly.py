"""The anomaly rule (snapd_client/anomaly.py): robust z-scores, non-finite values,
episodes, and the options that set it."""

from __future__ import annotations

import math
import random

import pytest

from snapd.errors import InvalidOption
from snapd.options import Options
from snapd_client.anomaly import MIN_WINDOW, AnomalyDetector, SortedWindow, robust_z

# 20 losses around 1.0: median 1.0, MAD 0.1 (12 of them 0.9 or 1.1).
WINDOW = [1.0] * 8 + [0.9] * 6 + [1.1] * 6


@pytest.mark.parametrize("value, window, expected", [
    (1.0, WINDOW, 0.0),                          # at the median
    (1.1, WINDOW, 0.6745),                       # one MAD above
    (2.0, WINDOW, 6.745),                        # ten MADs above
    (0.0, WINDOW, -6.745),                       # as far below: negative
    (5.0, WINDOW[:MIN_WINDOW - 1], None),        # too few losses to judge
    (5.0, [1.0] * 30, None),                     # no spread: MAD 0 judges nothing
    (5.0, [1.0] * 25 + [100.0] * 5, None),       # outliers move neither median nor MAD
])
def test_robust_z_table(value, window, expected):
    z = robust_z(value, window)
    if expected is None:
        assert z is None
    else:
        assert z == pytest.approx(expected, abs=1e-9)


def test_outliers_in_the_window_do_not_hide_the_next_spike():
    window = WINDOW + [50.0, 60.0]   # two earlier spikes (kept out by the detector anyway)
    assert robust_z(2.0, window) > 6


def feed(detector, losses, start=1, **extra):
    return [(s, a) for s, a in ((start + i, detector.observe(start + i, {"loss": v, **extra}))
                                for i, v in enumerate(losses)) if a is not None]


@pytest.mark.parametrize("losses, expected", [
    (WINDOW + [float("nan")], [(21, "nonfinite:loss")]),
    ([float("inf")], [(1, "nonfinite:loss")]),               # no window needed
    (WINDOW + [2.0], [(21, "spike")]),                        # z 6.7 > 6
    (WINDOW + [1.8], []),                                     # z 5.4: below
    (WINDOW + [0.0], []),                                     # a fall is no anomaly
    (WINDOW + [float("nan")] * 5, [(21, "nonfinite:loss")]),  # one episode
    (WINDOW + [float("nan"), 1.0, float("nan")],              # ended, a second one
     [(21, "nonfinite:loss"), (23, "nonfinite:loss")]),
    (WINDOW + [2.0, 3.0, 1.0, 2.0],                           # spikes stay out of the
     [(21, "spike"), (24, "spike")]),                         # window
])
def test_detector_table(losses, expected):
    found = feed(AnomalyDetector(6.0, 100), losses)
    assert [(s, a.cause) for s, a in found] == expected


def test_a_non_finite_grad_norm_is_an_anomaly_with_a_finite_loss():
    found = AnomalyDetector(6.0, 100).observe(7, {"loss": 0.5, "grad_norm": math.nan})
    assert found.cause == "nonfinite:grad_norm" and found.step == 7
    assert math.isnan(found.value)


def test_spike_record_carries_z_and_median():
    (step, found), = feed(AnomalyDetector(6.0, 100), WINDOW + [2.0])
    assert found.record() == {"step": 21, "cause": "spike", "value": 2.0,
                              "z": pytest.approx(6.745), "median": 1.0}


def test_threshold_zero_notices_only_non_finite_values():
    assert feed(AnomalyDetector(0.0, 100), WINDOW + [100.0]) == []
    assert feed(AnomalyDetector(0.0, 100), WINDOW + [math.nan])[0][1].cause == \
        "nonfinite:loss"


def test_the_window_is_bounded():
    detector = AnomalyDetector(6.0, 20)
    feed(detector, [100.0] * 20 + WINDOW)   # the old level leaves the window
    assert feed(detector, [2.0], start=41)[0][1].cause == "spike"


@pytest.mark.parametrize("field, value", [("anomaly_z", -1.0), ("anomaly_z", math.inf),
                                          ("anomaly_z", "high"), ("anomaly_window", 5),
                                          ("anomaly_window", 50.5)])
def test_bad_anomaly_options_are_refused_by_name(field, value):
    with pytest.raises(InvalidOption) as e:
        Options(**{field: value})
    assert e.value.field == field


def test_anomaly_options_from_the_environment():
    opts = Options.resolve(environ={"SNAPD_ANOMALY_Z": "4.5", "SNAPD_ANOMALY_WINDOW": "40"})
    assert (opts.anomaly_z, opts.anomaly_window) == (4.5, 40)


@pytest.mark.parametrize("seed", range(40))
def test_the_detectors_sorted_window_gives_robust_z(seed):
    """What the detector computes per step, incrementally, is robust_z's value."""
    rng = random.Random(seed)
    size = rng.choice([20, 21, 50])
    values = [round(rng.gauss(1.0, 0.1), rng.choice([1, 2, 6])) for _ in range(size * 3)]
    window = SortedWindow(size)
    for i, v in enumerate(values):
        window.add(v)
        probe = rng.choice([v, 1.0, 1.3, 5.0])
        z = robust_z(probe, values[max(0, i + 1 - size):i + 1])
        expected = z if z is not None and z > 0 else None
        got = window.z(probe)
        assert (got is None and expected is None) or got == pytest.approx(expected), i
