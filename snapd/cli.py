"""``snapd``: the command line. A registry only; each subcommand is its own module
under snapd/commands/, imported when it runs, so that ``snapd status`` or
``snapd watch`` does not pay for importing torch."""

from __future__ import annotations

import importlib
from typing import Dict, List, Optional, Tuple

import click

from snapd import __version__
from snapd.errors import SnapdError

# name: (module under snapd.commands, one-line summary for `snapd --help`)
COMMANDS: Dict[str, Tuple[str, str]] = {
    "serve": ("serve", "Run the daemon for a root (clients start one themselves)."),
    "stop": ("stop", "Stop a root's daemon (or --all of yours) once its snapshots are written."),
    "status": ("status", "Runs, progress, last snapshot, updates at risk; --daemons: live daemons."),
    "watch": ("watch", "Live view of a root: steps, snapshots in flight, stalls, disk."),
    "batch": ("batch", "Which batches and samples a step consumed, from the log."),
    "ls": ("ls", "List snapshots with step, size, metric and LATEST/BEST marks."),
    "inspect": ("inspect", "Objects, tensors, RNG streams, cursor and lineage of one."),
    "verify": ("verify", "Read every file and check every checksum (exit 1 on damage)."),
    "diff": ("diff", "Compare two snapshots by part (exit 1 if weights or optimizer differ)."),
    "gc": ("gc", "Apply retention; never deletes the last verified snapshot."),
    "unpin": ("unpin", "Let retention delete a snapshot pinned before an anomaly."),
    "repro": ("repro", "Recompute a logged step from the snapshot before it, checked, read-only."),
    "export": ("export", "Model weights only, as safetensors, with lineage metadata."),
    "plot": ("plot", "Loss over steps from the log, snapshots and resumes marked."),
    "pull": ("pull", "Bring one remotely committed snapshot down into a root, verified."),
}


class LazyGroup(click.Group):
    """Imports a subcommand's module only when that subcommand is asked for."""

    def list_commands(self, ctx: click.Context) -> List[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> Optional[click.Command]:
        if name not in COMMANDS:
            return None
        module = importlib.import_module(f"snapd.commands.{COMMANDS[name][0]}")
        return getattr(module, name)

    def invoke(self, ctx: click.Context):
        """A last net under every command: an error snapd raises on purpose, or one
        from the filesystem, is one line and exit 1, never a traceback. Commands
        still catch what they can explain better themselves."""
        try:
            return super().invoke(ctx)
        except (SnapdError, OSError) as e:
            click.echo(f"snapd: error: {e}", err=True)
            ctx.exit(1)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Commands"):
            formatter.write_dl([(name, summary) for name, (_, summary) in COMMANDS.items()])


@click.group(cls=LazyGroup)
@click.version_option(__version__, prog_name="snapd")
def main() -> None:
    """snapd: asynchronous snapshots of PyTorch training, and exact resume.

    Example: snapd status checkpoints
    """
