"""``snapd serve --root DIR``: run the daemon for one root in this process."""

from __future__ import annotations

import sys

import click


@click.command()
@click.option("--root", required=True, type=click.Path(file_okay=False),
              help="The checkpoint root to serve (created if missing).")
@click.option("--foreground", is_flag=True,
              help="Run in this process, logging to stderr. This is what serve always "
                   "does (it never forks); clients detach it themselves.")
def serve(root: str, foreground: bool) -> None:
    """Serve ROOT: write the snapshots clients hand over, apply retention.

    Exit code 0 after a clean stop (SIGTERM/SIGINT drain accepted snapshots first),
    2 when another daemon already serves the root.

    Example: snapd serve --root checkpoints
    """
    from snapd.daemon import main  # imported here so that `snapd --help` stays fast
    sys.exit(main(root))
