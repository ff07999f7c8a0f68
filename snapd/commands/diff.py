"""``snapd diff A B``: two snapshots compared tensor by tensor, and value by value.

For every object present in both, each tensor is matched by its path. Floating types
(bfloat16, float16 and float8 included) and complex ones are compared in float64:
the largest absolute difference, and the largest relative one, |a - b| / max(|a|, |b|).
Integers and bools are compared exactly. A tensor is *equal* only when its bytes are
identical (so -0.0 against 0.0, or two NaN payloads, count as different even with a
difference of 0). Shape or dtype mismatches, tensors and objects on one side only,
plain state values (an optimizer's lr, a scheduler's epoch), RNG streams and the data
cursor are reported too.

Then a verdict per part (snapd/commands/diffparts.py): weights (every tracked object
but the optimizers: weights, buffers, schedulers, values), optimizer, RNG (streams
only seeded differently and never drawn from are said to be so, not a difference),
cursor (the differing field named). Exit code 0 when weights and optimizer are equal,
1 when either differs; with ``--strict``, 1 on any difference at all.

``--outputs``: not the tensors but what the model makes of them: the same inputs
through the model built from A and from B (a snapshot or a safetensors export), the
largest output difference against the thresholds of practice
(snapd/commands/diffoutputs.py, snapd/outputcheck.py).

Each side is named RUN/NAME, or by its snapshot directory where RUN/NAME would name
both (runs of one name under two roots); ``--json`` gives the labels as ``a`` and
``b`` and both directories as ``paths``.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple

import click
import numpy as np
import torch
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from snapd import outputcheck as output_check
from snapd.commands import diffoutputs, diffparts as parts
from snapd.commands.common import (ROOT_HELP, console as out_console, emit_json, fail,
                                   open_reader)
from snapd.commands.locate import files_of, resolve
from snapd.errors import CorruptSnapshot
from snapd.weights import state_leaves
from snapd.reader import SnapshotReader
from snapd.roots import Snap
from snapd.skeleton import unflatten
from snapd.humanize import count

_SLICE = 1 << 22  # elements compared at a time: bounds the float64 copies


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _as_float64(t: torch.Tensor) -> torch.Tensor:
    if t.is_complex():
        return torch.view_as_real(t.to(torch.complex128)).reshape(-1)
    return t.reshape(-1).to(torch.float64)


def _float_stats(a: torch.Tensor, b: torch.Tensor) -> Tuple[float, float, int]:
    """Max |a-b|, max relative difference, elements whose values differ (slice by slice)."""
    fa, fb = _as_float64(a), _as_float64(b)
    max_abs = max_rel = 0.0
    differ = 0
    for start in range(0, fa.numel(), _SLICE):
        x, y = fa[start:start + _SLICE], fb[start:start + _SLICE]
        same = (x == y) | (torch.isnan(x) & torch.isnan(y))
        d = (x - y).abs()
        d = torch.where(same, torch.zeros_like(d), torch.nan_to_num(d, nan=math.inf))
        scale = torch.maximum(x.abs(), y.abs())
        rel = torch.where(d == 0, torch.zeros_like(d), d / scale)
        differ += int((~same).sum())
        if d.numel():
            max_abs = max(max_abs, float(d.max()))
            max_rel = max(max_rel, float(torch.nan_to_num(rel, nan=math.inf).max()))
    return max_abs, max_rel, differ


def _exact_stats(a: torch.Tensor, b: torch.Tensor) -> Tuple[float, Optional[float], int]:
    """Integers and bools: exact comparison; the max difference as a float (informative)."""
    x, y = a.reshape(-1).numpy(), b.reshape(-1).numpy()
    differ = int(np.count_nonzero(x != y))
    if not differ:
        return 0.0, 0.0, 0
    if x.dtype == np.bool_:
        return 1.0, None, differ
    return float(np.abs(x.astype(np.float64) - y.astype(np.float64)).max()), None, differ


def compare_tensor(a: torch.Tensor, b: torch.Tensor) -> Dict[str, Any]:
    row: Dict[str, Any] = {"dtype": str(a.dtype).removeprefix("torch."),
                           "shape": list(a.shape)}
    if a.dtype != b.dtype or a.shape != b.shape:
        row.update(status="mismatch", dtype_b=str(b.dtype).removeprefix("torch."),
                   shape_b=list(b.shape), max_abs=None, max_rel=None, elements_different=None)
        return row
    identical = torch.equal(_bits(a), _bits(b))
    if a.is_floating_point() or a.is_complex():
        max_abs, max_rel, differ = _float_stats(a, b)
    else:
        max_abs, max_rel, differ = _exact_stats(a, b)
    row.update(status="equal" if identical else "different", max_abs=max_abs,
               max_rel=max_rel, elements_different=differ)
    if not identical and differ == 0:
        row["note"] = "values equal but bit patterns differ (signed zero or NaN payload)"
    return row


def _load(reader: SnapshotReader, name: str
          ) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any], bool]:
    """An object's tensors by path, its plain (non-tensor) leaves by path, and
    whether it is an optimizer's state."""
    entry = reader.objects[name]
    tensors = reader.load_object(name)
    tree = unflatten(entry["skeleton"], tensors, source=f"{reader.path}/{entry.get('file')}")
    plain = {p: v for p, v in state_leaves(tree)
             if not isinstance(v, (torch.Tensor, np.ndarray))}
    return ({t["path"]: x for t, x in zip(entry["tensors"], tensors)}, plain,
            parts.is_optimizer(entry, tree))


