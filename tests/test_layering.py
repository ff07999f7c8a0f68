"""The layers docs/architecture.md draws, checked on the source.

``snapd`` (format, daemon, operator commands) never imports ``snapd_client`` (the
training side), and the library modules of ``snapd`` never import the commands:
the commands sit on top. Imports inside functions count too (ast sees them all).
In tests/, no module imports a test module: shared helpers have their own modules.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator, List, Tuple

import pytest

import snapd

PACKAGE = Path(snapd.__file__).parent
CLIENT = PACKAGE.parent / "snapd_client"


def imported_modules(path: Path, top: Path = PACKAGE.parent) -> Iterator[Tuple[int, str]]:
    """(line, module) for every import in the file, relative ones resolved."""
    package = ".".join(path.relative_to(top).with_suffix("").parts[:-1])
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            yield node.lineno, base
            # ``from snapd import commands`` imports a module through its package
            yield from ((node.lineno, f"{base}.{alias.name}") for alias in node.names)


def offenders(files: List[Path], forbidden: str, top: Path = PACKAGE.parent) -> List[str]:
    return [f"{path.relative_to(top)}:{line} imports {name}"
            for path in files for line, name in imported_modules(path, top)
            if name == forbidden or name.startswith(forbidden + ".")]


def library_modules() -> List[Path]:
    """snapd's modules below the command line: all but snapd/commands/ and cli.py."""
    return [p for p in sorted(PACKAGE.rglob("*.py"))
            if "commands" not in p.relative_to(PACKAGE).parts and p.name != "cli.py"]


def test_snapd_never_imports_snapd_client():
    assert offenders(sorted(PACKAGE.rglob("*.py")), "snapd_client") == []


def test_snapd_library_modules_never_import_the_commands():
    assert offenders(library_modules(), "snapd.commands") == []


@pytest.mark.parametrize("source, forbidden", [
    ("from snapd_client.state import flatten\n", "snapd_client"),
    ("def f():\n    import snapd_client.connection\n", "snapd_client"),
    ("from snapd.commands.common import age\n", "snapd.commands"),
    ("from snapd import commands\n", "snapd.commands"),
    ("from .commands import common\n", "snapd.commands"),
])
def test_the_check_sees_each_form_of_import(tmp_path, source, forbidden):
    module = tmp_path / "snapd" / "probe.py"   # parsed, never imported
    module.parent.mkdir()
    module.write_text(source)
    assert offenders([module], forbidden, top=tmp_path) != []


def test_no_module_imports_a_private_name_of_another():
    """A name with a leading underscore is its module's own: other modules use the
    public API (statelog's readers for the log writer, for one)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")) + sorted(CLIENT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("snapd"):
                found += [f"{path.name}:{node.lineno} {node.module}.{a.name}"
                          for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
    assert found == []



TESTS = Path(__file__).parent


def imported_test_modules(path: Path, top: Path = TESTS) -> List[str]:
    """The test modules (and conftests) a file under tests/ imports. pytest puts each
    test folder on sys.path, so ``from test_format import plan_for`` works, and ties
    one module's collection, fixtures and edits to another's."""
    found = {(line, name.split(".")[0]) for line, name in imported_modules(path, top)}
    return [f"{path.relative_to(top)}:{line} imports {module}" for line, module in sorted(found)
            if module.startswith("test_") or module == "conftest"]


def test_no_test_module_imports_another():
    """What test modules share lives in tests/helpers.py, the daemon harness in
    tests/integration/harness.py, fixtures in a conftest.py."""
    found = [hit for path in sorted(TESTS.rglob("*.py")) for hit in imported_test_modules(path)]
    assert found == []


@pytest.mark.parametrize("source", [
    "from test_format import plan_for\n",
    "import test_client_daemon\n",
    "def f():\n    from test_daemon_protocol import Peer\n",
    "from conftest import root\n",
])
def test_the_test_module_check_sees_each_form_of_import(tmp_path, source):
    module = tmp_path / "integration" / "test_probe.py"   # parsed, never imported
    module.parent.mkdir()
    module.write_text(source)
    assert imported_test_modules(module, top=tmp_path) != []


def test_the_test_module_check_lets_helpers_through(tmp_path):
    module = tmp_path / "test_probe.py"
    module.write_text("from helpers import plan_for\nfrom harness import Peer\n"
                      "from hostile_worker import RUN\n")
    assert imported_test_modules(module, top=tmp_path) == []
