"""``snapd batch RUN STEP [--rank R]``: which data a step consumed, from the state log
alone. Each rank of a multi-rank job logs its own batches (<run>/log/rank-NNNNN/)."""

from __future__ import annotations

import click

from snapd import statelog
from snapd.commands.common import ROOT_HELP, emit_json, fail, resolve_root, run_dir
from snapd.humanize import count


def consumed(path: str, rank: int, step: int) -> dict:
    """Epoch and batch positions (and sample indices when logged) of one step."""
    ranks = statelog.list_ranks(path)
    if rank not in ranks:
        fail(f"{statelog.rank_dir(path, rank)}: no log of rank {rank}; ranks logged: "
             f"{', '.join(map(str, ranks)) or 'none'} (choose one with --rank)", 1)
    record = statelog.find_step(path, rank, step)
    if record is None:
        fail(f"{path}: the log of rank {rank} has no record of step {step}", 1)
    before = statelog.find_step(path, rank, step - 1) if step > 1 else None
    after = record.get("cursor")
    start = (before or {}).get("cursor") or ([after[0], 0] if after else None)
    out = {"step": step, "rank": rank, "counted_from": 0,
           "cursor_before": start, "cursor_after": after,
           "samples": record.get("samples"), "scalars": record.get("scalars")}
    if after and start:
        if start[0] == after[0]:
            out["batches"] = [[after[0], i] for i in range(start[1], after[1])]
        else:  # the step crossed an epoch boundary: epoch start[0] ran out first
            out["batches"] = [[after[0], i] for i in range(after[1])]
            out["previous_epoch_from"] = [start[0], start[1]]
    return out


@click.command()
@click.argument("run")
@click.argument("step", type=int)
@click.option("--root", help=ROOT_HELP)
@click.option("--rank", type=int, default=0, show_default=True,
              help="Whose log: each rank of a multi-rank job consumes its own batches.")
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
def batch(run: str, step: int, root: str | None, rank: int, as_json: bool) -> None:
    """Which batches (epoch, index) and samples STEP of RUN consumed, from the log.
    Epochs and batches count from 0, as Client.batches() does: a script that prints
    epoch + 1 calls epoch 0 its epoch 1.

    Example: snapd batch gpt-small 1357 --root checkpoints
    """
    info = consumed(run_dir(resolve_root(root), run), rank, step)
    if as_json:
        emit_json(info)
        return
    click.echo(f"step {step} (rank {rank}) consumed (epochs and batches count from 0):")
    if "previous_epoch_from" in info:
        epoch, index = info["previous_epoch_from"]
        click.echo(f"  epoch {epoch} from batch {index} to its end (none if it had "
                   f"{count(index, 'batch', 'batches')})")
    for epoch, index in info.get("batches", []):
        click.echo(f"  epoch {epoch} batch {index}")
    if info["samples"] is not None:
        click.echo(f"  sample indices: {info['samples']}")
    else:
        click.echo("  sample indices: not logged (pass samples= to Client.log to record them)")
    if info["scalars"]:
        click.echo("  logged: " + ", ".join(f"{k}={v!r}" for k, v in info["scalars"].items()))
