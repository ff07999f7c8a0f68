"""``python -m snapd ...`` is the ``snapd`` command (how clients start the daemon)."""

from snapd.cli import main

if __name__ == "__main__":
    main(prog_name="snapd")
