"""The layers docs/architecture.md draws, checked on the source.

``snapd`` (format, daemon, operator commands) never imports ``snapd_client`` (the
training side), and the library modules of ``snapd`` never import the commands:
the commands sit on top. Imports inside functions count too (ast sees them all).
In tests/, no module imports a test module: shared helpers have their own modules.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path
from typing import Iterator, List, Tuple

import pytest

import snapd

PACKAGE = Path(snapd.__file__).parent
CLIENT = PACKAGE.parent / "snapd_client"


def import_nodes(path: Path) -> Tuple[ast.AST, ...]:
    """Every import statement of ``path``, at any depth."""
    return _imports(str(path), path.read_text())[0]


def top_level_import_nodes(path: Path) -> Tuple[ast.AST, ...]:
    """The import statements of ``path``'s module body (the import graph's edges)."""
    return _imports(str(path), path.read_text())[1]


@functools.lru_cache(maxsize=None)
def _imports(name: str, source: str) -> Tuple[Tuple[ast.AST, ...], Tuple[ast.AST, ...]]:
    """(every import, the module body's imports) of ``source``: parsed once per content
    (four checks read every module of snapd, parsing is their cost), the rest of the
    tree not kept."""
    tree = ast.parse(source, name)
    return (tuple(node for node in statements(tree.body)
                  if isinstance(node, (ast.Import, ast.ImportFrom))),
            tuple(node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))))


STATEMENT_LISTS = (ast.stmt, ast.excepthandler, ast.match_case)


def statements(body: List[ast.AST]) -> Iterator[ast.AST]:
    """Every statement of ``body``, at any depth. An import is a statement, and a
    statement sits only in a statement list (a body, an ``else``, a handler's or a
    case's body), never inside an expression: walking those lists finds every import
    that ast.walk would, without visiting the expressions, most of a tree's nodes."""
    for node in body:
        yield node
        for field in node._fields:
            value = getattr(node, field)
            if isinstance(value, list) and value and isinstance(value[0], STATEMENT_LISTS):
                yield from statements(value)


def imported_modules(path: Path, top: Path = PACKAGE.parent) -> Iterator[Tuple[int, str]]:
    """(line, module) for every import in the file, relative ones resolved."""
    package = ".".join(path.relative_to(top).with_suffix("").parts[:-1])
    for node in import_nodes(path):
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
    # each kind of statement list an import can sit in, nested
    ("try:\n    pass\nexcept ImportError:\n    import snapd_client\n", "snapd_client"),
    ("try:\n    pass\nfinally:\n    import snapd_client\n", "snapd_client"),
    ("for x in y:\n    pass\nelse:\n    import snapd_client\n", "snapd_client"),
    ("match x:\n    case 1:\n        import snapd_client\n", "snapd_client"),
    ("class C:\n    def f(self):\n        with a:\n            if b:\n                pass\n"
     "            else:\n                from snapd_client import x\n", "snapd_client"),
    ("async def f():\n    async with a:\n        while b:\n            import snapd_client\n",
     "snapd_client"),
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
        for node in import_nodes(path):
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


def import_graph(files: List[Path], top: Path = PACKAGE.parent) -> dict:
    """module -> the modules of ``files`` it imports at module level (an import inside
    a function runs when called, after every module is loaded: not an edge; nor is a
    package the module is inside, which Python loads before the module anyway)."""
    names = {".".join(p.relative_to(top).with_suffix("").parts).removesuffix(".__init__"): p
             for p in files}
    graph = {}
    for name, path in names.items():
        found = set()
        package = ".".join(path.relative_to(top).with_suffix("").parts[:-1])
        for node in top_level_import_nodes(path):
            for target in _targets(node, package):
                if target in names and not (name + ".").startswith(target + "."):
                    found.add(target)
        graph[name] = found
    return graph


def _targets(node: ast.AST, package: str) -> List[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        parts = package.split(".")
        base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
    return [base] + [f"{base}.{alias.name}" for alias in node.names]


def circles(graph: dict) -> List[List[str]]:
    """Every strongly connected set of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_in_snapd_or_snapd_client():
    files = sorted(PACKAGE.rglob("*.py")) + sorted(CLIENT.rglob("*.py"))
    assert circles(import_graph(files)) == []


def test_the_circle_check_finds_a_circle(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("from pkg import b\n")
    (tmp_path / "pkg" / "b.py").write_text("import pkg.c\n")
    (tmp_path / "pkg" / "c.py").write_text("from pkg.a import x\n")
    (tmp_path / "pkg" / "d.py").write_text("def f():\n    from pkg import a\n")
    graph = import_graph(sorted((tmp_path / "pkg").glob("*.py")), tmp_path)
    assert circles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]
