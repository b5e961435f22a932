"""The names ``import cptune`` exports: what the README says they are, whatever was imported
before, and without the heavy dependencies the MPI ranks never need."""

import subprocess
import sys
from pathlib import Path

import pytest

from cptune.store import Store

pytestmark = pytest.mark.slow  # every test here starts a fresh interpreter


def run_python(script: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-P", "-c", script], capture_output=True, text=True, timeout=120)


def test_recommend_answers_twice_in_one_process(tmp_path):
    script = (
        "import cptune\n"
        "w = cptune.Workload(4096, heads=8, head_dim=64)\n"
        "for _ in range(2):\n"
        f"    pick = cptune.recommend(w, hardware='h100-sxm-8', db={str(tmp_path / 'cptune.db')!r})\n"
        "    print(type(pick).__name__, pick.config.ranks)\n"
    )
    with Store(str(tmp_path / "cptune.db")):  # recommend reads a database; it never creates one
        pass
    result = run_python(script)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 2 and lines[0] == lines[1] and lines[0].startswith("Recommendation ")


def test_every_exported_name_survives_importing_every_submodule():
    script = (
        "import importlib, pkgutil, types, cptune\n"
        "for info in pkgutil.walk_packages(cptune.__path__, 'cptune.'):\n"
        "    if not info.name.startswith('cptune.db'):  # Alembic's env.py runs only under Alembic\n"
        "        importlib.import_module(info.name)\n"
        "for name in cptune.__all__:\n"
        "    value = getattr(cptune, name)\n"
        "    if isinstance(value, types.ModuleType):\n"
        "        print(name, 'is the module', value.__name__)\n"
        "from cptune import PlanError, PlanMismatchError, CPTuneError\n"
        "assert issubclass(PlanMismatchError, PlanError) and issubclass(PlanError, CPTuneError)\n"
        "assert callable(cptune.recommend) and callable(cptune.evaluate) and callable(cptune.export_plan)\n"
    )
    result = run_python(script)
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize("heavy", ["sklearn", "sqlalchemy", "optuna"])
def test_importing_cptune_stays_light(heavy):
    result = run_python(f"import sys, cptune; print({heavy!r} in sys.modules)")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_python_started_in_the_checkout_finds_the_migrations_and_spaces(tmp_path):
    """``python`` in the repository root imports cptune from the source tree, where the
    installed subpackages cptune.db and cptune.search_spaces do not exist: the README's
    snippets run there must still open a database and find the shipped spaces."""
    checkout = Path(__file__).resolve().parent.parent
    script = (
        "import cptune, pathlib\n"
        f"assert str(pathlib.Path(cptune.__file__).resolve().parent) == {str(checkout / 'cptune')!r}\n"
        "from cptune.space import builtin_spaces\n"
        "from cptune.store import Store\n"
        f"with Store({str(tmp_path / 'new.db')!r}) as store:\n"
        "    print(len(store.results()), 'demo' in builtin_spaces())\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            cwd=checkout)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["0", "True"]
