"""The layer contract (pyproject.toml, [tool.importlinter]) holds, and it can fail.

`lint-imports` reads every module's imports, function-level ones included, so
an import hidden inside a function breaks the contract as one at the top does.
"""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
lint_imports = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))
pytestmark = pytest.mark.skipif(not Path(lint_imports).exists(), reason="import-linter is not installed")


def _lint(root: Path) -> subprocess.CompletedProcess:
    """lint-imports on the package under `root`, with the contract of the pyproject.toml there."""
    return subprocess.run(
        [lint_imports, "--no-cache"],
        cwd=root,
        env={"PYTHONPATH": str(root), "PATH": ""},
        capture_output=True,
        text=True,
        timeout=120,
    )


def _copy(tmp_path: Path) -> Path:
    for package in ("veloxquant", "benchmarks"):  # the contract's root packages
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def test_the_package_keeps_its_layers():
    done = _lint(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


@pytest.mark.parametrize(
    "module, line, broken",
    [
        # a stage reaching up into the runtime, hidden in a function
        ("stages/_upward.py", "def f():\n    from ..runtime import cache\n", "layers: entry points"),
        # the recipe language importing its sibling, the stage vocabulary
        ("recipe/_sideways.py", "from ..stages import REGISTRY\n", "layers: entry points"),
        # the artifact store loading a model
        ("artifacts_model.py", "import mlx_lm\n", None),
    ],
)
def test_a_violation_breaks_the_contract(tmp_path, module, line, broken):
    root = _copy(tmp_path)
    if module == "artifacts_model.py":  # the store is a module: the violation goes into it
        path = root / "veloxquant" / "artifacts.py"
        path.write_text(path.read_text() + "\n" + line)
    else:
        (root / "veloxquant" / module).write_text(line)
    done = _lint(root)
    assert done.returncode != 0, done.stdout
    assert "0 broken" not in done.stdout, done.stdout
    assert (broken or "never load a model") in done.stdout.split("Broken contracts")[1], done.stdout