def _same_value(x: Any, y: Any) -> bool:
    if isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y):
        return True
    return type(x) is type(y) and x == y


def compare(a: SnapshotReader, b: SnapshotReader, objects: Optional[List[str]]) -> Dict[str, Any]:
    names_a, names_b = set(a.objects), set(b.objects)
    if objects:
        unknown = [n for n in objects if n not in names_a | names_b]
        if unknown:
            fail(f"--object {unknown[0]!r}: neither snapshot holds it; they hold "
                 f"{sorted(names_a | names_b)}", 2)
        names_a &= set(objects)
        names_b &= set(objects)
    out: Dict[str, Any] = {"objects": {}, "only_in_a": sorted(names_a - names_b),
                           "only_in_b": sorted(names_b - names_a)}
    optimizers = {n for n in names_a ^ names_b
                  if parts.is_optimizer((a.objects.get(n) or b.objects.get(n)))}
    for name in sorted(names_a & names_b):
        ta, pa, opt_a = _load(a, name)
        tb, pb, opt_b = _load(b, name)
        if opt_a or opt_b:
            optimizers.add(name)
        rows = {p: compare_tensor(ta[p], tb[p]) for p in ta if p in tb}
        values = {p: {"a": pa.get(p), "b": pb.get(p)}
                  for p in sorted(set(pa) | set(pb))
                  if p not in pa or p not in pb or not _same_value(pa[p], pb[p])}
        out["objects"][name] = {"tensors": rows, "only_in_a": sorted(set(ta) - set(tb)),
                                "only_in_b": sorted(set(tb) - set(ta)),
                                "values_different": values}
    ma, mb = a.manifest, b.manifest
    streams = sorted(set(ma["rng"]) | set(mb["rng"]))
    out["rng_different"] = [s for s in streams if ma["rng"].get(s) != mb["rng"].get(s)]
    out["cursor_equal"] = ma.get("cursor") == mb.get("cursor")
    out["steps"] = [ma["step"], mb["step"]]
    out["equal"] = _all_equal(out)
    out["parts"] = _parts(out, optimizers, ma, mb)
    return out


