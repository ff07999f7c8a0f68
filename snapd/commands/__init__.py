"""One module per ``snapd`` subcommand; snapd/cli.py registers each."""
