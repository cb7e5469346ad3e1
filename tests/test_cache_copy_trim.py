"""Deep copies and trimming, over every built-in recipe (tiny model).

mlx-lm deep-copies prompt caches (LRUPromptCache, BatchGenerator, evaluate.py)
and trims them (trim_prompt_cache, speculative decoding): a copy continues
exactly like its original, and trim(n) rewinds exactly min(n, offset) positions
in every layer or, where is_trimmable() is False, nothing at all.
"""

import copy

import mlx.core as mx
import pytest
from mlx_lm.models.cache import RotatingKVCache, can_trim_prompt_cache, trim_prompt_cache

import veloxquant as vq

from conftest import feed
from recipe_sets import EXACT, RECIPES, SMALL

TOKENS = mx.random.randint(0, 500, (1, 220), key=mx.random.key(11))


def caches_after(model, recipe, n):
    caches = vq.make_prompt_cache(model, recipe, SMALL.get(recipe, []))
    feed(model, TOKENS[:, :n], caches, 50)
    model(TOKENS[:, n : n + 1], cache=caches)  # one decode step, as generation does
    return caches


def snapshot(caches):
    return [(c.offset, c.size(), [mx.array(a) for a in c.state]) for c in caches]


@pytest.mark.parametrize("recipe", RECIPES)
def test_deep_copy_continues_identically_and_leaves_the_original_alone(llama_model, recipe):
    caches = caches_after(llama_model, recipe, 150)
    twin = copy.deepcopy(caches)
    more = TOKENS[:, 151:160]
    a = feed(llama_model, more, twin, 1)  # the copy moves on first: the original must not see it
    b = feed(llama_model, more, caches, 1)
    assert float(mx.abs(a - b).max()) == 0.0
    assert [c.offset for c in twin] == [c.offset for c in caches]
    assert [c.nbytes for c in twin] == [c.nbytes for c in caches]


def test_deep_copy_keeps_cross_layer_links_inside_the_copy(llama_model):
    caches = caches_after(llama_model, "xquant", 150)
    twin = copy.deepcopy(caches)
    coord = twin[1].coordinator
    assert coord is not caches[1].coordinator
    assert all(a is b for a, b in zip(coord.caches, twin))
    assert all(link.coordinator is coord for link in coord.links)
    reuse = next(t for t in twin[1].tiers if hasattr(t, "link"))
    assert all(c.link is reuse.link for c in reuse.codecs.values() if hasattr(c, "link"))
    # The original may now be dropped: the copy reads only its own anchors.
    del caches
    feed(llama_model, TOKENS[:, 151:160], twin, 1)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("prompt", [40, 150])
def test_trim_is_all_layers_exactly_or_nothing(llama_model, recipe, prompt):
    caches = caches_after(llama_model, recipe, prompt)
    before = snapshot(caches)
    trimmable = can_trim_prompt_cache(caches)
    # Layers may differ (pyramidkv's small budgets evict first); trim_prompt_cache asks them all.
    held = [c._fetch() for c in caches] if trimmable else None  # K/V of every position, in order
    got = trim_prompt_cache(caches, 13)
    if not trimmable:
        assert got == 0 and all(c.trim(5) == 0 for c in caches if not c.is_trimmable())
        after = snapshot(caches)
        assert [s[:2] for s in after] == [s[:2] for s in before]
        assert all(mx.array_equal(x, y) for a, b in zip(after, before) for x, y in zip(a[2], b[2]))
        return
    kept = prompt + 1 - 13
    assert got == 13
    assert {(c.offset, c.size()) for c in caches} == {(kept, kept)}
    for c, (k, v) in zip(caches, held):  # the kept positions hold what they held before
        for old, new in zip((k, v), c._fetch()):
            # a quantized group cut in two is re-held from its decoded values, in fp16
            assert float(mx.abs(old[:, :, :kept] - new).max()) <= 2**-10 * float(mx.abs(old).max())


@pytest.mark.parametrize("recipe", EXACT)
def test_trimmed_exact_recipe_continues_like_one_that_never_saw_the_tokens(llama_model, recipe):
    # Token by token on both sides: a float32 BLAS rounds a 40-row prefill differently from a 28-row one.
    trimmed, fresh = (vq.make_prompt_cache(llama_model, recipe) for _ in range(2))
    feed(llama_model, TOKENS[:, :60], trimmed, 1)
    assert trim_prompt_cache(trimmed, 13) == 13
    feed(llama_model, TOKENS[:, :47], fresh, 1)
    a, b = (feed(llama_model, TOKENS[:, 47:52], c, 1) for c in (trimmed, fresh))
    assert float(mx.abs(a - b).max()) == 0.0


def test_trim_beyond_what_was_seen_rewinds_to_empty(llama_model):
    caches = caches_after(llama_model, "kivi", 150)
    assert trim_prompt_cache(caches, 1000) == 151
    assert all(c.offset == 0 and c.size() == 0 and c.empty() for c in caches)


@pytest.mark.parametrize("prompt", [90, 104, 105, 106, 140])
def test_streaming_llm_trims_when_mlx_rotating_cache_does(llama_model, prompt):
    # streaming_llm(window=100) claims RotatingKVCache(max_size=4 + 100 + 1, keep=4)'s logits; it refuses
    # trimming exactly when that cache does (once it has dropped a token).
    ours = vq.make_prompt_cache(llama_model, "streaming_llm", ["window=100"])
    ref = [RotatingKVCache(max_size=105, keep=4) for _ in llama_model.layers]
    feed(llama_model, TOKENS[:, :prompt], ref, 1)
    feed(llama_model, TOKENS[:, :prompt], ours, 1)
    assert can_trim_prompt_cache(ours) == can_trim_prompt_cache(ref)
    assert trim_prompt_cache(ours, 3) == trim_prompt_cache(ref, 3)


@pytest.mark.parametrize("prompt", [20, 31, 32, 33, 60])
def test_sliding_window_layers_trim_when_mlx_rotating_cache_does(prompt):
    from conftest import tiny_gemma3

    model = tiny_gemma3(window=32)
    ours, ref = vq.make_prompt_cache(model, "fp16"), model.make_cache()
    feed(model, TOKENS[:, :prompt], ref, 1)
    feed(model, TOKENS[:, :prompt], ours, 1)
    assert [c.is_trimmable() for c in ours] == [c.is_trimmable() for c in ref]