def _object_equal(out: Dict[str, Any], name: str) -> bool:
    o = out["objects"].get(name)
    return o is not None and not o["only_in_a"] and not o["only_in_b"] \
        and not o["values_different"] and all(r["status"] == "equal"
                                              for r in o["tensors"].values())


def _parts(out: Dict[str, Any], optimizers: set, ma: Dict[str, Any], mb: Dict[str, Any]
           ) -> Dict[str, Any]:
    """The verdict of each part: weights, optimizer, rng, cursor (diffparts)."""
    names = sorted(set(out["objects"]) | set(out["only_in_a"]) | set(out["only_in_b"]))
    result = {}
    for part, members in (("weights", [n for n in names if n not in optimizers]),
                          ("optimizer", [n for n in names if n in optimizers])):
        differ = [n for n in members if not _object_equal(out, n)]
        verdict = parts.NONE if not members else parts.DIFFERENT if differ else parts.EQUAL
        result[part] = {"verdict": verdict, "objects": members, "different": differ}
    result["rng"] = parts.rng_part(ma["rng"], mb["rng"])
    result["cursor"] = parts.cursor_part(ma.get("cursor"), mb.get("cursor"))
    return result


def exit_code(out: Dict[str, Any], strict: bool) -> int:
    """1 when the weights or the optimizer differ; with ``strict``, on any difference."""
    if strict:
        return 0 if out["equal"] else 1
    return int(any(out["parts"][p]["verdict"] == parts.DIFFERENT
                   for p in ("weights", "optimizer")))


def _all_equal(out: Dict[str, Any]) -> bool:
    if out["only_in_a"] or out["only_in_b"] or out["rng_different"] or not out["cursor_equal"]:
        return False
    return all(not o["only_in_a"] and not o["only_in_b"] and not o["values_different"]
               and all(r["status"] == "equal" for r in o["tensors"].values())
               for o in out["objects"].values())


def _fmt(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.3g}"


def render(out: Dict[str, Any], show_equal: bool, console: Console,
           strict: bool = False) -> None:
    counts = {"equal": 0, "different": 0, "mismatch": 0}
    for name, obj in out["objects"].items():
        table = Table(title=f"object {name}", title_justify="left", box=box.SIMPLE_HEAD,
                      padding=(0, 1, 0, 0), pad_edge=False)
        for column in ("tensor", "dtype", "shape", "max abs", "max rel", "differ", "status"):
            table.add_column(column, justify="right" if column in ("max abs", "max rel",
                                                                    "differ") else "left")
        for path, r in obj["tensors"].items():
            counts[r["status"]] += 1
            if r["status"] == "equal" and not show_equal:
                continue
            shape = str(tuple(r["shape"]))
            if r["status"] == "mismatch":
                shape = f"{shape} vs {tuple(r['shape_b'])}"
            dtype = r["dtype"] if r["status"] != "mismatch" or r["dtype"] == r["dtype_b"] \
                else f"{r['dtype']} vs {r['dtype_b']}"
            status = {"equal": "[green]equal[/green]", "different": "[red]different[/red]",
                      "mismatch": "[red]MISMATCH[/red]"}[r["status"]]
            table.add_row(escape(path), dtype, shape, _fmt(r["max_abs"]), _fmt(r["max_rel"]),
                          "-" if r["elements_different"] is None else str(r["elements_different"]),
                          status)
        if table.row_count:
            console.print(table)
        for side in ("only_in_a", "only_in_b"):
            if obj[side]:
                console.print(f"  {name}: tensors only in {side[-1].upper()}: "
                              + escape(", ".join(obj[side])), highlight=False)
        for path, v in obj["values_different"].items():
            console.print(f"  {name}{escape(path)}: {escape(repr(v['a']))} -> "
                          f"{escape(repr(v['b']))}", highlight=False)
    for side in ("only_in_a", "only_in_b"):
        if out[side]:
            console.print(f"objects only in {side[-1].upper()}: {', '.join(out[side])}")
    console.print(
        f"{count(sum(counts.values()), 'tensor')} compared: {counts['equal']} equal, "
        f"{counts['different']} different, {counts['mismatch']} shape/dtype "
        f"{'mismatch' if counts['mismatch'] == 1 else 'mismatches'}", highlight=False)
    for line in part_lines(out["parts"]):
        console.print(escape(line), highlight=False)
    console.print(verdict_line(out, strict))


