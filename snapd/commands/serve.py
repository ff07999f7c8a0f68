"""``snapd serve --root DIR``: run the daemon for one root in this process."""

from __future__ import annotations

import sys

import click


@click.command()
@click.option("--root", required=True, type=click.Path(file_okay=False),
              help="The checkpoint root to serve (created if missing).")
@click.option("--detach", is_flag=True,
              help="Fork the daemon and exit once it serves: 0 when it does, 2 when "
                   "another daemon already serves the root, else its failure code "
                   "(its stderr says why). Clients start the daemon this way.")
def serve(root: str, detach: bool) -> None:
    """Serve ROOT: write the snapshots clients hand over, apply retention. Runs in
    this process, logging to stderr, unless --detach.

    Exit code 0 after a clean stop (SIGTERM/SIGINT drain accepted snapshots first),
    2 when another daemon already serves the root.

    Example: snapd serve --root checkpoints
    """
    from snapd.daemon import detached, main  # here, so that `snapd --help` stays fast
    sys.exit(detached(root) if detach else main(root))
