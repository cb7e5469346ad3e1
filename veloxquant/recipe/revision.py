"""Recipes from git revisions: `HEAD~1:recipes/my.yaml`, `main:my.yaml`.

The file is read with `git show REV:PATH` (no checkout, the work tree is
untouched) into a temporary folder at the same relative path, together with
any parent it `extends` by a relative path inside the same revision, and then
loaded like any recipe file. Errors name the revision, never the temporary
folder.
"""

import re
import shutil
import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Iterator, Optional, Tuple

import yaml

from ..errors import RecipeError, VeloxError
from .load import Recipe, load_recipe

_REV_PATH = re.compile(r"^(?P<rev>[^:\s]+):(?P<path>[^:]+)$")


def split_revision(ref: str) -> Optional[Tuple[str, str]]:
    """('HEAD~1', 'recipes/my.yaml') for a git reference, None for a file or a built-in name.

    An existing file wins, so a path that happens to hold a colon still loads as a file."""
    if Path(ref).is_file():
        return None
    m = _REV_PATH.match(ref)
    return (m["rev"], m["path"]) if m else None


def _git(args, cwd: Path) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=False, check=False)
    except FileNotFoundError:
        raise VeloxError(
            "reading a recipe from a git revision needs the 'git' command, which is not installed"
        ) from None


def _repo_paths(rev: str, path: str, cwd: Path) -> Tuple[Path, str]:
    """(repository top, PATH relative to it) after checking that REV exists in the repository."""
    top = _git(["rev-parse", "--show-toplevel"], cwd)
    if top.returncode:
        raise VeloxError(f"'{rev}:{path}' reads a git revision, but {cwd} is not inside a git repository")
    found = _git(["rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"], cwd)
    if found.returncode:
        raise VeloxError(
            f"'{rev}:{path}': no git revision '{rev}' in this repository (try a branch, a tag, a commit hash or HEAD~N)"
        )
    prefix = _git(["rev-parse", "--show-prefix"], cwd).stdout.decode().strip()
    # git reads REV:PATH relative to the top, and REV:./PATH relative to the current folder.
    rel = str(PurePosixPath(prefix) / path[2:]) if path.startswith("./") else path
    return Path(top.stdout.decode().strip()), str(PurePosixPath(rel))


def _show(rev: str, rel: str, top: Path) -> Optional[bytes]:
    out = _git(["show", f"{rev}:{rel}"], top)
    return None if out.returncode else out.stdout


@contextmanager
def materialized(ref: str, cwd: Optional[Path] = None) -> Iterator[Tuple[Path, str]]:
    """(temporary file holding REV:PATH, its temporary folder); parents it extends come along."""
    rev, path = split_revision(ref)
    top, rel = _repo_paths(rev, path, Path(cwd or Path.cwd()))
    tmp = Path(tempfile.mkdtemp(prefix="veloxquant-rev-"))
    try:
        first = _show(rev, rel, top)
        if first is None:
            raise VeloxError(
                f"'{ref}': revision '{rev}' has no file '{rel}' (paths are relative to the "
                "repository's top folder; write REV:./PATH for one relative to this folder)"
            )
        queue, seen = [(rel, first)], set()
        while queue:  # the file, then each parent it extends by a relative path in the same revision
            name, data = queue.pop()
            if name in seen:
                continue
            seen.add(name)
            target = tmp / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
            parent = _extends_of(data)
            if parent and not parent.startswith("/"):
                parent_rel = _normalize(str(PurePosixPath(name).parent / parent))
                parent_data = _show(rev, parent_rel, top) if parent_rel else None
                if parent_data is not None:
                    queue.append((parent_rel, parent_data))
        yield tmp / rel, str(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _extends_of(data: bytes) -> Optional[str]:
    try:
        doc = yaml.safe_load(data)
    except yaml.YAMLError:
        return None  # load_recipe reports it, with its position
    value = doc.get("extends") if isinstance(doc, dict) else None
    return value if isinstance(value, str) else None


def _normalize(path: str) -> Optional[str]:
    parts = []
    for p in PurePosixPath(path).parts:
        if p == "..":
            if not parts:
                return None  # leaves the repository
            parts.pop()
        elif p != ".":
            parts.append(p)
    return "/".join(parts) or None


def load_any(ref: str, then: Optional[Callable[[Recipe], Any]] = None, cwd: Optional[Path] = None) -> Any:
    """A recipe from a file, a built-in name, or REV:PATH in the current git repository;
    `then(recipe)` instead when given (e.g. compile it), so that its errors also name REV:PATH."""
    then = then or (lambda recipe: recipe)
    if split_revision(ref) is None:
        return then(load_recipe(ref))
    rev = split_revision(ref)[0]
    with materialized(ref, cwd) as (file, tmp):
        try:
            return then(load_recipe(str(file)))
        except RecipeError as e:  # name the revision, not the temporary copy
            raise VeloxError(str(e).replace(tmp + "/", f"{rev}:")) from None
