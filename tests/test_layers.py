"""The layer contract (pyproject.toml, import-linter): h2ir -> backends -> frontend -> executor,
imports pointing down only, function-local ones included."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT = Path(sys.executable).parent / "lint-imports"
PACKAGES = ("h2ir", "backends", "frontend", "executor")

pytestmark = pytest.mark.skipif(not LINT.exists(), reason="import-linter is not installed")


def lint(root: Path):
    return subprocess.run([str(LINT), "--config", str(root / "pyproject.toml"), "--no-cache"],
                          cwd=root, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})


def tree_copy(tmp_path: Path) -> Path:
    for p in PACKAGES:
        shutil.copytree(ROOT / p, tmp_path / p, ignore=shutil.ignore_patterns("__pycache__", "*.lark",
                                                                              "*.toml"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def test_the_tree_keeps_the_contract():
    r = lint(ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 broken" in r.stdout


@pytest.mark.parametrize("module,stmt,message", [
    ("h2ir/planner/_probe.py", "def f():\n    from executor import launcher\n",
     "h2ir is not allowed to import executor"),
    ("backends/_probe.py", "import frontend.capture\n", "backends is not allowed to import frontend"),
    ("h2ir/plans/_probe.py", "from h2ir.planner import resource\n",
     "h2ir.plans is not allowed to import h2ir.planner"),
])
def test_an_upward_import_breaks_it(tmp_path, module, stmt, message):
    root = tree_copy(tmp_path)
    (root / module).write_text(stmt)
    r = lint(root)
    assert r.returncode != 0
    assert message in r.stdout, r.stdout
