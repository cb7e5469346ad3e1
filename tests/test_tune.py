"""`veloxquant tune` on a tiny random model: measured bytes within budget, resumable, a loadable recipe."""

import json
import random

import attrs
import pytest

from tests.conftest import tiny_llama
from tests.test_eval import CharTokenizer
from veloxquant import cli, pool
from veloxquant.compiler import ModelShape, compile_recipe
from veloxquant.recipe import load_recipe
from veloxquant.tune import hybrid, search
from veloxquant.tune.measure import recipe_from_text
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


def test_hybrid_points_spend_the_budget_in_a_seeded_order():
    shape = ModelShape.uniform("s", 4, 3, 64)
    points = hybrid.points(shape, 768, 0.2, seed=0)
    assert points == hybrid.points(shape, 768, 0.2, seed=0)  # reproducible
    assert points != hybrid.points(shape, 768, 0.2, seed=1) and set(points) == set(hybrid.points(shape, 768, 0.2, 1))
    assert {p.key_codec for p in points} == {p.value_codec for p in points} == set(hybrid.CODECS)
    for p in points[:6]:
        assert estimate_ratio(p, shape, 768) <= 0.2  # fits ...
        more = attrs.evolve(p, budget=p.budget + hybrid.BUDGET_STEP)
        if more.budget < 768 - p.sinks - p.window:  # (2-bit codes alone fit: the point keeps every token)
            assert estimate_ratio(more, shape, 768) > 0.2  # ... and spends it: one step more does not fit
        compile_recipe(recipe_from_text(p.yaml("h")), shape)
    # lagquant's hand-chosen point is in the space: at its bytes the solved budget is its own
    lag = hybrid.fit_budget(hybrid.Hybrid(0), shape, 768, estimate_ratio(Candidate("lagquant"), shape, 768))
    assert lag.budget == load_recipe("lagquant").params["budget"].default


def test_hybrid_mixes_widen_some_layers_within_budget():
    shape = ModelShape.uniform("s", 4, 3, 64)
    best = hybrid.fit_budget(hybrid.Hybrid(0, "lloydmax", 3, "affine", 2, 16), shape, 768, 0.15)
    mixed = list(hybrid.mixes(best, shape, 768, 0.15))
    assert mixed and all(m.layers and m.budget < best.budget for m in mixed)
    text = mixed[0].yaml("m")
    assert 'layers:\n  "0": {params: {key_bits: 4}}' in text
    plan = compile_recipe(recipe_from_text(text), shape)
    assert plan.layers[0] != plan.layers[1]


def test_tune_searches_the_hybrid_space(tiny, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(hybrid, "BITS", (2,))
    monkeypatch.setattr(hybrid, "WINDOWS", (0,))
    monkeypatch.setattr(hybrid, "LAYER_SETS", ("0",))
    out = tmp_path / "h.yaml"
    argv = ["tune", "tiny", "--max-bytes", "0.2", "--from", "hybrid", "--corpus", str(tiny), "-o", str(out)]
    argv += ["--state", str(tmp_path / "s.jsonl"), "--seed", "3", *ARGS]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "(tuned)" in text and "| ΔPPL vs fp16 | KLD |" in text
    results = [json.loads(x)["result"] for x in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert all(r["kld"] >= 0 for r in results) and min(r["kld"] for r in results) < 1e-6  # fp16 against itself
    written = out.read_text()
    assert "score=lagkv" in written and "extends" not in written
    assert float(written.split("held-out:    bytes ")[1].split(",")[0]) <= 0.2
    load_recipe(str(out))


def test_unknown_base_is_still_an_error(capsys):
    assert cli.main(["tune", "tiny", "--max-bytes", "0.2", "--from", "hybrd"]) == 2
    assert "hybrd" in capsys.readouterr().err


def test_the_objective_picks_the_best():
    results = {"a": {"nll": 10.0, "tokens": 10, "kld": 0.2}, "b": {"nll": 12.0, "tokens": 10, "kld": 0.1}}
    assert search._best(["a", "b"], results, "ppl") == "a" and search._best(["a", "b"], results, "kld") == "b"
