"""Function-level imports of the package's own modules: only the command modules have them (a
command loads what it runs, so `veloxquant --help` does not load mlx-lm, the compiler and every
stage), and none of them hides an import cycle: with all of them at module level, every module
still imports."""

import ast
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMAND_MODULES = {
    "cli.py",
    "recipe_commands.py",
    "board/cli.py",
    "eval/cli.py",
    "calibration/cli.py",
    "tune/cli.py",
    "serve/cli.py",
}


def _own_imports_in_functions(source: str):
    """The import statements of veloxquant's modules inside functions, as source lines."""
    found = []
    for fn in ast.walk(ast.parse(source)):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                own = (
                    isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("veloxquant"))
                ) or (isinstance(node, ast.Import) and any(a.name.startswith("veloxquant") for a in node.names))
                if own:
                    found.append(node)
    return found


def test_only_command_modules_import_inside_functions():
    package = ROOT / "veloxquant"
    lazy = {str(p.relative_to(package)) for p in package.rglob("*.py") if _own_imports_in_functions(p.read_text())}
    assert lazy <= COMMAND_MODULES, sorted(lazy - COMMAND_MODULES)


def test_hoisting_the_lazy_imports_makes_no_cycle(tmp_path):
    shutil.copytree(ROOT / "veloxquant", tmp_path / "veloxquant", ignore=shutil.ignore_patterns("__pycache__"))
    for name in COMMAND_MODULES:
        path = tmp_path / "veloxquant" / name
        source = path.read_text()
        tree = ast.parse(source)
        hoisted = [ast.unparse(node) for node in _own_imports_in_functions(source)]
        tops = [n.end_lineno for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        lines = source.splitlines()
        at = max(tops) if tops else tree.body[0].end_lineno
        lines[at:at] = hoisted
        path.write_text("\n".join(lines) + "\n")
    modules = sorted(
        ".".join(p.relative_to(tmp_path).with_suffix("").parts).removesuffix(".__init__")
        for p in (tmp_path / "veloxquant").rglob("*.py")
    )
    script = "".join(f"import {m}\n" for m in modules) + "import veloxquant; print(veloxquant.__file__)\n"
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert str(tmp_path) in done.stdout  # the hoisted copy was the one imported
