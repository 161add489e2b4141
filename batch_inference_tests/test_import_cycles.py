"""No import cycle between the product's modules, lazy and ``TYPE_CHECKING`` imports included.

A cycle that Python tolerates (one side imports inside a function, or only for type
checkers) still ties two modules together: neither can be understood, tested or moved
without the other. So every ``import`` / ``from ... import`` anywhere in a module counts.

How an import becomes an edge of the module graph:

- ``import a.b.c`` -> ``a.b.c``; ``from a.b import c`` -> ``a.b.c`` when ``c`` is a submodule,
  else -> ``a.b`` (the name comes from the package's namespace). Relative imports are resolved.
  ``importlib.import_module("<literal>")`` counts like ``import <literal>``.
- Importing ``a.b.c`` also runs the ``__init__`` of ``a`` and ``a.b``: an edge to each of those
  packages, except the importer's own enclosing packages (Python is already running those,
  and counting them would make every package that imports a submodule a cycle). An explicit
  ``from <own package> import name`` of a name that is no submodule still counts.
- Lazy export tables (``_lazy.lazy_exports``, PEP 562): ``from pkg import Name`` with ``Name`` in
  ``pkg``'s ``_EXPORTS`` goes to the module the table names (what runs on first access), and
  to ``pkg`` itself. The package's own ``if TYPE_CHECKING:`` imports that mirror its table
  (same name, same module) declare the table to type checkers and are no edges of the
  package: counting them would make ``import batch_inference`` depend on every layer. Any
  other import in a package ``__init__`` counts.
- A module importing itself is no cycle.

Every cycle is reported with its path and the line of each import on it.
"""

from __future__ import annotations

import ast
import textwrap
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import batch_inference

PRODUCT_ROOT = Path(batch_inference.__file__).parent


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    where: str  # "file:line (kind)" of the import that makes it


def discover(root: Path) -> dict[str, Path]:
    """Every module of the package at ``root``: dotted name -> file."""
    modules: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if any(not (root.joinpath(*parts[:i]) / "__init__.py").exists() for i in range(1, len(parts))):
            continue  # a script in a folder that is no package
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join([root.name, *parts])] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _is_import_module(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call) or not node.args:
        return False
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    arg = node.args[0]
    return name == "import_module" and isinstance(arg, ast.Constant) and isinstance(arg.value, str)


def imports_of(tree: ast.Module) -> list[tuple[ast.AST, str]]:
    """Every import in a module with its kind: "module", "lazy" (in a function) or "TYPE_CHECKING"."""
    found: list[tuple[ast.AST, str]] = []

    def visit(node: ast.AST, kind: str) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)) or _is_import_module(node):
            found.append((node, kind))
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, "TYPE_CHECKING")
            for child in node.orelse:
                visit(child, kind)
            return
        inner = "lazy" if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and kind == "module" else kind
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(tree, "module")
    return found


def lazy_table(tree: ast.Module, path: Path) -> dict[str, str] | None:
    """A package's ``_EXPORTS`` (name -> module) when it calls ``lazy_exports``, else None."""
    if not any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "lazy_exports" for n in ast.walk(tree)):
        return None
    for node in tree.body:
        if isinstance(node, ast.AnnAssign):
            target, value = node.target, node.value
        elif isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        else:
            continue
        if isinstance(target, ast.Name) and target.id == "_EXPORTS" and value is not None:
            table = ast.literal_eval(value)
            assert isinstance(table, dict), f"{path}: _EXPORTS is not a dict"
            return table
    raise AssertionError(f"{path} calls lazy_exports without a literal module-level _EXPORTS this test can read")


