"""KVzap (recipes/kvzap.yaml): calibrated on our own kvzip scores, each token scored as it arrives
from its layer's attention input, evicted once at the prompt's end by budget or threshold (tiny
random Llama; SmolLM2's contract checks are in test_mlx_contract_calibrated.py)."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

import veloxquant as vq
from veloxquant.artifacts import CalibrationError, slot_arrays
from veloxquant.calibration.fit import calibrate
from veloxquant.compiler import ModelShape
from veloxquant.compiler.batching import refusal
from veloxquant.errors import VeloxError
from veloxquant.runtime.persist import load_prompt_cache, save_prompt_cache
from veloxquant.stages.kvzap import KVzap, predict

from conftest import CharTokenizer
from test_chunk_invariance import FEED, check


@pytest.fixture
def sets(tmp_path, monkeypatch, llama_model):
    """kvzap's settings with a linear predictor calibrated on 2,048 tokens of random text."""
    monkeypatch.setenv("VELOXQUANT_CACHE", str(tmp_path / "cache"))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(chr(int(i)) for i in np.random.default_rng(0).integers(32, 500, 2048)))
    chosen = [f"corpus={corpus}", "tokens=2048", "predictor=linear"]
    plan = vq.compile_recipe(vq.load_recipe("kvzap"), ModelShape.from_model(llama_model), chosen)
    calibrate(plan, llama_model, CharTokenizer(), progress=False)
    return chosen


def _prompt(n=96, seed=1):
    return mx.array(np.random.default_rng(seed).integers(0, 500, (1, n)))


def _layer0_scores(model, tokens, digest):
    """What layer 0's model predicts from that layer's attention input, computed here from the weights."""
    h = model.model.layers[0].input_layernorm(model.model.embed_tokens(tokens))
    return mx.transpose(predict(slot_arrays(digest, "0.0.route"), h), (0, 2, 1))


def test_without_its_artifact_it_names_the_calibrate_command(llama_model, tmp_path, monkeypatch):
    monkeypatch.setenv("VELOXQUANT_CACHE", str(tmp_path / "empty"))
    with pytest.raises(CalibrationError, match="veloxquant calibrate kvzap"):
        vq.make_prompt_cache(llama_model, "kvzap")


def test_each_token_is_scored_from_its_layers_attention_input(llama_model, sets):
    caches = vq.make_prompt_cache(llama_model, "kvzap", sets + ["budget=32"])
    tokens = _prompt()
    llama_model(tokens[:, :50], cache=caches)  # two blocks: each scored from its own hidden states
    llama_model(tokens[:, 50:], cache=caches)
    tier = caches[0].tiers[0]
    assert tier.count == 96  # nothing leaves before the prompt ends
    want = _layer0_scores(llama_model, tokens, caches[0].plan.tiers[0].route._artifact)
    np.testing.assert_allclose(np.array(tier.scores), np.array(want), rtol=1e-4, atol=1e-4)
    assert tier.scorer.heard is None  # the hidden states were used and let go


def test_budget_keeps_each_heads_best_and_the_sinks(llama_model, sets):
    caches = vq.make_prompt_cache(llama_model, "kvzap", sets + ["budget=32", "sinks=4"])
    tokens = _prompt()
    llama_model(tokens, cache=caches)
    scores = np.array(caches[0].tiers[0].scores)[0]  # [H, 96]
    for c in caches:
        c.finish_prompt()
    pos = np.array(caches[0].tiers[0].positions)[0]
    for h in range(scores.shape[0]):  # layer 0 sees no position: a repeated token ties with itself
        kept = np.zeros(96, bool)
        kept[pos[h]] = True
        assert len(pos[h]) == 32 and kept[:4].all()
        assert scores[h, 4:][kept[4:]].min() >= scores[h, 4:][~kept[4:]].max()


