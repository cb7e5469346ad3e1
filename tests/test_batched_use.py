"""Batched generation and mlx_lm.server's prompt-cache reuse with veloxquant caches.

BatchGenerator merges per-sequence caches through `merge`: a recipe whose plan does not batch
(compiler/batching.py) refuses there, with its reason, before the first token (the batches that do
run are tests/test_batch.py's). mlx-lm's server's LRUPromptCache deep-copies and trims caches: that
works, and a reused cache continues exactly like the one it was copied from.
"""

import copy

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator, batch_generate
from mlx_lm.models.cache import LRUPromptCache

import veloxquant as vq
from veloxquant.errors import VeloxError

from conftest import feed
from recipe_sets import RECIPES, SMALL

TOKENS = mx.random.randint(0, 500, (1, 200), key=mx.random.key(21))


class Tokenizer:  # what batch_generate reads of a tokenizer
    eos_token_ids = [499]

    def decode(self, ids):
        return " ".join(map(str, ids))


@pytest.mark.parametrize("recipe", ["age_tiered", "adakv"])
def test_batching_a_refused_recipe_fails_before_any_token(llama_model, recipe):
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    gen = BatchGenerator(llama_model, stop_tokens=[[499]])
    gen.insert(prompts, [5, 5], caches=[vq.make_prompt_cache(llama_model, recipe) for _ in prompts])
    with pytest.raises(VeloxError, match=f"recipe '{recipe}' does not batch: layer 0: "):
        gen.next_generated()  # the recipe's own reason (runtime/make.py: guard_merges), not mlx-lm's ValueError
    gen.close()


def test_batch_generate_without_our_caches_is_untouched_by_the_hook(llama_model):
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    plain = batch_generate(llama_model, Tokenizer(), prompts, max_tokens=6).texts
    vq.make_prompt_cache(llama_model, "kivi")  # installs the hook; BatchKVCache falls through it
    assert vq.runtime.installed(llama_model)
    assert batch_generate(llama_model, Tokenizer(), prompts, max_tokens=6).texts == plain


@pytest.mark.parametrize("recipe", RECIPES)
def test_server_prompt_cache_reuse(llama_model, recipe):
    sets = SMALL.get(recipe, [])
    tokens = TOKENS[0].tolist()
    caches = vq.make_prompt_cache(llama_model, recipe, sets)
    feed(llama_model, TOKENS[:, :150], caches, 50)
    twin = copy.deepcopy(caches)  # what continuing the original would give
    lru = LRUPromptCache(max_size=4)
    lru.insert_cache("m", tokens[:150], caches)
    assert lru.nbytes == sum(c.nbytes for c in caches)
    # A longer prompt: the cached one is a prefix, reused through a deep copy.
    reused, rest = lru.fetch_nearest_cache("m", tokens[:160])
    assert rest == tokens[150:160]
    a = llama_model(mx.array([rest]), cache=reused)
    b = llama_model(mx.array([rest]), cache=twin)
    assert mx.array_equal(a, b)
    # A prompt that parts from the cached one at 140: reused trimmed, or not at all where it cannot trim.
    other = tokens[:140] + [3, 1, 4, 1, 5]
    reused, rest = lru.fetch_nearest_cache("m", other)
    if reused is None:
        assert not any(c.is_trimmable() for c in caches) or rest == other
        return
    assert {c.offset for c in reused} == {len(other) - len(rest)} and rest == other[140:]
    fresh = vq.make_prompt_cache(llama_model, recipe, sets)
    feed(llama_model, TOKENS[:, :140], fresh, 50)
    got = llama_model(mx.array([rest]), cache=reused)
    want = llama_model(mx.array([rest]), cache=fresh)
    # Measured 0.0 for fp16, kivi, kivi_sink, snapkv, turboquant_rvq; cachegen 0.029: trimming settles
    # first, so which tokens sit in its fp16 window and which are 4-bit codes differs from a fresh cache.
    assert float(mx.abs(got - want).max()) < 5e-2