def _source(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` reads from."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def build_graph(root: Path, modules: dict[str, Path]) -> dict[str, list[Edge]]:
    """importer -> its edges, by the rules in this module's docstring."""
    trees = {name: ast.parse(path.read_text(), str(path)) for name, path in modules.items()}
    tables = {name: t for name, tree in trees.items() if (t := lazy_table(tree, modules[name])) is not None}
    graph: dict[str, list[Edge]] = {}
    for name, tree in trees.items():
        path = modules[name]
        is_package = path.name == "__init__.py"
        depth = name.count(".") + (1 if is_package else 0)
        own_packages = {".".join(name.split(".")[:i]) for i in range(1, depth + 1)}
        edges: list[Edge] = []
        graph[name] = edges

        def add(dst: str, where: str) -> None:
            if dst not in modules:
                return  # not the product's (stdlib, third party)
            parts = dst.split(".")
            implicit = [".".join(parts[:i]) for i in range(1, len(parts))]
            for target in [dst] + [p for p in implicit if p not in own_packages]:
                if target != name:
                    edges.append(Edge(name, target, where))

        for node, kind in imports_of(tree):
            where = f"{path.relative_to(root.parent)}:{node.lineno} ({kind})"
            if isinstance(node, ast.Call):
                add(node.args[0].value, where)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    add(alias.name, where)
            else:
                source = _source(name, is_package, node)
                own_table = tables.get(name, {})
                if kind == "TYPE_CHECKING" and all(own_table.get(a.name) == source for a in node.names):
                    continue  # this package's own lazy table, declared for type checkers
                table = tables.get(source, {})
                for alias in node.names:
                    if f"{source}.{alias.name}" in modules:
                        add(f"{source}.{alias.name}", where)
                    elif alias.name in table:
                        add(table[alias.name], where)
                        add(source, where)
                    else:
                        add(source, where)
    return graph


def strongly_connected(graph: dict[str, list[Edge]]) -> list[list[str]]:
    """Tarjan's SCCs of more than one module (a module importing itself has no edge here)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    sccs: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for e in graph[v]:
            if e.dst not in index:
                connect(e.dst)
                low[v] = min(low[v], low[e.dst])
            elif e.dst in on_stack:
                low[v] = min(low[v], index[e.dst])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                sccs.append(sorted(scc))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return sccs


def find_cycles(graph: dict[str, list[Edge]]) -> list[list[Edge]]:
    """One shortest cycle through every import edge inside a strongly connected set, deduplicated:
    every edge that takes part in a cycle shows up in at least one reported path."""
    cycles: dict[tuple[str, ...], list[Edge]] = {}
    for scc in strongly_connected(graph):
        members = set(scc)
        for u in scc:
            for first in graph[u]:
                if first.dst not in members:
                    continue
                # BFS back from first.dst to u inside the SCC
                prev: dict[str, Edge | None] = {first.dst: None}
                queue = deque([first.dst])
                while queue and u not in prev:
                    v = queue.popleft()
                    for e in graph[v]:
                        if e.dst in members and e.dst not in prev:
                            prev[e.dst] = e
                            queue.append(e.dst)
                path = [first]
                back: list[Edge] = []
                node = u
                while (e := prev[node]) is not None:
                    back.append(e)
                    node = e.src
                path += reversed(back)
                nodes = [e.src for e in path]
                start = nodes.index(min(nodes))
                key = tuple(nodes[start:] + nodes[:start])
                cycles.setdefault(key, path[start:] + path[:start])
    return [cycles[k] for k in sorted(cycles)]


def describe(cycle: list[Edge]) -> str:
    names = " -> ".join([e.src for e in cycle] + [cycle[0].src])
    return names + "".join(f"\n    {e.src} -> {e.dst}: {e.where}" for e in cycle)


def cycles_in(root: Path) -> list[list[Edge]]:
    return find_cycles(build_graph(root, discover(root)))


def test_the_product_has_no_import_cycle() -> None:
    cycles = cycles_in(PRODUCT_ROOT)
    assert not cycles, f"{len(cycles)} import cycle(s) between batch_inference modules:\n" + "\n".join(
        describe(c) for c in cycles
    )


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_the_scan_sees_lazy_type_checking_relative_and_lazy_table_cycles_and_no_benign_ones(tmp_path: Path) -> None:
    """The rules above on a package made for them: each kind of cycle is found, and the
    package patterns the product relies on (an eager ``__init__`` importing its submodules,
    a lazy table with its TYPE_CHECKING mirror) are not taken for cycles."""
    _write(
        tmp_path,
        {
            "pkg/__init__.py": """
                from typing import TYPE_CHECKING
                from pkg._lazy import lazy_exports
                VERSION = "1"
                _EXPORTS = {"C": "pkg.sub.c"}
                __getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
                if TYPE_CHECKING:
                    from pkg.sub.c import C
            """,
            "pkg/_lazy.py": "def lazy_exports(*a): ...\n",
            # a function-level import one way, a TYPE_CHECKING one the other
            "pkg/a.py": "def f():\n    from pkg import b\n",
            "pkg/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import f\n",
            # relative imports
            "pkg/r1.py": "from . import r2\n",
            "pkg/r2.py": "from .r1 import x\n",
            # a name from a lazy table resolves to the module the table names
            "pkg/x.py": "from pkg import C\n",
            "pkg/sub/__init__.py": "",
            "pkg/sub/c.py": "from pkg import VERSION\nfrom pkg.sub import e\n\ndef g():\n    import pkg.x\n",
            "pkg/sub/e.py": "E = 1\n",
            # benign: importing a submodule of the own package, an eager package __init__
            "pkg/store/__init__.py": "from pkg.store.f import F\nfrom pkg.store.d import D\n",
            "pkg/store/f.py": "from pkg.store import u\nF = 1\n",
            "pkg/store/d.py": "from pkg.store.f import F\nfrom pkg.store import u\nD = 1\n",
            "pkg/store/u.py": "U = 1\n",
            "pkg/uses_store.py": "from pkg.store import D\nimport pkg.store.u\n",
        },
    )
    found = {tuple(e.src for e in c) for c in cycles_in(tmp_path / "pkg")}
    assert found == {
        ("pkg.a", "pkg.b"),
        ("pkg.r1", "pkg.r2"),
        ("pkg.sub.c", "pkg.x"),
    }
    by_src = {c[0].src: describe(c) for c in cycles_in(tmp_path / "pkg")}
    assert "pkg/a.py:2 (lazy)" in by_src["pkg.a"] and "pkg/b.py:3 (TYPE_CHECKING)" in by_src["pkg.a"]


def test_an_eager_package_init_that_imports_back_is_a_cycle(tmp_path: Path) -> None:
    """``from <own package> import name`` in a submodule the package imports eagerly: the
    name is not bound yet when the submodule runs; the exclusion of own packages does not hide it."""
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/s/__init__.py": "from pkg.s.m import M\nHELPER = 1\n",
            "pkg/s/m.py": "from pkg.s import HELPER\nM = HELPER\n",
        },
    )
    assert [[e.src for e in c] for c in cycles_in(tmp_path / "pkg")] == [["pkg.s", "pkg.s.m"]]