def test_threshold_keeps_per_head_what_reaches_it(llama_model, sets):
    tokens = _prompt()
    probe = vq.make_prompt_cache(llama_model, "kvzap", sets)
    llama_model(tokens, cache=probe)
    scores = np.array(probe[0].tiers[0].scores)[0]
    threshold = float(np.median(scores))
    caches = vq.make_prompt_cache(llama_model, "kvzap", sets + ["keep=threshold", f"threshold={threshold}"])
    llama_model(tokens, cache=caches)
    for c in caches:
        c.finish_prompt()
    tier = caches[0].tiers[0]
    want = [int(((scores[h] >= threshold) | (np.arange(96) < 4)).sum()) for h in range(scores.shape[0])]
    assert tier.lengths() == want and len(set(want)) > 1  # heads keep different counts
    llama_model(mx.array([[7]]), cache=caches)  # and decode on, appending
    assert tier.lengths() == [n + 1 for n in want]


def test_generate_then_save_and_load_continue_alike(llama_model, sets, tmp_path):
    caches = vq.make_prompt_cache(llama_model, "kvzap", sets + ["budget=48"])
    steps = generate_step(_prompt(120)[0], llama_model, prompt_cache=caches, max_tokens=4, prefill_step_size=32)
    assert len([t for t, _ in steps]) == 4
    # decided at generate_step's first one-token step (119 prompt tokens held), then appended
    assert caches[0].tiers[0].lengths() == [48 + caches[0].offset - 119] * 3
    path = str(tmp_path / "c.safetensors")
    save_prompt_cache(path, caches)
    loaded, _ = load_prompt_cache(path, expect_fingerprint=caches[0].fingerprint, model=llama_model)
    nxt = mx.array([[5]])
    np.testing.assert_array_equal(np.array(llama_model(nxt, cache=caches)), np.array(llama_model(nxt, cache=loaded)))
    np.testing.assert_array_equal(np.array(caches[3].tiers[0].scores), np.array(loaded[3].tiers[0].scores))


def test_a_block_that_comes_without_hidden_states_is_a_clear_error(llama_model, sets):
    caches = vq.make_prompt_cache(llama_model, "kvzap", sets)
    k = mx.zeros((1, 3, 8, 64))
    with pytest.raises(VeloxError, match="hidden state its layer's attention is called with"):
        caches[0].update_and_fetch(k, k)


def test_it_does_not_batch_and_says_why(llama_model):
    plan = vq.compile_recipe(vq.load_recipe("kvzap"), ModelShape.from_model(llama_model))
    assert "hidden" in refusal(plan)


def test_the_fitters_recover_what_they_are_fitted_to():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4000, 24)).astype(np.float32)
    w = rng.standard_normal((24, 3)).astype(np.float32)
    linear = KVzap(predictor="linear").fit_scores(x, x @ w + 0.5)
    np.testing.assert_allclose(linear["w"], w, atol=1e-2)
    assert linear["r2"].min() > 0.999
    bent = np.abs(x @ w)  # not linear in x: the MLP's case (r2 0.99 measured; the linear map's about 0)
    assert KVzap(predictor="mlp", width=64).fit_scores(x, bent)["r2"].min() > 0.95
    assert KVzap(predictor="linear").fit_scores(x, bent)["r2"].max() < 0.1


def test_same_tokens_same_cache_however_they_arrive(llama_model, tmp_path, monkeypatch):
    """test_chunk_invariance's check (one block, chunks, single steps; nbytes = every array reachable),
    on a calibrated kvzap: scores come from each block's own hidden states, so the feed does not matter."""
    monkeypatch.setenv("VELOXQUANT_CACHE", str(tmp_path / "cache"))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(chr(int(i)) for i in np.random.default_rng(0).integers(32, 500, 1024)))
    recipe = tmp_path / "kvzap_small.yaml"
    recipe.write_text(f'veloxquant: 1\nname: kvzap_small\npipeline: kvzap(budget=64, corpus="{corpus}", tokens=1024)\n')
    plan = vq.compile_recipe(vq.load_recipe(str(recipe)), ModelShape.from_model(llama_model))
    calibrate(plan, llama_model, CharTokenizer(), progress=False)
    held = check(llama_model, str(recipe), FEED)
    assert held["chunks"] < held["singles"]  # told the prompt ended, the chunks kept 64 tokens a head
