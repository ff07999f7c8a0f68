"""What the operator commands share: root resolution, JSON output, error exits."""

from __future__ import annotations

import json
import os
import sys
from typing import Any, NoReturn

import click

ROOT_HELP = "The checkpoint root (default: $SNAPD_ROOT, else the current directory)."


def resolve_root(root: str | None) -> str:
    root = root or os.environ.get("SNAPD_ROOT") or "."
    if not os.path.isdir(root):
        fail(f"{root}: no such directory; pass the checkpoint root as ROOT or --root", 2)
    return os.path.abspath(root)


def run_dir(root: str, run: str) -> str:
    path = os.path.join(root, run)
    if not os.path.isdir(path):
        runs = sorted(n for n in os.listdir(root) if os.path.isdir(os.path.join(root, n))
                      and not n.startswith("."))
        fail(f"{path}: no run {run!r} under {root}; runs there: {', '.join(runs) or 'none'}",
             2)
    return path


def emit_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2, sort_keys=True, default=str)
    sys.stdout.write("\n")


def fail(message: str, code: int = 1) -> NoReturn:
    click.echo(f"snapd: error: {message}", err=True)
    sys.exit(code)


def age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"
