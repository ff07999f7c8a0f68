"""What hf_job.py leaves, read back for the Trainer's tests: a run's (or a rank's)
final weights and optimizer state, its log history without wall-clock figures, and
the bit-for-bit comparison of two such states (the Accelerate tests use it too)."""

from __future__ import annotations

import json
import os
from typing import Dict, Optional, Tuple

import torch

# An evaluation's runtime and throughput: measured, never the same twice
WALL_CLOCK = ("_runtime", "_samples_per_second", "_steps_per_second")


def read_final(out: str, rank: Optional[int] = None) -> Tuple[Dict[str, torch.Tensor], dict]:
    """(tensors, logged) of ``final.*`` in ``out``, or of ``final-rank<R>.*``."""
    from safetensors.torch import load_file
    name = "final" if rank is None else f"final-rank{rank}"
    with open(os.path.join(out, f"{name}.json")) as f:
        logged = json.load(f)
    logged["log_history"] = [{k: v for k, v in entry.items() if not k.endswith(WALL_CLOCK)}
                             for entry in logged["log_history"]]
    return load_file(os.path.join(out, f"{name}.safetensors")), logged


def assert_same_bits(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for key, tensor in want.items():
        other = got[key]
        assert (other.dtype, other.shape) == (tensor.dtype, tensor.shape), key
        assert torch.equal(other.reshape(-1).view(torch.uint8),
                           tensor.reshape(-1).view(torch.uint8)), key