def part_lines(result: Dict[str, Any]) -> List[str]:
    """One line per part: its verdict, and what differs in it, by name."""
    lines = []
    for part in ("weights", "optimizer"):
        r = result[part]
        shown = r["different"] or r["objects"]
        lines.append(f"{part}: {parts.WORDING[r['verdict']]}"
                     + (f" ({', '.join(shown)})" if shown else ""))
    rng = result["rng"]
    lines.append("rng: " + _grouped({n: v for n, v in rng["streams"].items()
                                     if v != parts.EQUAL}) if rng["verdict"] != parts.EQUAL
                 else "rng: equal")
    cursor = result["cursor"]
    changed = {n: f["verdict"] for n, f in cursor["fields"].items()}
    values = {n: f"{f['a']!r} -> {f['b']!r}" for n, f in cursor["fields"].items()
              if not n.startswith(("epoch_rng.", "iter_rng."))}   # bytes: the name says it
    if cursor["verdict"] in (parts.EQUAL, parts.NONE):
        lines.append(f"cursor: {parts.WORDING[cursor['verdict']]}")
    elif cursor["verdict"] == parts.NEVER_DRAWN:
        lines.append("cursor: equal but for its RNG streams " + _grouped(changed))
    else:
        lines.append("cursor: " + _grouped(changed, values))
    return lines


def _grouped(verdicts: Dict[str, str], values: Optional[Dict[str, str]] = None) -> str:
    """``different: index (3 -> 4); seeded differently, never drawn from: python``."""
    groups: Dict[str, List[str]] = {}
    for name, verdict in verdicts.items():
        shown = f"{name} ({values[name]})" if name in (values or {}) \
            and verdict == parts.DIFFERENT else name
        groups.setdefault(verdict, []).append(shown)
    return "; ".join(f"{parts.WORDING[v]}: {', '.join(names)}"
                     for v, names in sorted(groups.items()))


def verdict_line(out: Dict[str, Any], strict: bool) -> str:
    if out["equal"]:
        return "[green]EQUAL[/green]"
    if exit_code(out, strict):
        return "[red]DIFFERENT[/red]" + (" (--strict: any difference)" if strict and
                                         not exit_code(out, False) else "")
    others = {p: out["parts"][p]["verdict"] for p in ("rng", "cursor")
              if out["parts"][p]["verdict"] not in (parts.EQUAL, parts.NONE)}
    if others and set(others.values()) == {parts.NEVER_DRAWN}:
        what = "only RNG seeds never drawn from differ"
    else:
        what = f"{' and '.join(others) or 'other state'} differ"
    return f"[green]EQUAL weights and optimizer[/green]; {what} (--strict: exit 1 on that)"


def side_labels(a: Snap, b: Snap) -> Tuple[str, str]:
    """How A and B are named: RUN/NAME, unless that names both sides though they are
    two snapshots (runs of one name under two roots); then each by its directory, the
    only name that tells them apart."""
    if a.label == b.label and a.where != b.where:
        return a.where, b.where
    return a.label, b.label


@click.command()
@click.argument("a")
@click.argument("b")
@click.option("--root", help=ROOT_HELP)
@click.option("--object", "objects", multiple=True,
              help="Compare only this object (repeatable), e.g. --object model.")
@click.option("--show-equal", is_flag=True, help="List equal tensors too.")
@click.option("--json", "as_json", is_flag=True, help="Print every comparison as JSON.")
@click.option("--strict", is_flag=True,
              help="Exit 1 on any difference (RNG, cursor, unused seeds included).")
