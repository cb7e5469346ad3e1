"""`veloxquant diff`: plans, not text; git revisions read through `git show`; exit codes."""

import shutil
import subprocess
from pathlib import Path

import pytest

from veloxquant import cli

ROOT = Path(__file__).resolve().parent.parent
KIVI = """veloxquant: 1
name: mine
extends: kivi
params:
  bits: 2
"""
# The same plan, written differently: comments, flow style, key order, a long-form param.
KIVI_REFORMATTED = """# my recipe
name: mine
veloxquant: 1
params: {bits: 2}
extends: kivi   # built on KIVI
"""

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="needs the git command")


def run(capsys, *argv):
    rc = cli.main(["diff", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def write(path, text):
    path.write_text(text)
    return str(path)


def test_formatting_only_is_no_change(tmp_path, capsys):
    a, b = write(tmp_path / "a.yaml", KIVI), write(tmp_path / "b.yaml", KIVI_REFORMATTED)
    rc, out, _ = run(capsys, a, b)
    assert rc == 0
    assert "no change to the plan" in out


def test_renamed_copy_is_no_change(tmp_path, capsys):
    b = write(tmp_path / "b.yaml", (ROOT / "recipes" / "kivi.yaml").read_text().replace("name: kivi", "name: k2"))
    rc, out, _ = run(capsys, "kivi", b)
    assert rc == 0 and "no change to the plan" in out and "metadata: name changed" in out


def test_parameter_change(tmp_path, capsys):
    b = write(tmp_path / "b.yaml", KIVI.replace("bits: 2", "bits: 4"))
    rc, out, _ = run(capsys, "kivi", b)
    assert rc == 1
    assert "params: bits 2 -> 4" in out
    assert "30 of 30 layers change" in out
    assert "K affine bits: 2 -> 4" in out and "V affine bits: 2 -> 4" in out
    assert "3.00 bits/elem (0.188 of fp16) -> 5.00 bits/elem (0.312 of fp16)" in out
    assert "caches saved under A do not load under B" in out


def test_layer_override(tmp_path, capsys):
    b = write(tmp_path / "b.yaml", KIVI + 'layers:\n  "0": {pipeline: fp16}\n  "-2..-1": {params: {bits: 4}}\n')
    rc, out, _ = run(capsys, "kivi", b)
    assert rc == 1
    assert "3 of 30 layers change" in out
    assert "  layer 0:\n    tier 1 removed: recent(n=128) K,V: fp16" in out
    assert "  layers 28-29:\n    tier 2 rest K affine bits: 2 -> 4" in out
    assert "layers 1-27" not in out


def test_tier_added_and_schedule(capsys):
    rc, out, _ = run(capsys, "kivi", "kivi_sink")
    assert rc == 1 and "tier 1 added: sink(n=5) K,V: fp16" in out
    rc, out, _ = run(capsys, "h2o", "pyramidkv")
    assert rc == 1 and "tier 1 evict budget, per layer: 256 x30 -> 448, 435," in out


def test_bad_reference_is_an_error(capsys):
    rc, _, err = run(capsys, "kivi", "kivvi")
    assert rc == 2 and "did you mean 'kivi'" in err


def git(repo, *args):
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True, capture_output=True
    )


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A git repository with three commits of recipes/my.yaml (and a parent it extends)."""
    root = tmp_path / "repo"
    (root / "recipes").mkdir(parents=True)
    git(root, "init", "-q", "-b", "main")
    (root / "recipes" / "base.yaml").write_text(KIVI.replace("name: mine", "name: base"))
    (root / "recipes" / "my.yaml").write_text(KIVI.replace("extends: kivi", "extends: base.yaml"))
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "first")
    (root / "recipes" / "my.yaml").write_text(KIVI_REFORMATTED.replace("extends: kivi", "extends: base.yaml"))
    git(root, "commit", "-q", "-am", "reformat")
    (root / "recipes" / "my.yaml").write_text(
        KIVI.replace("extends: kivi", "extends: base.yaml").replace("bits: 2", "bits: 3")
    )
    git(root, "commit", "-q", "-am", "three bits")
    monkeypatch.chdir(root)
    return root


@needs_git
def test_git_revisions(repo, capsys):
    rc, out, _ = run(capsys, "HEAD~2:recipes/my.yaml", "HEAD~1:recipes/my.yaml")
    assert rc == 0 and "no change to the plan" in out
    rc, out, _ = run(capsys, "HEAD~1:recipes/my.yaml", "main:recipes/my.yaml")
    assert rc == 1 and "params: bits 2 -> 3" in out
    rc, out, _ = run(capsys, "HEAD~2:recipes/my.yaml", "recipes/my.yaml")  # a revision against the work tree
    assert rc == 1


@needs_git
def test_git_revision_relative_to_folder(repo, monkeypatch, capsys):
    monkeypatch.chdir(repo / "recipes")
    rc, out, _ = run(capsys, "HEAD~1:./my.yaml", "HEAD:./my.yaml")
    assert rc == 1 and "bits 2 -> 3" in out


@needs_git
def test_git_errors(repo, capsys):
    rc, _, err = run(capsys, "nosuchbranch:recipes/my.yaml", "kivi")
    assert rc == 2 and "no git revision 'nosuchbranch'" in err
    rc, _, err = run(capsys, "HEAD:recipes/nope.yaml", "kivi")
    assert rc == 2 and "revision 'HEAD' has no file 'recipes/nope.yaml'" in err
    (repo / "recipes" / "my.yaml").write_text("veloxquant: 1\nname: broken\npipeline: recnt(4) >> fp16\n")
    git(repo, "commit", "-q", "-am", "broken")
    rc, _, err = run(capsys, "HEAD:recipes/my.yaml", "kivi")
    assert rc == 2 and "HEAD:recipes/my.yaml:3:" in err and "veloxquant-rev-" not in err


def test_not_a_repository(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    rc, _, err = run(capsys, "HEAD:my.yaml", "kivi")
    assert rc == 2 and "not inside a git repository" in err
