"""`veloxquant tune` on a tiny random model: measured bytes within budget, resumable, a loadable recipe."""

import random

import pytest

from tests.conftest import tiny_llama
from tests.test_eval import CharTokenizer
from veloxquant import cli, pool
from veloxquant.compiler import ModelShape
from veloxquant.recipe import load_recipe
from veloxquant.tune.space import Candidate, estimate_ratio, grid, mixes

ARGS = ["--prefix", "96", "--score-tokens", "16", "--heldout-windows", "1", "--no-progress"]


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    monkeypatch.setitem(pool._MODELS, "tiny", (tiny_llama(layers=2), CharTokenizer()))
    rng = random.Random(0)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(rng.choice("abcdefgh ") for _ in range(800)))
    return corpus


def test_candidates_are_recipes():
    cands = list(grid("kivi"))
    assert len(cands) == 3 * 4 * 2 and Candidate("kivi", (("bits", 2), ("window", 16), ("group", 32))) in cands
    mix = next(iter(mixes(Candidate("kivi", (("bits", 3), ("window", 64))))))
    text = mix.yaml("m", "a comment\nline two")
    assert text.startswith("# a comment\n# line two\nveloxquant: 1\nname: m\nextends: kivi\n")
    assert 'layers:\n  "0": {params: {bits: 4}}' in text


def test_estimate_orders_by_bytes():
    shape = ModelShape.uniform("s", 4, 3, 64)
    small = estimate_ratio(Candidate("kivi", (("bits", 2), ("window", 16))), shape, 1024)
    large = estimate_ratio(Candidate("kivi", (("bits", 4), ("window", 128))), shape, 1024)
    assert 0 < small < large < 0.5


def test_tune_writes_a_recipe_within_budget_and_resumes(tiny, tmp_path, capsys):
    out, state = tmp_path / "t.yaml", tmp_path / "state.jsonl"
    argv = [
        "tune",
        "tiny",
        "--max-bytes",
        "0.5",
        "--from",
        "kivi",
        "--corpus",
        str(tiny),
        "-o",
        str(out),
        "--state",
        str(state),
        *ARGS,
    ]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "Pareto front" in text and "held-out slice" in text and "(tuned)" in text
    written = out.read_text()
    assert "extends: kivi" in written and "# Command: " in written and "held-out:    bytes" in written
    ratio = float(written.split("held-out:    bytes ")[1].split(",")[0])
    assert ratio <= 0.5 + 0.1  # the budget holds on calibration; held-out windows are the same length
    load_recipe(str(out))
    lines = len(state.read_text().splitlines())
    assert cli.main(argv) == 0  # resumed: nothing measured again
    capsys.readouterr()
    assert len(state.read_text().splitlines()) == lines


def test_bad_budget_is_an_error(capsys):
    assert cli.main(["tune", "tiny", "--max-bytes", "2"]) == 2
    assert "--max-bytes" in capsys.readouterr().err
