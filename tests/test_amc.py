"""AMC: tokens routed by L1 saliency into three latent tiers of falling rank and precision."""

import mlx.core as mx
import numpy as np
import pytest

import veloxquant as vq
from veloxquant.kernels.partials import partial_attention
from veloxquant.runtime.kinds.amc_side import AmcSide
from veloxquant.runtime.persist import load_prompt_cache, save_prompt_cache
from veloxquant.stages.amc import Amc

from conftest import feed, tiny_gemma3, tiny_llama

TOKENS = mx.random.randint(0, 500, (1, 200), key=mx.random.key(5))


def prompt(model, sets=()):
    caches = vq.make_prompt_cache(model, "amc", ["window=32", *sets])
    model(TOKENS[:, :150], cache=caches)
    for c in caches:
        c.finish_prompt()
    return caches


def test_routing_splits_the_prompt_by_saliency_shares():
    x = mx.random.normal((1, 3, 200, 64), key=mx.random.key(1)) * mx.random.uniform(shape=(1, 1, 200, 1))
    store = Amc()
    tier = np.array(store.route(x, store.thresholds(x)))
    assert [int((tier == t).sum()) for t in range(3)] == [40, 60, 100]
    s = np.array(store.saliency(x))
    assert s[tier == 0].min() > s[tier == 1].max() and s[tier == 1].min() > s[tier == 2].max()
    assert store.tiers(64) == (("high", 64, 16), ("mid", 24, 8), ("low", 8, 4))  # ranks fill whole words
    assert store.tiers(128) == (("high", 128, 16), ("mid", 44, 8), ("low", 8, 4))


def test_partial_equals_attention_over_the_rebuilt_kv():
    model = tiny_llama()
    caches = prompt(model)
    tier = caches[0].tiers[1]
    assert isinstance(tier.sides["k"], AmcSide) and tier.sides["k"].staged.view() is None  # no fp16 copy
    q = mx.random.normal((1, 9, 3, 64), key=mx.random.key(2))
    mask = mx.random.uniform(shape=(3, tier.count), key=mx.random.key(3)) > 0.3
    for m in (None, mask):
        out, lse = tier.partial(q, 0.125, m)
        ref, ref_lse = partial_attention(q, *tier.decoded(mx.float32), 0.125, m)
        assert float(mx.abs(out - ref).max()) < 1e-4 and float(mx.abs(lse - ref_lse).max()) < 1e-4


def test_high_only_is_fp16_up_to_the_basis_rounding():
    model = tiny_llama()
    ref = feed(model, TOKENS, vq.make_prompt_cache(model, "fp16"), 50)
    caches = vq.make_prompt_cache(model, "amc", ["window=32", "k_high=1", "k_mid=0"])
    out = feed(model, TOKENS, caches, 50)
    assert float(mx.abs(out - ref).max()) < 0.05  # float16 latents on a float16 basis, no truncation


def test_bytes_are_the_tiers_arrays_and_lower_tiers_hold_fewer():
    model = tiny_llama()
    side = prompt(model)[0].tiers[1].sides["k"]
    arrays = side.arrays()
    host = side.widths.nbytes + side._at.nbytes  # the widths and each token's tier id, on the host too
    assert side.nbytes == sum(a.nbytes for a in arrays.values()) + host and side._at.nbytes == side._at.size
    at = np.array(arrays["tier"]).ravel()
    assert arrays["high.f16"].shape[2] == (at == 0).sum() and arrays["low.codes"].shape[2] == (at == 2).sum()
    per_token = {
        name: sum(a[0, 0, 0].nbytes for n, a in arrays.items() if n.startswith(name + "."))
        for name in ("high", "mid", "low")
    }
    assert per_token["high"] > per_token["mid"] > per_token["low"]


def test_decode_never_rebuilds_kv(monkeypatch):
    model = tiny_llama()
    caches = prompt(model)
    monkeypatch.setattr(AmcSide, "decoded", lambda *a: (_ for _ in ()).throw(AssertionError("rebuilt")))
    feed(model, TOKENS[:, 150:160], caches, 1)


def test_saved_cache_continues_identically(tmp_path):
    model = tiny_llama()
    caches = prompt(model)
    save_prompt_cache(tmp_path / "a.safetensors", caches)
    loaded, _ = load_prompt_cache(tmp_path / "a.safetensors", expect_fingerprint=caches[0].fingerprint)
    a = feed(model, TOKENS[:, 150:], caches, 1)
    b = feed(model, TOKENS[:, 150:], loaded, 1)
    assert float(mx.abs(a - b).max()) == 0.0


def test_sliding_window_layers_forget_old_tokens_of_every_tier():
    model = tiny_gemma3(window=64)
    caches = vq.make_prompt_cache(model, "amc", ["window=16"])
    out = feed(model, TOKENS, caches, 50)
    out = feed(model, TOKENS[:, :40], caches, 1)  # decode: the prompt is over, old tokens expire
    assert not bool(mx.isnan(out).any())
    sliding = caches[0].tiers[1]
    side = sliding.sides["k"]
    assert sliding.count < 200 - 16 and side.buffers["tier"].used == sliding.count
    q = mx.random.normal((1, 2, 1, 64), key=mx.random.key(2))
    out, lse = sliding.partial(q, 0.125)
    ref, ref_lse = partial_attention(q, *sliding.decoded(mx.float32), 0.125)
    assert float(mx.abs(out - ref).max()) < 1e-4


def test_shares_above_one_are_a_clear_error():
    with pytest.raises(Exception, match="exceeds 1"):
        vq.make_prompt_cache(tiny_llama(), "amc", ["k_high=0.7", "k_mid=0.5"])


def test_nbytes_counts_the_position_order_an_attention_leaves_held():
    from test_chunk_invariance import reachable_bytes

    model = tiny_llama()
    caches = prompt(model)
    q = mx.random.normal((1, 9, 1, 64), key=mx.random.key(2))
    for c in caches:
        mx.eval(c.tiers[1].partial(q, 0.125, None))  # scores and combine build the tiers' position order
    side = caches[0].tiers[1].sides["k"]
    order = 2 * 4 * len(side._at)  # two int32 per token the side holds
    host = side.widths.nbytes + side._at.nbytes
    assert side._order is not None and side.nbytes == sum(a.nbytes for a in side.arrays().values()) + order + host
    assert reachable_bytes(caches) == sum(c.nbytes for c in caches)
