"""``snapd diff --outputs A B --model MOD:FN``: the output check from the command line.

A and B are each a snapshot (any SNAPSHOT form) or a safetensors file (an export).
The model's code is the user's: ``--model module:function``, a zero-argument
factory returning the nn.Module (imported with the current directory on sys.path,
as ``python -c`` would); the inputs are ``--inputs module:function`` (returning a
tensor or a tuple of positional arguments) or ``--input-shape 4,16`` (a float32
``torch.randn`` from a fixed seed). The check itself is snapd/outputcheck.py. Exit 0
when the largest difference is within ``--tolerance`` (default 1e-2, above which
practice says something is wrong), 1 when it is not, 2 on a usage error.
"""

from __future__ import annotations

import importlib
import os
import sys
from contextlib import ExitStack
from typing import Any, Callable, Optional

import click

from snapd import outputcheck
from snapd.commands.common import emit_json, fail, optional_import
from snapd.commands.locate import files_of, resolve
from snapd.errors import SnapdError


def import_factory(spec: str, option: str) -> Callable[[], Any]:
    """``module:function`` imported from the current directory (or sys.path)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        fail(f"{option} {spec!r}: give module:function, e.g. {option} train:build_model", 2)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        fail(f"{option} {spec!r}: cannot import {module_name!r} from {os.getcwd()} or "
             f"sys.path: {e}", 2)
    factory = getattr(module, attr, None)
    if not callable(factory):
        fail(f"{option} {spec!r}: {module_name} has no function {attr!r}", 2)
    return factory


def parse_shape(text: str) -> tuple:
    try:
        shape = tuple(int(d) for d in text.split(","))
    except ValueError:
        shape = ()
    if not shape or any(d <= 0 for d in shape):
        fail(f"--input-shape {text!r}: comma-separated positive sizes, e.g. 4,16", 2)
    return shape


def side(stack: ExitStack, spec: str, root: Optional[str]) -> str:
    """A safetensors file as it is; anything else is a SNAPSHOT argument (its files
    kept where they are read for as long as ``stack`` is open)."""
    if os.path.isfile(spec):
        return os.path.abspath(spec)
    return stack.enter_context(files_of(*resolve(spec, root)))


def run(a: str, b: str, root: Optional[str], model: Optional[str], inputs: Optional[str],
        input_shape: Optional[str], wanted: Optional[str], device: str, tolerance: float,
        as_json: bool) -> int:
    """The check, printed; returns the exit code."""
    if not model:
        fail("--outputs needs the model's code: --model module:function (a "
             "zero-argument factory returning the nn.Module)", 2)
    if (inputs is None) == (input_shape is None):
        fail("--outputs needs the inputs: --inputs module:function or --input-shape 4,16 "
             "(one of them)", 2)
    build = import_factory(model, "--model")
    given = import_factory(inputs, "--inputs")() if inputs else \
        outputcheck.fixed_inputs(parse_shape(input_shape))
    with ExitStack() as stack:
        path_a, path_b = side(stack, a, root), side(stack, b, root)
        if path_a.endswith(".safetensors") or path_b.endswith(".safetensors"):
            optional_import("safetensors", "diff --outputs", "export")
        try:
            out = outputcheck.compare_outputs(build, path_a, path_b, given,
                                          object_name=wanted, device=device)
        except (SnapdError, ValueError, RuntimeError) as e:
            fail(f"the output check could not run: {e}", 1)
    code = 0 if out["max_abs"] <= tolerance else 1
    out.update(tolerance=tolerance, exit_code=code)
    if as_json:
        emit_json(out)
    else:
        click.echo(f"A = {a}\nB = {b}" + "".join(
            f"\n{label} loaded with strict=False over the model's base (trainable only)"
            for label, partial in zip("AB", out["partial"]) if partial))
        click.echo(out["message"])
    return code
