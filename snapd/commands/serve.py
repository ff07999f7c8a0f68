"""``snapd serve --root DIR``: run the daemon for one root in this process."""

from __future__ import annotations

import sys
from typing import Optional

import click


@click.command()
@click.option("--root", required=True, type=click.Path(file_okay=False),
              help="The checkpoint root to serve (created if missing).")
@click.option("--detach", is_flag=True,
              help="Fork the daemon and exit once it serves: 0 when it does, 2 when "
                   "another daemon already serves the root, else its failure code "
                   "(its stderr says why). Clients start the daemon this way.")
@click.option("--idle-exit", "idle_exit", type=click.FloatRange(min=0), default=None,
              metavar="SECONDS",
              help="Exit once no trainer has been connected and nothing has been in "
                   "flight for SECONDS; 0: never. Default: never in the foreground; "
                   "with --detach, idle_exit_seconds ($SNAPD_IDLE_EXIT_SECONDS, 600). "
                   "Sooner, after idle_bare_exit_seconds "
                   "($SNAPD_IDLE_BARE_EXIT_SECONDS, 60), while the daemon keeps "
                   "nothing: no hot copy held, no upload pending.")
@click.option("--remote", default=None, metavar="URL",
              help="Replicate every committed snapshot to this fsspec URL in the "
                   "background (s3://bucket/prefix, file:///shared/path; docs/remote.md). "
                   "Default: $SNAPD_REMOTE, else none. Credentials come from the "
                   "environment, never the URL.")
def serve(root: str, detach: bool, idle_exit: Optional[float], remote: Optional[str]) -> None:
    """Serve ROOT: write the snapshots clients hand over, apply retention. Runs in
    this process, logging to stderr, unless --detach.

    A daemon a client started (--detach) exits by itself when idle (--idle-exit); one
    started by hand in the foreground serves until it is stopped, unless asked.

    Exit code 0 after a clean stop (SIGTERM/SIGINT, `snapd stop`, or idle: accepted
    snapshots are finished first), 2 when another daemon already serves the root.

    Example: snapd serve --root checkpoints --remote s3://bucket/snapd
    """
    # Here, so that `snapd --help` stays fast.
    from snapd.daemon import detached, main
    from snapd.errors import SnapdError
    from snapd.options import Options

    if idle_exit is None and not detach:
        idle_exit = 0.0   # an operator's daemon: never exits unasked
    try:
        options = Options.resolve({"idle_exit_seconds": idle_exit, "remote": remote})
    except SnapdError as e:
        raise click.UsageError(str(e)) from e
    sys.exit(detached(root, options) if detach else main(root, options))
