"""The shipped .pre-commit-hooks.yaml, run by pre-commit itself on a temporary repository.

Offline: the hook repository is a local git repository holding our
.pre-commit-hooks.yaml, and the hooks are `language: system`, so pre-commit
installs nothing; `veloxquant` on PATH is a shim that runs this checkout.
"""

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GOOD = Path(__file__).parent / "recipes_good"

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs the git command")


def git(repo, *args):
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false", *args],
        cwd=repo,
        check=True,
        capture_output=True,
    )


@pytest.fixture
def env(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "veloxquant"
    shim.write_text(f'#!/bin/sh\nexec {sys.executable} -m veloxquant.cli "$@"\n')
    shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    e = dict(
        os.environ,
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        PYTHONPATH=str(ROOT),
        PRE_COMMIT_HOME=str(tmp_path / "pre-commit-home"),
        VELOXQUANT_NO_OPENBLAS="1",
    )
    return e


def hook_repo(tmp_path) -> tuple:
    repo = tmp_path / "hooks"
    repo.mkdir()
    shutil.copy(ROOT / ".pre-commit-hooks.yaml", repo)
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "hooks")
    rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    return repo, rev


def user_repo(tmp_path, files: dict) -> Path:
    hooks, rev = hook_repo(tmp_path)
    repo = tmp_path / "user"
    (repo / "recipes").mkdir(parents=True)
    (repo / ".pre-commit-config.yaml").write_text(
        f"repos:\n- repo: {hooks}\n  rev: {rev}\n  hooks:\n  - id: veloxquant-fmt\n  - id: veloxquant-check\n"
    )
    for name, text in files.items():
        (repo / name).write_text(text)
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    return repo


def pre_commit(repo, env):
    return subprocess.run(
        [sys.executable, "-m", "pre_commit", "run", "--all-files"],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_hooks_pass_on_canonical_recipes(tmp_path, env):
    kivi = (ROOT / "recipes" / "kivi.yaml").read_text()
    repo = user_repo(
        tmp_path, {"recipes/mine.yaml": kivi.replace("name: kivi", "name: mine"), "notes.yaml": "not: a recipe\n"}
    )  # outside recipes/: not checked
    out = pre_commit(repo, env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "veloxquant fmt --check" in out.stdout and "Passed" in out.stdout


def test_hooks_fail_on_unformatted_and_broken_recipes(tmp_path, env):
    repo = user_repo(
        tmp_path,
        {
            "recipes/messy.yaml": (GOOD / "messy.yaml").read_text(),
            "recipes/broken.yaml": "veloxquant: 1\nname: b\npipeline: recnt(8) >> fp16\n",
        },
    )
    out = pre_commit(repo, env)
    assert out.returncode == 1
    assert "would reformat recipes/messy.yaml" in out.stdout
    assert "recipes/broken.yaml:3:11 (pipeline): unknown stage 'recnt'" in out.stdout
