"""The optional extras stay optional in the suite: a test module, or a helper module one
imports, that imports an extra's package at its top (torch, the frameworks, psycopg) skips
first where the package is missing (``pytest.importorskip`` above the import), so a
``pip install '.[test]'`` collects the suite without an error. Read from the sources, so it
holds here too, where every extra is installed; .ci/without-extras collects the suite
without them."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).parent
#: The packages of the optional extras (pyproject.toml): torch; frameworks; postgres.
EXTRAS = ("torch", "diffusers", "yunchang", "psycopg")


def top_imports(tree: ast.Module) -> list[tuple[str, int]]:
    """(top-level package, line) of each import among a module's own statements."""
    found = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            found += [(alias.name.split(".")[0], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module.split(".")[0], node.lineno))
    return found


def skipped_without(tree: ast.Module) -> dict[str, int]:
    """Package -> line of the module-level ``pytest.importorskip("package...")`` calls."""
    found: dict[str, int] = {}
    for node in tree.body:
        call = node.value if isinstance(node, ast.Expr | ast.Assign) else None
        if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                and call.func.attr == "importorskip" and call.args
                and isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, str)):
            found.setdefault(call.args[0].value.split(".")[0], node.lineno)
    return found


def unguarded(path: Path) -> list[str]:
    """Each import of an extra at ``path``'s top with no importorskip of it above."""
    tree = ast.parse(path.read_text(), str(path))
    guards = skipped_without(tree)
    return [f"{path.name}:{line} imports {package}" for package, line in top_imports(tree)
            if package in EXTRAS and not guards.get(package, line) < line]


def test_every_module_the_suite_collects_imports_an_extra_only_after_skipping_without_it():
    modules = sorted(TESTS.glob("test_*.py"))
    imported = {package for path in modules for package, _ in top_imports(ast.parse(path.read_text()))}
    helpers = {TESTS / f"{package}.py" for package in imported if (TESTS / f"{package}.py").exists()}
    assert TESTS / "conftest.py" in helpers  # the helpers the test modules import are read too
    assert [problem for path in [*modules, *sorted(helpers)] for problem in unguarded(path)] == []


def test_the_check_sees_an_unguarded_import_and_takes_a_guarded_one(tmp_path):
    bare = tmp_path / "test_bare.py"
    bare.write_text("import pytest\nimport torch.distributed as dist\n")
    guarded = tmp_path / "test_guarded.py"
    guarded.write_text("import pytest\n\ntorch = pytest.importorskip('torch')\n\nimport torch.nn  # noqa\n")
    late = tmp_path / "test_late.py"
    late.write_text("import pytest\nfrom diffusers import x\npytest.importorskip('diffusers')\n")
    assert unguarded(bare) == ["test_bare.py:2 imports torch"]
    assert unguarded(guarded) == []
    assert unguarded(late) == ["test_late.py:2 imports diffusers"]
