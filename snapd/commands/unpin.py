"""``snapd unpin ROOT RUN@STEP``: let retention delete a pinned snapshot again."""

from __future__ import annotations

import click

from snapd import pins
from snapd.commands.common import fail, resolve_root
from snapd.commands.target import parse_step, split_target


@click.command()
@click.argument("root")
@click.argument("target")
def unpin(root: str, target: str) -> None:
    """Remove the pin of the snapshot of RUN at STEP (TARGET is RUN@STEP). A pinned
    snapshot (the newest before an anomaly in the logged loss) is kept by retention,
    local and remote, whatever keep_last says; once unpinned, the next retention (the
    next commit, or snapd gc) may delete it.

    Example: snapd unpin checkpoints gpt-small@48200
    """
    base = resolve_root(root)
    run, what = split_target(target)
    step = parse_step(target, what)
    path = f"{base}/{run}"
    held = [sid for sid in pins.pinned(path) if sid.step == step]
    if not held:
        listed = ", ".join(f"{run}@{sid.step}" for sid in pins.pinned(path)) or "none"
        fail(f"{pins.pins_path(path)}: no pinned snapshot of run {run!r} at step {step}; "
             f"pinned there: {listed}", 1)
    for sid in held:
        pins.unpin(path, sid)
        click.echo(f"{run}: unpinned {sid.name}; retention may delete it from the next "
                   "commit or snapd gc on")
