"""salient + runtime/eviction/saliency: tokens routed by ZipCache's normalized attention from real queries."""

import mlx.core as mx
import numpy as np
import pytest

import veloxquant as vq
from veloxquant.compiler import SMOLLM2_135M, ModelShape, compile_recipe
from veloxquant.errors import RecipeError
from veloxquant.recipe import load_recipe
from veloxquant.runtime.cache import TieredCache
from veloxquant.stages.salient import Salient
from veloxquant.stages.store import Affine, Fp16

from conftest import feed
from conftest import pipeline_recipe as _recipe


def test_salient_codes_the_top_scored_tokens_of_each_chunk_with_hi():
    x = mx.random.normal((1, 2, 64, 64), key=mx.random.key(0))
    scores = mx.random.uniform(shape=(1, 2, 64), key=mx.random.key(1))
    s = Salient(hi=Fp16(), lo=Affine(bits=2, group=32), fraction=0.25, chunk=32)
    enc = s.encode(x, scores)
    got = s.decode(enc, mx.float32)
    exact = np.isclose(np.array(got), np.array(x.astype(mx.float16).astype(mx.float32))).all(axis=-1)
    top = np.argsort(-np.array(scores).reshape(1, 2, 2, 32), axis=-1)[..., :8]
    want = np.zeros((1, 2, 2, 32), bool)
    np.put_along_axis(want, top, True, axis=-1)
    assert (exact.reshape(1, 2, 2, 32) == want).all()  # exactly the 8 top-scored tokens per chunk came back exact
    assert enc["mask"].shape == (1, 2, 2, 1) and enc["hi.x"].shape == (1, 2, 2, 8 * 64)


def test_the_score_is_attention_received_over_queries_that_could_see_the_token(tmp_path, llama_model):
    vq.install(llama_model)  # scored caches refuse steps while no attention is routed; this test calls attend itself
    recipe = _recipe(tmp_path, "recent(32)\n>> salient(hi=fp16, lo=affine(bits=2, group=16), fraction=0.25, chunk=32)")
    shape = ModelShape.uniform("t", 1, 2, 16)
    cache = TieredCache(compile_recipe(recipe, shape).layers[0])
    rng = np.random.default_rng(0)
    k, v = (mx.array(rng.normal(size=(1, 2, 48, 16)).astype(np.float32)) for _ in range(2))
    q = mx.array(rng.normal(size=(1, 4, 48, 16)).astype(np.float32))
    cache.update_and_fetch(k, v)
    cache.attend(q, scale=0.25)
    k16 = np.array(k.astype(mx.float16)).astype(np.float32)  # the window holds float16 keys
    logits = np.einsum("bhrqd,bhkd->bhrqk", np.array(q).reshape(1, 2, 2, 48, 16), k16) * 0.25
    logits = np.where(np.tril(np.ones((48, 48), bool)), logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = p.sum(axis=(2, 3)) / (48 - np.arange(48))  # query i sees keys 0..i
    got = cache.saliency.take(0, 32)
    assert np.allclose(np.array(got), want[..., :32], rtol=1e-4, atol=1e-6)
    assert cache.tiers[1].side_state["received"].shape == (1, 2, 16)  # the 16 still waiting


def test_lossless_branches_make_routing_exact_and_state_is_counted(tmp_path, llama_model):
    tokens = mx.random.randint(0, 500, (1, 200), key=mx.random.key(2))
    lossless = _recipe(tmp_path, "sink(4)\n>> recent(32)\n>> salient(hi=identity, lo=identity, chunk=32)")
    caches = vq.make_prompt_cache(llama_model, lossless)
    got = feed(llama_model, tokens, caches, 32)
    ref = feed(llama_model, tokens, vq.make_prompt_cache(llama_model, "fp16"), 32)
    assert float(mx.abs(got - ref).max()) < 1e-3
    c = caches[0]
    c._settle()
    held = sum(b.nbytes for t in c.tiers for bufs in t.buffers.values() for b in bufs.values())
    assert c.nbytes == held + sum(a.nbytes for a in c.tiers[2].side_state.values()) > held


def test_salient_needs_the_hook_and_whole_branches(tmp_path):
    with pytest.raises(RecipeError, match="'salient' scores tokens by real attention, which needs the attention hook"):
        compile_recipe(load_recipe("zipcache"), SMOLLM2_135M, hook=False)
    with pytest.raises(RecipeError, match="its hi branch gets 8 tokens of each chunk, not whole groups of 16") as e:
        compile_recipe(
            _recipe(tmp_path, "recent(32)\n>> salient(hi=affine(bits=4, group=16, axis=channel), lo=fp16, chunk=32)"),
            SMOLLM2_135M,
        )
    assert "r.yaml:5:6" in str(e.value.location)
    with pytest.raises(RecipeError, match="chunk=48 is not a multiple of 32"):
        compile_recipe(_recipe(tmp_path, "recent(48)\n>> salient(hi=fp16, lo=fp16, chunk=48)"), SMOLLM2_135M)
