"""CaM: evicted values merged into survivors (runtime/eviction/merging.py), as an evict option."""

import mlx.core as mx
import numpy as np
import pytest

import veloxquant
from veloxquant.errors import RecipeError
from veloxquant.runtime.eviction.merging import merged_values

from conftest import pipeline_recipe, tiny_llama


def test_each_evicted_value_lands_on_its_most_similar_survivors_with_its_prominence():
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((1, 1, 6, 8)).astype(np.float32)
    keys[0, 0, 4] = keys[0, 0, 1] + 0.01  # token 4 looks like survivor 1
    keys[0, 0, 5] = keys[0, 0, 2] + 0.01  # token 5 looks like survivor 2
    values = rng.standard_normal((1, 1, 6, 8)).astype(np.float32)
    scores = np.array([[[4.0, 2.0, 2.0, 2.0, 1.0, 0.0]]], np.float32)
    kept, gone = mx.array([[[0, 1, 2, 3]]]), mx.array([[[4, 5]]])
    out = np.array(merged_values(mx.array(keys), mx.array(values), mx.array(scores), kept, gone, 1, "prominence", 0))
    want = values[0, 0, :4].copy()
    want[1] = (want[1] + values[0, 0, 4] * 0.5) / 1.5  # p = A_4 / A_1 = 1/2, one target: a weighted average
    # token 5 received no attention: p = 0, nothing merged
    np.testing.assert_allclose(out[0, 0], want, atol=1e-6)


def test_several_targets_share_the_merge_as_weighted_averages():
    rng = np.random.default_rng(1)
    keys, values = (mx.array(rng.standard_normal((2, 3, 40, 16)).astype(np.float32)) for _ in range(2))
    scores = mx.array(rng.random((2, 3, 40)).astype(np.float32))
    order = mx.argsort(-scores, axis=-1)
    kept, gone = mx.sort(order[..., :24], axis=-1), order[..., 24:]
    out = np.array(merged_values(keys, values, scores, kept, gone, 4, "prominence", 0))
    before = np.array(mx.take_along_axis(values, kept[..., None], axis=2))
    a_kept = mx.take_along_axis(scores, kept, axis=2)
    a_gone = mx.take_along_axis(scores, gone, axis=2)
    assert bool(mx.all(a_gone <= mx.min(a_kept, axis=-1, keepdims=True)).item())
    assert np.abs(out - before).max() > 0
    # every merged value is a convex combination: inside the per-channel range of all values
    v = np.array(values)
    assert np.all(out <= v.max(axis=2, keepdims=True) + 1e-5) and np.all(out >= v.min(axis=2, keepdims=True) - 1e-5)


def test_blocked_similarity_gives_the_same_merge(monkeypatch):
    from veloxquant.runtime.eviction import merging

    rng = np.random.default_rng(2)
    keys, values = (mx.array(rng.standard_normal((1, 2, 50, 8)).astype(np.float32)) for _ in range(2))
    scores = mx.array(rng.random((1, 2, 50)).astype(np.float32))
    kept, gone = mx.broadcast_to(mx.arange(10), (1, 2, 10)), mx.broadcast_to(mx.arange(10, 50), (1, 2, 40))
    whole = merged_values(keys, values, scores, kept, gone, 3, "prominence", 0)
    monkeypatch.setattr(merging, "BLOCK", 7)
    assert mx.allclose(whole, merged_values(keys, values, scores, kept, gone, 3, "prominence", 0)).item()


def run(model, tmp_path, pipeline, name, n=80):
    caches = veloxquant.make_prompt_cache(model, pipeline_recipe(tmp_path, pipeline, name))
    toks = mx.array(np.random.default_rng(4).integers(0, 500, (1, n)))
    outs = [model(toks[:, : n - 8], cache=caches)[:, -1]] + [
        model(toks[:, i : i + 1], cache=caches)[:, -1] for i in range(n - 8, n)
    ]
    veloxquant.uninstall(model)
    return caches, mx.stack(outs, axis=1)


def test_merge_drop_is_h2o_bit_for_bit_and_merging_holds_the_same_bytes(tmp_path):
    model = tiny_llama(layers=2)
    h2o, want = run(model, tmp_path, "evict(budget=32, sinks=2)", "h2o")
    drop, got = run(model, tmp_path, "evict(budget=32, sinks=2, merge=drop, targets=3)", "drop")
    assert mx.array_equal(want, got).item()
    cam, merged = run(model, tmp_path, "evict(budget=32, sinks=2, merge=prominence, targets=3)", "cam")
    assert not mx.array_equal(want, merged).item()  # the merge changes what later queries read
    for a, b, c in zip(h2o, drop, cam):
        assert mx.array_equal(a.tiers[0].positions, b.tiers[0].positions).item()
        assert mx.array_equal(a.tiers[0].positions, c.tiers[0].positions).item()  # same choice, merged values
        assert a.nbytes == c.nbytes
    sampled, out = run(model, tmp_path, "evict(budget=32, sinks=2, merge=sample, targets=3)", "sample")
    assert bool(mx.all(mx.isfinite(out)).item())


def test_merge_into_ragged_heads_is_refused(tmp_path):
    with pytest.raises(RecipeError, match="merge=prominence needs heads=equal"):
        veloxquant.make_prompt_cache(
            tiny_llama(layers=1), pipeline_recipe(tmp_path, "evict(budget=32, merge=prominence, heads=adakv)", "bad")
        )


def test_many_merges_into_one_survivor_stay_in_the_hull_of_the_merged_values():
    # the H200 4k failure: 3/4 of a long prompt folded into the survivors; an additive fold
    # (v += p v_e / m) grows a survivor's value without bound. A convex fold stays inside the
    # hull of the values merged into it, whatever the number of merges.
    rng = np.random.default_rng(5)
    n = 2000
    direction = rng.standard_normal(8).astype(np.float32)
    keys = (direction + 0.01 * rng.standard_normal((1, 1, n, 8))).astype(np.float32)  # all alike survivor 0
    keys[0, 0, 1] = -direction  # survivor 1 looks like nobody
    values = rng.uniform(-1, 1, (1, 1, n, 8)).astype(np.float32)
    scores = np.ones((1, 1, n), np.float32)  # every evicted token as prominent as its target: p = 1
    kept, gone = mx.array([[[0, 1]]]), mx.array([[list(range(2, n))]])
    out = np.array(merged_values(mx.array(keys), mx.array(values), mx.array(scores), kept, gone, 1, "prominence", 0))
    merged_into_0 = np.concatenate([values[0, 0, :1], values[0, 0, 2:]])
    assert np.all(out[0, 0, 0] <= merged_into_0.max(axis=0) + 1e-5)
    assert np.all(out[0, 0, 0] >= merged_into_0.min(axis=0) - 1e-5)
    # p = 1 for all: survivor 0 becomes the plain mean of itself and everything merged into it
    np.testing.assert_allclose(out[0, 0, 0], merged_into_0.mean(axis=0), atol=1e-4)
    np.testing.assert_array_equal(out[0, 0, 1], values[0, 0, 1])  # nothing merged into survivor 1
