"""Every subcommand is registered, loads, and has --help with an example."""

import sys

import pytest
from click.testing import CliRunner

from snapd.cli import COMMANDS, main


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_each_command_has_help_with_an_example(name):
    result = CliRunner().invoke(main, [name, "--help"])
    assert result.exit_code == 0, result.output
    assert "Example" in result.output


def test_unknown_command_is_an_error():
    result = CliRunner().invoke(main, ["frobnicate"])
    assert result.exit_code == 2 and "No such command" in result.output


@pytest.mark.parametrize("argv, missing, line", [
    (["export", "gpt", "-o", "out.safetensors"], ("safetensors", "safetensors.torch"),
     "snapd export needs safetensors: pip install 'snapd[export]'"),
    (["plot", "gpt", "-o", "loss.png"], ("matplotlib", "matplotlib.pyplot"),
     "snapd plot needs matplotlib: pip install 'snapd[plot]'"),
])
def test_a_command_whose_extra_is_missing_says_what_to_install(monkeypatch, tmp_path, argv,
                                                               missing, line):
    for module in missing:   # None in sys.modules: the import fails as if not installed
        monkeypatch.setitem(sys.modules, module, None)
    result = CliRunner().invoke(main, [*argv, "--root", str(tmp_path)])
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [f"snapd: error: {line}"]
