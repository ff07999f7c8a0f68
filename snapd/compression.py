"""Whether zstd pays for a tensor: compression 'off', a fixed level, or 'auto'.

'auto' decides from two numbers. The *ratio* is measured on the tensor's data: its
first chunk compressed at level 1, stored size over raw size. The *rate* is how fast
zstd level 1 emits the bytes it cannot shrink on this machine; it is an argument
(tests pass one, so the decision is deterministic) and by default measured once per
process on a fixed sample, best of a few runs, then cached. No decision rests on
timing the tensor itself: one timing on a busy machine flipped it.

The model: compressing ``n`` bytes to ``ratio * n`` costs ``ratio * n / rate`` (zstd's
time goes into the bytes it cannot match: a run of zeros is nearly free, noise is
not), then writing them costs ``ratio * n / disk``; writing raw costs ``n / disk``.
Compression pays when ``ratio < rate / (rate + disk)`` (docs/format.md).
"""

from __future__ import annotations

import functools
import time
from typing import Optional, Union

import numpy as np

from snapd import format as fmt

# The disk speed assumed: sequential direct-I/O writes on the machines measured in
# docs/benchmarks.md. Not measured at run time: a benchmark write would cost seconds.
DISK_BYTES_PER_S = 1.5e9
MIN_TENSOR_BYTES = 4096      # smaller tensors are stored raw: too small to pay
_CALIBRATION_BYTES = 4 << 20
_CALIBRATION_RUNS = 3


def pays(ratio: float, zstd_bytes_per_s: float,
         disk_bytes_per_s: float = DISK_BYTES_PER_S) -> bool:
    """True when compressing to ``ratio`` and writing beats writing the raw bytes."""
    return ratio < zstd_bytes_per_s / (zstd_bytes_per_s + disk_bytes_per_s)


@functools.lru_cache(maxsize=1)
def measured_zstd_rate() -> float:
    """zstd level 1's output rate on this machine (bytes/s), measured once per process.

    The sample is float32 noise, the bulk of a checkpoint and what zstd cannot shrink
    much; the best of a few runs, so that a moment of contention does not set it.
    """
    sample = np.random.default_rng(0).standard_normal(_CALIBRATION_BYTES // 4,
                                                       dtype=np.float32).tobytes()
    fmt.encode_chunk(sample[:64], 1)  # a first call pays for the compressor's setup
    best = 0.0
    for _ in range(_CALIBRATION_RUNS):
        t0 = time.perf_counter()
        packed = fmt.encode_chunk(sample, 1)[0]
        best = max(best, len(packed) / max(time.perf_counter() - t0, 1e-9))
    return best


class CompressionPolicy:
    """Decides per tensor which zstd level to use, or None for raw chunks."""

    def __init__(self, setting: Union[str, int], zstd_bytes_per_s: Optional[float] = None,
                 disk_bytes_per_s: float = DISK_BYTES_PER_S) -> None:
        self.setting = setting
        self.rate = zstd_bytes_per_s
        self.disk = disk_bytes_per_s

    def level_for(self, data: memoryview, chunk_bytes: int) -> Optional[int]:
        if self.setting == "off" or len(data) < MIN_TENSOR_BYTES:
            return None
        if isinstance(self.setting, int):
            return self.setting
        sample = data[:chunk_bytes]
        ratio = len(fmt.encode_chunk(sample, 1)[0]) / len(sample)
        rate = self.rate if self.rate is not None else measured_zstd_rate()
        return 1 if pays(ratio, rate, self.disk) else None
