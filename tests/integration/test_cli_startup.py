"""The command line as a new process sees it: ``snapd --help`` lists every command
without importing torch (tests/test_cli.py runs the commands in-process)."""

import subprocess
import sys

from snapd.cli import COMMANDS


def test_top_level_help_lists_every_command_without_importing_torch():
    code = ("import sys; from click.testing import CliRunner; from snapd.cli import main; "
            "r = CliRunner().invoke(main, ['--help']); print(r.output); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert all(name in out for name in COMMANDS)
    assert out.strip().endswith("False")