@click.option("--outputs", is_flag=True,
              help="Compare the model's outputs on fixed inputs instead: A and B may be "
                   "snapshots or safetensors exports. Needs --model.")
@click.option("--model", "model", metavar="MODULE:FUNCTION",
              help="--outputs: a zero-argument factory returning the nn.Module "
                   "(imported from the current directory).")
@click.option("--inputs", "inputs", metavar="MODULE:FUNCTION",
              help="--outputs: returns the input tensor (or a tuple of arguments).")
@click.option("--input-shape", metavar="N,M,...",
              help="--outputs: a float32 torch.randn of this shape, fixed seed.")
@click.option("--device", default="cpu", show_default=True, help="--outputs: where to run.")
@click.option("--tolerance", type=float, default=output_check.WRONG, show_default=True,
              help="--outputs: exit 1 above this largest absolute difference.")
def diff(a: str, b: str, root: Optional[str], objects: Tuple[str, ...], show_equal: bool,
         as_json: bool, strict: bool, outputs: bool = False, model: Optional[str] = None,
         inputs: Optional[str] = None, input_shape: Optional[str] = None,
         device: str = "cpu", tolerance: float = output_check.WRONG) -> None:
    """Compare snapshots A and B tensor by tensor: max absolute and relative
    difference (float64; integers and bools exactly), shape/dtype mismatches, tensors
    on one side only, plain values; then a verdict per part: weights, optimizer, RNG
    streams (those seeded differently but never drawn from are said to be so), data
    cursor (the differing field named). Exit code 0 when weights and optimizer are
    equal, 1 when either differs; --strict: 1 on any difference.

    A and B are snapshot directories, RUN/NAME or RUN@STEP (gpt/00001200, gpt@1200),
    RUN or RUN@latest, or RUN@best, relative to --root; or URL/RUN@STEP (pulled into a
    temporary directory, every checksum checked).

    With --outputs, run the same fixed inputs through the model (--model
    module:function) built from A and from B (snapshots, or safetensors exports: one
    written by export --only-trainable is loaded with strict=False over the factory's
    model, which must hold the base) and report the largest absolute output
    difference: about 1e-4 is noise, above 1e-2 something is wrong. Exit 1 above
    --tolerance (1e-2).

    Example: snapd diff gpt/00001200 gpt-resumed/00001200 --root checkpoints

    Example: snapd diff --outputs ft@latest ft.safetensors --model train:build_model
    --input-shape 4,16 --root checkpoints
    """
    if outputs:
        code = diffoutputs.run(a, b, root, model, inputs, input_shape,
                               objects[0] if objects else None, device, tolerance, as_json)
        if code:
            raise SystemExit(code)
        return
    (root_a, snap_a), (root_b, snap_b) = resolve(a, root), resolve(b, root)
    only = list(objects) or None   # --object: only their files are needed
    with files_of(root_a, snap_a) as path_a, files_of(root_b, snap_b) as path_b:
        reader_a, reader_b = open_reader(path_a, only), open_reader(path_b, only)
        try:
            out = compare(reader_a, reader_b, list(objects) or None)
        except CorruptSnapshot as e:
            fail(f"{e}\n  hint: snapd verify {e.path or ''} names every damaged chunk", 1)
    label_a, label_b = side_labels(snap_a, snap_b)
    out.update(a=label_a, b=label_b, paths=[snap_a.where, snap_b.where], strict=strict)
    code = exit_code(out, strict)
    out["exit_code"] = code
    if as_json:
        emit_json(out)
    else:
        console = out_console()
        console.print(f"A = {escape(out['a'])} (step {out['steps'][0]})\n"
                      f"B = {escape(out['b'])} (step {out['steps'][1]})", highlight=False)
        render(out, show_equal, console, strict)
    if code:
        raise SystemExit(code)
