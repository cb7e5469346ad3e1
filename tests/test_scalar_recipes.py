"""The scalar-quantization family as built-in recipes: check, explain, generate, save/load, honest
bytes; and mixed with other families' stages."""

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

import veloxquant as vq
from veloxquant.compiler import SMOLLM2_135M, ModelShape, compile_recipe
from veloxquant.compiler.explain import render
from veloxquant.recipe import load_recipe

from conftest import feed, tiny_gemma3, tiny_llama
from conftest import pipeline_recipe as _recipe

FAMILY = ["skvq", "kitty", "zipcache", "adakv_bits", "kvquant", "gear", "age_tiered", "composite"]


def _honest(caches):
    for c in caches:
        c._settle()
        held = sum(a.nbytes for t in c.tiers for a in t.arrays().values())
        bufs = [b for t in c.tiers for side in (*t.buffers.values(), getattr(t, "meta", {})) for b in side.values()]
        slack = sum(b.nbytes for b in bufs) - sum(b.view().nbytes for b in bufs if b.view() is not None)
        assert c.nbytes == held + slack  # the arrays held (codes, metadata, levels, masks, sums) + growth slack


def _generate(model, caches, prompt, n=4):
    return [int(tok) for (tok, _), _ in zip(generate_step(prompt, model, prompt_cache=caches), range(n))]


@pytest.mark.parametrize("name", FAMILY)
def test_checks_and_explains_on_smollm2_and_gemma3_shapes(name):
    recipe = load_recipe(name)
    assert len(open(recipe.path).read().splitlines()) < 30
    for shape in (SMOLLM2_135M, ModelShape.from_model(tiny_gemma3())):
        plan = compile_recipe(recipe, shape)
        assert "long-context cost" in render(plan)


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3])
@pytest.mark.parametrize("name", FAMILY)
def test_runs_in_mlx_lm_generate_with_honest_bytes(name, make):
    model = make()
    caches = vq.make_prompt_cache(model, name)
    prompt = mx.random.randint(0, 500, (300,), key=mx.random.key(0))
    assert len(_generate(model, caches, prompt)) == 4
    assert caches[0].attended
    _honest(caches)


@pytest.mark.parametrize("name", FAMILY)
def test_save_load_round_trip_continues_identically(tmp_path, name, llama_model):
    tokens = mx.random.randint(0, 500, (1, 330), key=mx.random.key(1))
    caches = vq.make_prompt_cache(llama_model, name)
    feed(llama_model, tokens[:, :300], caches, 100)
    path = tmp_path / "c.safetensors"
    vq.save_prompt_cache(str(path), caches)
    loaded, _ = vq.load_prompt_cache(str(path), expect_fingerprint=caches[0].fingerprint)
    assert mx.array_equal(feed(llama_model, tokens[:, 300:], caches, 5), feed(llama_model, tokens[:, 300:], loaded, 5))


@pytest.mark.parametrize(
    "pipeline",
    [
        # SnapKV's prompt-end eviction, the survivors coded with exact outliers (KVQuant's sparse list)
        "snap(budget=96, window=16) | keys: affine(bits=3, axis=token) | sparse(0.02) "
        "values: affine(bits=4, axis=token)",
        # sinks, a window, then score-routed codes whose salient branch is itself a channel split
        "sink(4)\n>> recent(64)\n>> salient(hi=split(hi=affine(bits=8, group=32, axis=channel), lo=affine(bits=4, "
        "group=32, axis=channel), by=range), lo=affine(bits=2, group=32, axis=token), chunk=128)",
        # an age band coded kvquant-style, older tokens GEAR-style
        "sink(4)\n>> recent(32)\n>> recent(128) | keys: unrope | nuq(bits=4) values: affine(bits=4, axis=token)\n"
        ">> affine(bits=2, group=32, axis=token) | lowrank(rank=2, chunk=32) | sparse(0.02)",
    ],
)
def test_family_stages_mix_with_other_families(tmp_path, pipeline, llama_model):
    recipe = _recipe(tmp_path, pipeline)
    tokens = mx.random.randint(0, 500, (1, 300), key=mx.random.key(2))
    ref = feed(llama_model, tokens, vq.make_prompt_cache(llama_model, "fp16"), 100)
    caches = vq.make_prompt_cache(llama_model, recipe)
    got = feed(llama_model, tokens[:, :299], caches, 100)
    got = mx.concatenate([got, feed(llama_model, tokens[:, 299:], caches, 1)], axis=1)  # decode: snap decides
    assert got.shape == ref.shape and bool(mx.isfinite(got).all())
    _honest(caches)
    path = tmp_path / "c.safetensors"
    vq.save_prompt_cache(str(path), caches)
    loaded, _ = vq.load_prompt_cache(str(path))
    more = mx.random.randint(0, 500, (1, 6), key=mx.random.key(3))
    assert mx.array_equal(feed(llama_model, more, caches, 3), feed(llama_model, more, loaded, 3))


@pytest.mark.slow
@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_family_runs_on_the_real_models(which):
    """SmolLM2-135M and Gemma-3-270M (sliding-window layers): mlx-lm's generate drives every recipe."""
    from veloxquant.data import load_text
    from veloxquant.models import load_model

    model, tokenizer = load_model(None if which == "smollm2" else "gemma3")
    prompt = mx.array(tokenizer.encode(load_text("austen"))[:700])
    vocab = model.model.embed_tokens.weight.shape[0] if hasattr(model, "model") else 1 << 20
    for name in FAMILY:  # quality is measured in docs/results.md, not asserted here
        caches = vq.make_prompt_cache(model, name)
        toks = _generate(model, caches, prompt, 3)
        assert len(toks) == 3 and all(0 <= t < vocab for t in toks), name
        assert caches[0].attended and all(c.offset >= 700 for c in caches), name
        _honest(caches)


def test_per_tier_state_is_refused_in_per_head_tiers(tmp_path):
    from veloxquant.errors import RecipeError

    with pytest.raises(RecipeError, match="'nuq' keeps per-tier state") as e:
        compile_recipe(_recipe(tmp_path, "snap(budget=96) | keys: nuq(bits=4) values: fp16"), SMOLLM2_135M)
    assert "r.yaml:4:3" in str(e.value.location)
