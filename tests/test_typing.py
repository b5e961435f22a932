"""cptune's hints reach its users: mypy checks a typed script that calls ``cptune.recommend``
against the installed package, as a user's type checker would (the ``py.typed`` marker a
regular ``pip install .`` ships, no search path pointing into this checkout)."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import cptune

SCRIPT = """\
import cptune

workload = cptune.Workload(4096, heads=8, head_dim=64)
pick: cptune.Recommendation = cptune.recommend(workload, hardware="h100-sxm-8")
ranks: int = pick.config.ranks
plan = cptune.load_plan("plan.json")
wrong: str = pick.config.ranks
"""


#: What the interpreter finds as installed, run where nothing points into this checkout.
PROBE = """\
import importlib.metadata, json
dist = importlib.metadata.distribution("cptune")
url = json.loads(dist.read_text("direct_url.json") or "{}")
print(json.dumps({"editable": url.get("dir_info", {}).get("editable", False),
                  "files": [str(path) for path in dist.files or ()]}))
"""


@pytest.mark.slow  # mypy reads the installed package and what it imports: 15 s
def test_a_typed_script_reads_the_installed_packages_hints(tmp_path):
    # no search path of ours: mypy finds cptune where the interpreter does, less the working directory
    env = {key: value for key, value in os.environ.items() if key not in ("MYPYPATH", "PYTHONPATH")}
    probe = subprocess.run([sys.executable, "-P", "-c", PROBE], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=60, check=True)
    installed = json.loads(probe.stdout)
    if installed["editable"]:
        pytest.skip("cptune is installed editable (pip install -e), which mypy cannot read as a package; "
                    "the README's test command installs it (pip install .) and runs this")
    assert "cptune/py.typed" in installed["files"]  # installed with the package, not only in this checkout
    (tmp_path / "use.py").write_text(SCRIPT)
    # the user's own settings, not ours; the libraries cptune imports (torch's 1,400 modules alone
    # two thirds of mypy's time) are not what is read here: their names are Any
    skipped = "torch.*,sqlalchemy.*,optuna.*,alembic.*,matplotlib.*,onnx.*,rich.*,scipy.*,sklearn.*"
    (tmp_path / "mypy.ini").write_text(f"[mypy]\nstrict = True\n\n[mypy-{skipped}]\nfollow_imports = skip\n")
    result = subprocess.run([sys.executable, "-m", "mypy", "use.py"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=600)
    errors = [line for line in result.stdout.splitlines() if ": error:" in line]
    # Only the wrong use is reported: cptune was found and read (an unread or untyped package is
    # an import error, and every name from it Any, so the wrong line would pass).
    assert errors == ['use.py:7: error: Incompatible types in assignment (expression has type "int", '
                      'variable has type "str")  [assignment]'], result.stdout + result.stderr
    assert result.returncode == 1


def test_every_lazy_name_is_imported_for_type_checkers():
    """``cptune.recommend`` and the other names imported on first use (``_LAZY``) are imported
    under ``TYPE_CHECKING`` from the same module, or a type checker sees ``__getattr__``'s object."""
    tree = ast.parse(Path(cptune.__file__).read_text())
    for_types = {
        alias.name: node.module
        for block in tree.body if isinstance(block, ast.If) and ast.unparse(block.test) == "TYPE_CHECKING"
        for node in block.body if isinstance(node, ast.ImportFrom) for alias in node.names
    }
    assert for_types == cptune._LAZY
