"""What the multi-rank job scripts share: their one JSON argument, the per-step
progress line, and each rank's final state as plain arrays for ``numpy.savez``
(read back with ``allow_pickle=False``, so nothing here is an object array).

Keys of a state file: ``param/<name>``, ``opt/<index>/<key>`` (optimizer state by
parameter index), ``rng/torch``, ``rng/python``, ``rng/python_gauss``,
``rng/numpy_keys``, ``rng/numpy_pos``, ``rng/numpy_gauss``, ``step``, ``first_step``
(the step the job started from: 0, or the step restore() returned), ``samples``
(dataset indices consumed since ``first_step``, in order) and ``losses``.
"""

from __future__ import annotations

import json
import os
import random
import sys
from typing import Any, Dict

import numpy as np
import torch


def config(defaults: Dict[str, Any]) -> Dict[str, Any]:
    """The job's settings: ``defaults`` updated by the JSON object in argv[1]."""
    cfg = dict(defaults)
    cfg.update(json.loads(sys.argv[1]) if len(sys.argv) > 1 else {})
    return cfg


def as_array(value: Any) -> np.ndarray:
    """A tensor (a DTensor's full tensor, taken by the caller) or number as an array
    with the same bytes; bfloat16 and friends travel as their raw bytes."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        try:
            return t.numpy().copy()
        except TypeError:   # a dtype numpy lacks
            return t.view(torch.uint8).numpy().copy()
    return np.asarray(value)


def rng_arrays() -> Dict[str, np.ndarray]:
    """Every RNG stream of this process (torch CPU, python, numpy) as arrays."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {"rng/torch": torch.get_rng_state().numpy().copy(),
            "rng/python": np.asarray(internal, dtype=np.uint64),
            "rng/python_gauss": np.asarray([np.nan if gauss is None else gauss]),
            "rng/numpy_keys": np.asarray(keys), "rng/numpy_pos": np.asarray([pos, has_gauss]),
            "rng/numpy_gauss": np.asarray([cached])}


def optimizer_arrays(state: Dict[int, Dict[str, Any]], full=lambda t: t) -> Dict[str, np.ndarray]:
    """``opt/<index>/<key>`` for each tensor or number of an optimizer's state;
    ``full`` turns a sharded tensor into the whole one (a collective: every rank
    must call it in the same order, hence the sorted walk)."""
    out = {}
    for index in sorted(state):
        for key in sorted(state[index]):
            out[f"opt/{index}/{key}"] = as_array(full(state[index][key]))
    return out


def tracked_arrays(rng_state: Dict[str, bytes], **objects: Any) -> Dict[str, np.ndarray]:
    """What a snapshot taken now would hold, bit for bit: every tensor leaf of each
    object's state dict as snapd flattens it, keyed ``<name>/<i>``, as raw bytes; and
    each RNG stream's state (``rng_state``: the client's capture), keyed ``rng:<stream>``."""
    from snapd_client.state import flatten
    arrays = {f"{name}/{i}": t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
              for name, obj in objects.items()
              for i, t in enumerate(flatten(obj.state_dict(), name).tensors)}
    arrays.update({f"rng:{k}": np.frombuffer(v, dtype=np.uint8).copy()
                   for k, v in rng_state.items()})
    return arrays


class Progress:
    """One JSON line per step, written at once (a SIGKILL loses none that were
    written): what a killed job did before it died."""

    def __init__(self, path: str) -> None:
        self.file = open(path, "a", buffering=1)

    def step(self, step: int, loss: float, samples) -> None:
        self.file.write(json.dumps({"step": step, "loss": loss,
                                    "samples": [int(i) for i in samples]}) + "\n")


def write_marker(out: str, name: str) -> None:
    """An empty file the test waits for; written whole by rename."""
    tmp = os.path.join(out, f".{name}.tmp")
    open(tmp, "w").close()
    os.replace(tmp, os.path.join(out, name))


def leave_job() -> None:
    """End this rank once every rank has written its results: a barrier, then exit
    without tearing down the process groups.

    torch's gloo backend aborts a rank now and then while it tears its groups down at
    exit (``terminate called without an active exception``, SIGABRT, even after
    ``destroy_process_group()``): 2 runs in 40 of the plain DDP job without snapd,
    1 in 60 with a barrier before ``destroy_process_group()``, 0 in 60 this way. The
    results are written and flushed before; nothing of snapd is left to run (close()
    has returned), so the teardown only risks the exit code the tests check.
    """
    import torch.distributed as dist
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
