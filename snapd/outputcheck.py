"""The output check: the same fixed inputs through two sets of weights for one model,
and the largest absolute difference of what comes out.

An export is only as good as the model it rebuilds: a key dropped, a dtype cast, an
adapter applied over the wrong base all still load, and only the outputs show it.
So ``snapd diff --outputs`` (and ``snapd_client.compare_outputs``) builds the model
twice from the user's zero-argument factory, loads each side's weights into it, runs
the same inputs through both in eval mode without grad, and reports the largest
absolute difference over every floating tensor of the outputs (a tensor, a tuple,
a dict, or an object with ``logits``).

The thresholds are practice, not proof: up to about 1e-4 is numerical noise (another
kernel, a reduction order); above 1e-2 something is wrong (a missing tensor, another
base, a bad cast); in between, look (bfloat16 weights, a changed ``eps``).

A side is a snapshot directory (the module's full weights, strict load), a
safetensors file (strict, except one written by ``export --only-trainable``: loaded
with ``strict=False`` over the factory's model, which must hold the base: every key
in the file must exist in the model), or a state dict already in memory.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, Mapping, Optional, Tuple, Union

import torch

from snapd.errors import IncompatibleState, InvalidOption
from snapd.globalsnap import open_snapshot
from snapd.weights import modules, weights

NOISE = 1e-4   # at or below: numerical noise
WRONG = 1e-2   # above: something is wrong

Side = Union[str, Mapping[str, torch.Tensor]]


@dataclass(frozen=True)
class Weights:
    """One side's state dict, whether it is partial (loaded over the factory's base),
    and what it is, for messages."""

    state: Dict[str, torch.Tensor]
    partial: bool
    label: str


def verdict(diff: float) -> str:
    """``noise``, ``look`` or ``wrong``, by the thresholds of practice."""
    if not math.isfinite(diff) or diff > WRONG:
        return "wrong"
    return "noise" if diff <= NOISE else "look"


def message(diff: float) -> str:
    """The result in one line, with the thresholds, so it reads alone."""
    head = f"largest absolute output difference {diff:.3g}"
    return {"noise": f"{head}: numerical noise (<= {NOISE:g}); the two agree",
            "look": f"{head}: above noise ({NOISE:g}) but below {WRONG:g}: look at it "
                    "(reduced precision, another kernel?) before trusting the export",
            "wrong": f"{head}: above {WRONG:g}, something is wrong (a missing or extra "
                     "tensor, another base, a bad cast)"}[verdict(diff)]


def load_side(side: Side, wanted: Optional[str] = None) -> Weights:
    """A side's weights: a safetensors file, a snapshot directory (its one module, or
    ``wanted``), or a state dict."""
    if isinstance(side, Mapping):
        return Weights(dict(side), False, "state dict")
    path = str(side)
    if os.path.isfile(path):
        from safetensors import safe_open
        with safe_open(path, "pt") as f:
            meta = f.metadata() or {}
            state = {k: f.get_tensor(k) for k in f.keys()}
        return Weights(state, meta.get("snapd.only_trainable") == "true", path)
    snap = open_snapshot(path)
    found = [wanted] if wanted else modules(snap)
    if len(found) != 1 or found[0] not in snap.objects:
        raise InvalidOption(f"{path}: choose the module with object_name= (--object): "
                            f"modules here are {', '.join(modules(snap)) or 'none'}",
                            path=path, field="object_name")
    state, _ = weights(snap, found[0])
    return Weights(state, False, path)


def _apply(model: torch.nn.Module, side: Weights) -> None:
    if not side.partial:
        model.load_state_dict(side.state)
        return
    result = model.load_state_dict(side.state, strict=False)
    if result.unexpected_keys:
        raise IncompatibleState(f"{side.label}: keys the model lacks: "
                                f"{', '.join(result.unexpected_keys[:5])}: another model?",
                                path=side.label, field=result.unexpected_keys[0])


def _tensors(out: Any) -> Iterator[torch.Tensor]:
    """Every floating (or complex) tensor of a model's output, in a fixed order."""
    if isinstance(out, torch.Tensor):
        if out.is_floating_point() or out.is_complex():
            yield out
    elif hasattr(out, "logits") and isinstance(getattr(out, "logits"), torch.Tensor):
        yield from _tensors(out.logits)
    elif isinstance(out, Mapping):
        for key in sorted(out, key=str):
            yield from _tensors(out[key])
    elif isinstance(out, (list, tuple)):
        for item in out:
            yield from _tensors(item)


def run_model(build: Callable[[], torch.nn.Module], side: Weights, inputs: Any,
              device: str = "cpu") -> list:
    """The outputs of the factory's model with ``side``'s weights, on CPU."""
    with torch.random.fork_rng():   # a factory that draws initial weights draws the
        torch.manual_seed(0)        # same ones each time: a partial side needs that
        model = build()
    _apply(model, side)
    model.to(device).eval()
    args = inputs if isinstance(inputs, tuple) else (inputs,)
    args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)
    with torch.no_grad():
        return [t.detach().to("cpu") for t in _tensors(model(*args))]


def largest_difference(a: list, b: list) -> float:
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)):
        raise IncompatibleState("the two models' outputs differ in number or shape: "
                                f"{[tuple(x.shape) for x in a]} against "
                                f"{[tuple(y.shape) for y in b]}", field="outputs")
    if not a:
        raise IncompatibleState("the model returned no floating-point tensor to "
                                "compare; give a model whose forward() returns one (or "
                                "a list, tuple or dict holding them)", field="outputs")
    worst = 0.0
    for x, y in zip(a, b):
        d = (x.to(torch.float64) - y.to(torch.float64)).abs()
        if d.numel():
            worst = max(worst, float(torch.nan_to_num(d, nan=math.inf).max()))
    return worst


def compare_outputs(build: Callable[[], torch.nn.Module], a: Side, b: Side, inputs: Any,
                    *, object_name: Optional[str] = None, device: str = "cpu"
                    ) -> Dict[str, Any]:
    """The output check (module docstring). ``a``/``b``: a snapshot directory, a
    safetensors file or a state dict; ``object_name``: a snapshot's module when it
    tracks several. Returns ``{"max_abs", "verdict", "message", "outputs" (their
    shapes), "a", "b", "partial"}``."""
    side_a, side_b = load_side(a, object_name), load_side(b, object_name)
    out_a = run_model(build, side_a, inputs, device)
    out_b = run_model(build, side_b, inputs, device)
    diff = largest_difference(out_a, out_b)
    return {"max_abs": diff, "verdict": verdict(diff), "message": message(diff),
            "outputs": [list(t.shape) for t in out_a], "a": side_a.label,
            "b": side_b.label, "partial": [side_a.partial, side_b.partial]}


def fixed_inputs(shape: Tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """``--input-shape``: a float32 ``torch.randn`` of ``shape`` from a fixed seed."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
