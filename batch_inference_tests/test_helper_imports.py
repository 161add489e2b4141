"""Tests import helpers from helper modules: never from a conftest.py (fixtures and hooks only)
nor from another test module (importing one collects its tests twice and ties two files)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def imported_modules(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            found += [(node.lineno, base)] + [(node.lineno, f"{base}.{a.name}") for a in node.names if not node.module]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
    return found


def test_no_module_imports_a_conftest_or_a_test_module() -> None:
    offenders = [f"{path.relative_to(TESTS.parent)}:{line} imports {module}"
                 for path in sorted(TESTS.rglob("*.py"))
                 for line, module in imported_modules(path)
                 if (module.startswith(".") or module.startswith("batch_inference_tests."))
                 and any(part == "conftest" or part.startswith("test_") for part in module.lstrip(".").split("."))]
    assert offenders == [], "move what they import into a helper module:\n" + "\n".join(offenders)
