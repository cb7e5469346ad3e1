"""Bounded recipes hold flat bytes over a long generation (nbytes: the arrays really held).
Speed is measured by python -m veloxquant.bench.long_generation, not here."""

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

import veloxquant as vq

BOUNDED = {"streaming_llm": ["window=64"], "h2o": ["budget=64"], "tova": ["budget=64"], "snapkv": ["budget=64"]}


@pytest.mark.parametrize("recipe", sorted(BOUNDED))
def test_bounded_recipes_hold_flat_bytes(llama_model, recipe):
    caches = vq.make_prompt_cache(llama_model, recipe, BOUNDED[recipe])
    prompt = mx.random.randint(0, 500, (100,), key=mx.random.key(2))
    held = {}
    for n, _ in enumerate(generate_step(prompt, llama_model, prompt_cache=caches, max_tokens=600), 1):
        if n in (200, 400, 600):
            held[n] = sum(c.nbytes for c in caches)
    # snapkv keeps its prompt budget and appends decode tokens (unbounded by design), growing in
    # 256-token steps of fp16 K/V plus int32 positions and float32 scores; the others stay flat.
    if recipe == "snapkv":
        per_token = len(caches) * 3 * (2 * 64 * 2 + 4 + 4)
        assert 0 < held[600] - held[200] <= (400 + 256) * per_token
    else:
        assert held[200] == held[400] == held[600]
