"""``snapd pull URL RUN@STEP --root DIR``: one remotely committed snapshot onto a disk.

The snapshot is verified whole (every size and checksum) in a tmp dir of the local
run and committed there by the same rename as a local commit; LATEST moves to it when
it is the run's newest (snapd/remote/pull.py). A restore or ``snapd`` command then
reads it like any local snapshot. ``RUN`` alone (or ``RUN@latest``) is the run's
newest remote commit.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

import click
from rich.console import Console
from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn,
                           TimeRemainingColumn, TransferSpeedColumn)

from snapd.commands.common import ROOT_HELP, fail, given_root
from snapd.commands.locate import resolve
from snapd.errors import CorruptSnapshot, InvalidOption
from snapd.options import Options
from snapd.store import RunStore
from snapd.humanize import human_bytes


@click.command()
@click.argument("url")
@click.argument("target")
@click.option("--root", help=ROOT_HELP)
@click.option("--threads", default=4, show_default=True,
              help="Files downloaded at once.")
@click.option("--progress/--no-progress", default=None,
              help="Progress bar on stderr (default: when stderr is a terminal).")
def pull(url: str, target: str, root: Optional[str], threads: int,
         progress: Optional[bool]) -> None:
    """Bring remote snapshot TARGET (RUN@STEP, RUN/NAME, or RUN for the newest) of the
    remote root URL down into --root, verified and committed as a local snapshot.
    Exit code 1 if the remote snapshot is damaged (nothing is left behind), 2 if
    there is no such remote commit.

    Example: snapd pull s3://bucket/snapd gpt-small@1200 --root checkpoints
    """
    found, snap = resolve(target, url)
    store = RunStore(os.path.abspath(given_root(root)), snap.run)
    show = sys.stderr.isatty() if progress is None else progress
    bar = Progress(TextColumn(f"pull {snap.label}"), BarColumn(),
                   DownloadColumn(binary_units=True), TransferSpeedColumn(),
                   TimeRemainingColumn(), console=Console(stderr=True), transient=True,
                   disable=not show)
    try:
        total = found.stored_bytes(snap)
        with bar:
            task = bar.add_task("", total=total)
            path = found.pull(snap, store, threads=threads,
                              progress=lambda n: bar.advance(task, n),
                              min_free_bytes=Options.resolve().min_free_bytes)
    except CorruptSnapshot as e:
        fail(f"{e}\n  hint: nothing was committed locally; snapd ls {found.where} "
             f"{snap.run} lists the older remote commits", 1)
    except InvalidOption as e:
        fail(str(e), 2)
    click.echo(f"pulled {snap.label} to {path} ({human_bytes(found.stored_bytes(snap))}, "
               "verified)")
