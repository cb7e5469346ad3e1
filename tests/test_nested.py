"""NestedKV's key anomaly scores (three scales, head-adaptive blend, surprise gate) and its
head-wise budget competition held in ragged per-head tiers."""

import mlx.core as mx
import numpy as np

import veloxquant
from veloxquant.runtime.eviction.scorers.nested import PRIOR, route, scales

from conftest import pipeline_recipe, tiny_llama


def keys(seed=0, n=300, d=16):
    rng = np.random.default_rng(seed)
    base = rng.standard_normal(d)
    k = base + 0.1 * rng.standard_normal((1, 2, n, d))
    return k.astype(np.float32), rng


def test_each_scale_is_min_max_normalised_and_finds_its_outlier():
    k, rng = keys()
    k[0, 0, 200] = -k[0, 0, 200]  # a global outlier in head 0
    a = np.array(scales(mx.array(k), 64))
    assert a.shape == (3, 1, 2, 300)
    assert np.allclose(a.min(-1), 0) and np.allclose(a.max(-1), 1, atol=1e-5)
    assert a[0, 0, 0].argmax() == 200


def test_current_scale_compares_a_key_with_its_trailing_window():
    k, _ = keys(n=200)
    k[0, :, 150:] = -k[0, :, 150:]  # the keys change regime at 150: new to the window, not to the last 50
    cur = np.array(scales(mx.array(k), 32))[2, 0, 0]
    assert cur[150:160].mean() > cur[190:].mean()


def test_blend_without_temperature_or_gate_is_the_prior():
    a = mx.random.uniform(shape=(3, 1, 2, 50), key=mx.random.key(1))
    got = route(a, beta=0.0, tau=1e3, kappa=10.0)  # gate ~ sigmoid(-1e4) = 0
    want = sum(p * a[i] for i, p in enumerate(PRIOR)) / sum(PRIOR)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-6)


def test_gate_sends_disagreeing_tokens_to_their_strongest_scale():
    a = mx.array(np.full((3, 1, 1, 40), 0.5, np.float32))
    a[:, 0, 0, 7] = mx.array([1.0, 0.0, 0.0])
    got = np.array(route(a, beta=0.0, tau=0.6, kappa=10.0))
    assert got[0, 0, 7] > 0.95  # the max, not the blend (0.4)


def test_nestedkv_heads_compete_and_hold_ragged_budgets(tmp_path):
    model = tiny_llama(layers=2)
    recipe = pipeline_recipe(
        tmp_path, "evict(budget=24, sinks=2, score=nested, once=true, window=16, tau=0.6, heads=score, alpha=0.2)"
    )
    caches = veloxquant.make_prompt_cache(model, recipe)
    toks = mx.array(np.random.default_rng(2).integers(0, 500, (1, 100)))
    model(toks[:, :99], cache=caches)
    out = model(toks[:, 99:], cache=caches)
    assert bool(mx.all(mx.isfinite(out)).item())
    for cache, heads in zip(caches, caches[0].coordinator.budgets["heads"]):
        assert sum(heads) == 3 * 24 and min(heads) >= int(0.2 * 24)
        assert cache.tiers[0].lengths() == [b + 1 for b in heads]  # the last prompt token appended
    assert any(c.tiers[0].ragged is not None for c in caches)
