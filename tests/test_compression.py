"""compression='auto' decides from the sample's ratio and a rate the caller can give:
the same data and rate give the same decision, however busy the machine is."""

from __future__ import annotations

import itertools
import time

import torch

from snapd import compression
from snapd.compression import CompressionPolicy, pays
from snapd.options import Options
from snapd.reader import SnapshotReader
from snapd.store import RunStore
from snapd.writer import write_snapshot

from helpers import plan_for

CHUNK = 64 << 10
DISK = 1.5e9


def as_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")


def bf16_noise() -> memoryview:  # shrinks to ~0.78 at level 1
    return as_bytes(torch.randn(1 << 16, generator=torch.Generator().manual_seed(0))
                    .to(torch.bfloat16))


def test_a_fast_compressor_compresses_what_shrinks_a_little():
    policy = CompressionPolicy("auto", zstd_bytes_per_s=100 * DISK, disk_bytes_per_s=DISK)
    assert policy.level_for(bf16_noise(), CHUNK) == 1


def test_a_slow_compressor_writes_what_shrinks_a_little_raw():
    policy = CompressionPolicy("auto", zstd_bytes_per_s=DISK / 10, disk_bytes_per_s=DISK)
    assert policy.level_for(bf16_noise(), CHUNK) is None


def test_a_slow_compressor_still_compresses_zeros():
    policy = CompressionPolicy("auto", zstd_bytes_per_s=DISK / 10, disk_bytes_per_s=DISK)
    assert policy.level_for(as_bytes(torch.zeros(1 << 16)), CHUNK) == 1


def test_the_rule_is_the_documented_threshold():
    assert pays(0.49, 1e9, 1e9) and not pays(0.51, 1e9, 1e9)
    assert pays(0.10, 1e9, 8e9) and not pays(0.12, 1e9, 8e9)


def test_off_fixed_levels_and_small_tensors_need_no_decision():
    data = as_bytes(torch.zeros(1 << 16))
    assert CompressionPolicy("off").level_for(data, CHUNK) is None
    assert CompressionPolicy(7).level_for(data, CHUNK) == 7
    assert CompressionPolicy("auto", zstd_bytes_per_s=1e12).level_for(data[:4000],
                                                                      CHUNK) is None


def test_the_default_rate_is_measured_once_per_process(monkeypatch):
    compression.measured_zstd_rate.cache_clear()
    calls = []
    real = compression.fmt.encode_chunk
    monkeypatch.setattr(compression.fmt, "encode_chunk",
                        lambda raw, level: calls.append(len(raw)) or real(raw, level))
    first = compression.measured_zstd_rate()
    measuring = len(calls)
    assert first > 0 and measuring > 0
    assert compression.measured_zstd_rate() == first and len(calls) == measuring


def test_auto_does_not_depend_on_how_long_one_compression_took(tmp_path, monkeypatch):
    """A clock that jumps 10 s between reads: as if the machine stalled at each timing.
    The old policy timed the tensor's own compression and wrote zeros raw."""
    ticks = itertools.count(step=10.0)
    monkeypatch.setattr(time, "perf_counter", lambda: next(ticks))
    monkeypatch.setattr(compression, "measured_zstd_rate", lambda: 1e9)
    state = {"zeros": torch.zeros(1 << 18), "noise": torch.randn(1 << 14)}
    result = write_snapshot(RunStore(str(tmp_path), "r"), plan_for(state),
                            Options(compression="auto", chunk_bytes=4096))
    tensors = SnapshotReader(result.path).objects["model"]["tensors"]
    codecs = {t["path"]: {c[3] for c in t["chunks"]} for t in tensors}
    assert codecs == {".zeros": {"zstd"}, ".noise": {"raw"}}, codecs
