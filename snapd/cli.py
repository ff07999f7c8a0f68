"""``snapd``: the command line. A registry only; each subcommand is its own module
under snapd/commands/."""

from __future__ import annotations

import click

from snapd import __version__
from snapd.commands import batch, serve, status
from snapd.commands import watch
from snapd.commands import diff, export, gc, inspect, ls, plot, verify


@click.group()
@click.version_option(__version__, prog_name="snapd")
def main() -> None:
    """snapd: asynchronous snapshots of PyTorch training, and exact resume."""


main.add_command(serve.serve)
main.add_command(status.status)
main.add_command(batch.batch)
main.add_command(watch.watch)
main.add_command(ls.ls)
main.add_command(inspect.inspect)
main.add_command(verify.verify)
main.add_command(diff.diff)
main.add_command(gc.gc)
main.add_command(export.export)
main.add_command(plot.plot)
