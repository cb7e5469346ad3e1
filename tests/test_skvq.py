"""skvq: range-sorted channels (order frozen from the first chunk), clip searched per group."""

import mlx.core as mx
import numpy as np
import pytest

import veloxquant as vq
from veloxquant.compiler import SMOLLM2_135M, compile_recipe
from veloxquant.errors import RecipeError
from veloxquant.recipe import load_recipe
from veloxquant.stages.skvq import Skvq
from veloxquant.stages.store import Affine

from conftest import feed


def _x(seed=0):
    spread = mx.exp(1.5 * mx.random.normal((1, 3, 1, 64), key=mx.random.key(seed + 1)))
    return mx.random.normal((1, 3, 64, 64), key=mx.random.key(seed)) * spread


def _err(s, x, weights=None):
    f = s.fit(x)
    return float(mx.mean((s.decode(s.encode(x, f, weights), mx.float32, f) - x) ** 2)), f


def test_no_reorder_and_no_clip_is_per_token_affine_bit_for_bit():
    x = _x()
    s = Skvq(bits=2, group=32, clips="1.0", reorder=False)
    f = s.fit(x)
    enc, ref = s.encode(x, f), Affine(bits=2, group=32, axis="token").encode(x)
    for name in ("codes", "scales", "zeros"):
        assert mx.array_equal(enc[name], ref[name]), name


def test_reordering_and_clipping_each_cut_the_error():
    x = _x(1)
    plain, _ = _err(Skvq(clips="1.0", reorder=False), x)
    sorted_only, f = _err(Skvq(clips="1.0"), x)
    both, _ = _err(Skvq(), x)
    assert both < sorted_only and both < plain  # (sorting alone is not always better: measured, not assumed)
    order = np.array(f["order"])
    spread = np.array(mx.max(x[:, :, :32], axis=2) - mx.min(x[:, :, :32], axis=2))
    assert f["order"].dtype == mx.uint16 and (np.diff(np.take_along_axis(spread, order, -1), axis=-1) >= 0).all()


def test_query_weighted_clip_cuts_the_score_error_it_targets():
    x = _x(2)
    w = mx.exp(2 * mx.random.normal((1, 3, 64), key=mx.random.key(5)))  # uneven mean q^2 per channel
    s = Skvq(weight="queries")
    f = s.fit(x)
    score_err = lambda enc: float(mx.sum(w[:, :, None] * (s.decode(enc, mx.float32, f) - x) ** 2))
    assert score_err(s.encode(x, f, w)) <= score_err(s.encode(x, f))


def test_one_block_prefill_equals_token_by_token(llama_model):
    tokens = mx.random.randint(0, 500, (1, 224), key=mx.random.key(3))
    a = vq.make_prompt_cache(llama_model, "skvq", ["weight=none"])
    b = vq.make_prompt_cache(llama_model, "skvq", ["weight=none"])
    feed(llama_model, tokens, a, 224)
    feed(llama_model, tokens, b, 1)
    for ca, cb in zip(a[:1], b[:1]):  # layer 0 sees the same K/V either way
        ca._settle(), cb._settle()
        assert ca.tiers[2].count == cb.tiers[2].count == 96  # 219 after the sinks: 3 chunks left the window
        for name, arr in ca.tiers[2].arrays().items():
            assert mx.array_equal(arr, cb.tiers[2].arrays()[name]), name


def test_skvq_bytes_and_save_load(tmp_path, llama_model):
    tokens = mx.random.randint(0, 500, (1, 300), key=mx.random.key(4))
    caches = vq.make_prompt_cache(llama_model, "skvq")
    feed(llama_model, tokens[:, :280], caches, 64)
    c = caches[0]
    c._settle()
    assert {"k.fit.order", "v.fit.order", "state.q2"} <= set(c.tiers[2].arrays())
    assert c.nbytes == sum(t.nbytes for t in c.tiers)
    path = tmp_path / "c.safetensors"
    vq.save_prompt_cache(str(path), caches)
    loaded, _ = vq.load_prompt_cache(str(path), expect_fingerprint=c.fingerprint)
    assert mx.array_equal(feed(llama_model, tokens[:, 280:], caches, 4), feed(llama_model, tokens[:, 280:], loaded, 4))


def test_skvq_misuse_is_located(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text('veloxquant: 1\nname: r\npipeline: |\n  recent(32)\n  >> skvq(clips="1.0,1.5")\n')
    with pytest.raises(RecipeError, match=r"'clips' must list clip factors in \(0, 1\]") as e:
        compile_recipe(load_recipe(str(path)), SMOLLM2_135M)
    assert "r.yaml:5:17" in str(e.value.location)  # at the value
    path.write_text("veloxquant: 1\nname: r\npipeline: |\n  recent(32)\n  >> skvq(group=48)\n")
    with pytest.raises(RecipeError, match="group=48 does not divide head_dim 64"):
        compile_recipe(load_recipe(str(path)), SMOLLM2_135M)
