"""The error corpus: every file in tests/recipes_bad/ must fail with a clear message
at the exact file:line:column its first line names.

First line of each file:  # expect: [PATH:]LINE:COL SUBSTRING
PATH (relative to tests/recipes_bad/) is given only when the error is in another
file than the one checked (e.g. the file of an `extends` cycle that closes it).

`veloxquant check` runs as a subprocess once over the whole corpus (starting
Python with mlx-lm takes seconds, so not once per file); each file is also
checked in-process through the CLI's main() and through load_recipe +
compile_recipe.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from veloxquant import cli
from veloxquant.compiler import SMOLLM2_135M, apply_sets, compile_recipe
from veloxquant.errors import RecipeError
from veloxquant.recipe import load_recipe

BAD = Path(__file__).parent / "recipes_bad"
FILES = sorted(BAD.glob("*.yaml"))  # helper files of cycles live in subfolders
_EXPECT = re.compile(r"#\s*expect:\s*(?:(?P<path>\S+?\.yaml):)?(?P<line>\d+):(?P<col>\d+)\s+(?P<text>.+?)\s*$")


def expectation(path: Path):
    first = path.read_bytes().split(b"\n")[0].decode("utf-8")  # the rest may be bytes that are not UTF-8
    m = _EXPECT.fullmatch(first)
    assert m, f"{path.name}: first line must be '# expect: LINE:COL substring', got {first!r}"
    where = (BAD / m["path"]).resolve() if m["path"] else path.resolve()
    return str(where), int(m["line"]), int(m["col"]), m["text"]


def test_corpus_is_big_enough():
    assert len(FILES) >= 24


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_in_process(path):
    file, line, col, text = expectation(path)
    with pytest.raises(RecipeError) as info:
        compile_recipe(load_recipe(str(path)), SMOLLM2_135M)
    err = info.value
    assert err.location is not None, str(err)
    assert (err.location.file, err.location.line, err.location.column) == (file, line, col), str(err)
    assert text in str(err)


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_cli_main(path, capsys):
    file, line, col, text = expectation(path)
    code = cli.main(["check", str(path)])
    out, err = capsys.readouterr()
    assert code != 0
    assert "Traceback" not in out + err
    assert not out.startswith("ok")
    assert f"{file}:{line}:{col}" in err and text in err, err


@pytest.fixture(scope="module")
def corpus_run():
    """One `python -m veloxquant.cli check` over every file of the corpus."""
    proc = subprocess.run(
        [sys.executable, "-m", "veloxquant.cli", "check", *map(str, FILES)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=BAD.parent.parent,
    )
    blocks = re.split(r"^(?=error: )", proc.stderr, flags=re.M)
    return proc, [b for b in blocks if b.strip()]


def test_subprocess_fails_cleanly(corpus_run):
    proc, blocks = corpus_run
    assert proc.returncode != 0
    assert "Traceback" not in proc.stdout + proc.stderr
    assert proc.stdout == ""  # no file passed
    assert len(blocks) == len(FILES), proc.stderr


@pytest.mark.parametrize("index", range(len(FILES)), ids=[p.stem for p in FILES])
def test_subprocess_message(corpus_run, index):
    _, blocks = corpus_run
    file, line, col, text = expectation(FILES[index])
    block = blocks[index] if index < len(blocks) else ""
    assert block.startswith(f"error: {file}:{line}:{col}"), block
    assert text in block, block


# --set: errors that belong to the command line, not to a file.


def test_set_wrong_type_names_the_param():
    with pytest.raises(RecipeError) as info:
        apply_sets(load_recipe("kivi"), ["bits=two"])
    assert "parameter 'bits' is int, got 'two'" in str(info.value)
    assert info.value.location.file == "--set" and info.value.location.field == "bits"


def test_set_float_for_int():
    with pytest.raises(RecipeError, match="parameter 'window' is int, got 2.5"):
        apply_sets(load_recipe("kivi"), ["window=2.5"])


def test_set_unknown_param_suggests():
    with pytest.raises(RecipeError) as info:
        apply_sets(load_recipe("kivi"), ["bitz=4"])
    assert "has no parameter 'bitz'" in str(info.value) and "did you mean 'bits'" in str(info.value)


def test_set_without_equals():
    with pytest.raises(RecipeError, match="--set expects name=value"):
        apply_sets(load_recipe("kivi"), ["bits"])


def test_set_out_of_range_reported_at_the_ref():
    recipe = load_recipe("kivi")
    with pytest.raises(RecipeError) as info:
        compile_recipe(recipe, SMOLLM2_135M, ["bits=9"])
    err = info.value
    assert "parameter 'bits' must be between 1 and 8, got 9" in str(err)
    # the name of the $bits reference in kivi.yaml (line 11: "  >> keys:   affine(bits=$bits, ...")
    assert (Path(err.location.file).name, err.location.line, err.location.column) == ("kivi.yaml", 11, 27)


def test_set_error_through_cli(capsys):
    assert cli.main(["check", "kivi", "--set", "bits=two"]) != 0
    out, err = capsys.readouterr()
    assert "--set (bits): parameter 'bits' is int, got 'two'" in err and "Traceback" not in err


def test_run_checks_every_recipe_before_loading_the_model(capsys, monkeypatch):
    import veloxquant.models as models

    monkeypatch.setattr(
        models, "load_model", lambda *a, **k: pytest.fail("model loaded before the recipes were checked")
    )
    assert cli.main(["run", "fp16", "no_such_recipe"]) == 2
    assert "no_such_recipe" in capsys.readouterr().err
    assert cli.main(["run", "fp16", "kivi", "--save-cache", "c.safetensors"]) == 2
    assert "--save-cache takes one recipe" in capsys.readouterr().err


# Hostile files that cannot live in the corpus (encodings, chains of files).


def test_utf16_and_bom_recipes_load(tmp_path):
    text = "veloxquant: 1\nname: enc\npipeline: recent(8) >> affine(bits=2)\n"
    for enc in ("utf-16", "utf-32", "utf-8-sig"):
        path = tmp_path / f"{enc}.yaml"
        path.write_bytes(text.encode(enc))
        assert load_recipe(str(path)).name == "enc"


def test_utf16_error_is_placed_like_utf8(tmp_path):
    path = tmp_path / "u16.yaml"
    path.write_bytes("veloxquant: 1\nname: enc\npipeline: recent(8) >> nope\n".encode("utf-16"))
    with pytest.raises(RecipeError) as info:
        compile_recipe(load_recipe(str(path)), SMOLLM2_135M)
    assert (info.value.location.line, info.value.location.column) == (3, 24)  # the "n" of nope


def test_extends_chain_is_bounded(tmp_path):
    from veloxquant.recipe.limits import MAX_EXTENDS

    for i in range(MAX_EXTENDS + 2):
        (tmp_path / f"r{i}.yaml").write_text(f"veloxquant: 1\nname: r{i}\nextends: r{i + 1}.yaml\n")
    (tmp_path / f"r{MAX_EXTENDS + 2}.yaml").write_text("veloxquant: 1\nname: end\npipeline: fp16\n")
    with pytest.raises(RecipeError, match=f"more than {MAX_EXTENDS} recipes long") as info:
        load_recipe(str(tmp_path / "r0.yaml"))
    assert info.value.location.line == 3 and info.value.location.column == 10
    assert load_recipe(str(tmp_path / "r3.yaml")).name == "r3"  # a chain within the limit loads


def test_set_value_with_recursive_alias_or_bomb_is_a_type_error():
    recipe = load_recipe("kivi")
    bomb = (
        "["
        + ", ".join(
            ["&a [1,1,1,1,1,1,1,1,1]"] + [f"&{c} [{', '.join([f'*{p}'] * 9)}]" for p, c in zip("abcdefgh", "bcdefghi")]
        )
        + "]"
    )
    for value in ("&a [*a]", bomb, "!!python/object/apply:os.system [x]", "!!binary x"):
        with pytest.raises(RecipeError, match="parameter 'bits' is int"):
            apply_sets(recipe, [f"bits={value}"])


def test_alias_within_limits_still_works(tmp_path):
    path = tmp_path / "alias.yaml"
    path.write_text(
        "veloxquant: 1\nname: alias\nparams: {bits: 2, group: 32, window: 64}\n"
        "pipeline: recent($window) >> affine(bits=$bits)\n"
        "layers:\n  0: &low {params: {bits: 4}}\n  1: *low\n"
    )
    plan = compile_recipe(load_recipe(str(path)), SMOLLM2_135M)
    assert plan.layers[1].tiers[1].keys.store.bits == 4 and plan.layers[2].tiers[1].keys.store.bits == 2


def test_recipe_names_the_os_cannot_open(capsys):
    for ref in ("b" * 5000, "a\0b", "a/" * 3000):
        assert cli.main(["check", ref]) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: ") and "no recipe file or built-in recipe named" in err and len(err) < 400
