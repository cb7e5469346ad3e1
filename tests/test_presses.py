"""kvpress's LagKV (score=lagkv) and ThinK (the `think` store): formulas against NumPy models of
kvpress's code, properties that follow from them, and the recipes on the tiny Llama."""

import mlx.core as mx
import numpy as np
import pytest

import veloxquant as vq
from veloxquant.runtime.eviction.scorers.lag import LagKV
from veloxquant.runtime.persist import load_prompt_cache, save_prompt_cache
from veloxquant.stages.evict import Evict
from veloxquant.stages.think import Think

from conftest import feed

TOKENS = mx.random.randint(0, 500, (1, 600), key=mx.random.key(3))


# --- LagKV --------------------------------------------------------------------------
class Held:
    """What the scorer reads of a tier: its keys and values."""

    def __init__(self, k, v):
        self.k, self.v = mx.array(k), mx.array(v)

    def decoded(self, dtype):
        return self.k.astype(dtype), self.v.astype(dtype)


def lag_priority(k, v, sinks=4, lag=8):
    return np.array(
        LagKV(Evict(budget=64, sinks=sinks, score="lagkv", chunk=lag, once=True)).priority(Held(k, v), k.shape[2], None)
    )


def kvpress_lagkv(k, v, sinks, lag):
    """LagKVPress.score (cross_scoring=False) in NumPy float64."""
    B, H, L, D = k.shape
    end = sinks + (L - sinks) // lag * lag

    def states(x):
        p = x[:, :, sinks:end].reshape(B, H, -1, lag, D)
        ref, cur = p[:, :, 1:], p[:, :, :-1]
        lo, hi = ref.min(axis=3, keepdims=True), ref.max(axis=3, keepdims=True)
        s = ((cur - lo) / (hi - lo)).std(axis=-1, ddof=1)
        e = np.exp(s - s.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    score = (states(k.astype(np.float64)) + states(v.astype(np.float64))) / 2
    score = score.argsort(-1).argsort(-1) / lag
    return np.concatenate([np.ones((B, H, sinks)), score.reshape(B, H, -1), np.ones((B, H, L - end + lag))], -1)


def kv(seed, L=61, H=2, D=16):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((1, H, L, D)) * np.exp(rng.standard_normal((1, H, L, 1)))).astype(
        np.float32
    ), rng.standard_normal((1, H, L, D)).astype(np.float32)


def test_lagkv_scores_are_kvpress_formula():
    k, v = kv(0)
    np.testing.assert_allclose(lag_priority(k, v), kvpress_lagkv(k, v, 4, 8), atol=1e-6)


def test_lagkv_ignores_a_positive_affine_map_of_each_channel():
    k, v = kv(1)
    rng = np.random.default_rng(2)
    a, b = np.exp(rng.standard_normal(16)).astype(np.float32), rng.standard_normal(16).astype(np.float32) * 5
    np.testing.assert_array_equal(lag_priority(k, v), lag_priority(k * a + b, v * a[::-1] - b))


def test_a_partition_is_scored_against_the_next_one_only():
    k, v = kv(3)
    base = lag_priority(k, v)
    k2 = k.copy()
    k2[:, :, 4 + 16 : 4 + 24] *= np.linspace(0.1, 9, 16, dtype=np.float32)  # partition 2 (its range) changes
    moved = lag_priority(k2, v)
    np.testing.assert_array_equal(moved[..., : 4 + 8], base[..., : 4 + 8])  # sinks and partition 0
    assert not np.array_equal(moved[..., 4 + 8 : 4 + 16], base[..., 4 + 8 : 4 + 16])  # partition 1 reads 2's range


def test_lagkv_ranks_within_each_partition_and_keeps_sinks_and_tail():
    k, v = kv(4)
    p = lag_priority(k, v)
    assert (p[..., :4] == 1).all() and (p[..., 4 + 48 :] == 1).all()  # 6 partitions of 8 scored: 5, tail 8 + 9
    ranks = np.sort(p[..., 4 : 4 + 40].reshape(1, 2, 5, 8), axis=-1) * 8
    np.testing.assert_array_equal(ranks, np.broadcast_to(np.arange(8), ranks.shape))
    short = lag_priority(k[:, :, :19], v[:, :, :19])  # fewer than sinks + 2 partitions: the newest first
    assert (np.diff(short[..., 4:]) > 0).all()


def test_lagkv_recipe_keeps_the_budget_with_every_partition_equal(llama_model):
    caches = vq.make_prompt_cache(llama_model, "lagkv", ["budget=196", "lag=64"])
    feed(llama_model, TOKENS[:, :580], caches, 256)
    caches[0].finish_prompt()
    pos = np.array(caches[0].tiers[0].positions)[0]  # [H, budget]
    assert pos.shape == (3, 196)
    assert (pos[:, :4] == np.arange(4)).all() and (pos[:, -64:] == np.arange(580 - 64, 580)).all()  # sinks, tail
    per_part = np.stack([((pos >= 4 + 64 * i) & (pos < 68 + 64 * i)).sum(1) for i in range(8)])
    assert (per_part == 16).all()  # (196 - 4 - 64) / 8 scored partitions: the top 16 ranks of each


# --- ThinK --------------------------------------------------------------------------
def keys_by_channel(D=16, L=64, H=2):
    """Keys of random signs whose channel c has magnitude 1.1^c: the loud channels are the last ones."""
    signs = np.sign(np.random.default_rng(1).standard_normal((1, H, L, D)))
    return mx.array(signs * 1.1 ** np.arange(D), dtype=mx.float16)


def kept(fitted):
    return np.array(fitted["basis"])  # [H, r]: the kept channels


def test_think_keeps_the_channels_of_largest_query_weighted_magnitude():
    x = keys_by_channel()
    store = Think(ratio=0.75)
    assert kept(store.fit(x)).tolist() == [[12, 13, 14, 15]] * 2  # keys alone: the loudest
    energy = np.ones((2, 16), np.float32)
    energy[0, :3] = 1e4  # head 0's queries look along the quietest channels
    got = kept(store.fit(x, mx.array(energy)))
    assert got[0].tolist() == [0, 1, 2, 15] and got[1].tolist() == [12, 13, 14, 15]
    assert np.array(store.fit(x)["widths"]).tolist() == [16] * 4 and Think(ratio=0.5).fit(x)["basis"].shape == (2, 8)


def think_side(model, sets=()):
    caches = vq.make_prompt_cache(model, "think", list(sets))
    return caches, caches[0].tiers[-1].sides["k"]


def test_think_counts_only_the_last_window_of_queries(llama_model):
    _, side = think_side(llama_model, ["ratio=0.5", "window=8"])
    D, G = 64, 3
    side.append(keys_by_channel(D=D, L=64, H=3))
    loud, late = np.zeros(D, np.float32), np.zeros(D, np.float32)
    loud[:32], late[:16] = 1e3, 1.0  # early queries: far louder, on channels 0..31; the last 8: channels 0..15
    side.observe(mx.broadcast_to(mx.array(loud), (1, 3, G * 40, D)), 40)
    side.observe(mx.broadcast_to(mx.array(late), (1, 3, G * 8, D)), 8)
    assert side.query_window.shape == (1, 3, G, 8, D) and "qwindow" in side.arrays()
    side.finish_prompt()
    got = kept(side.fitted)
    assert (got[:, :16] == np.arange(16)).all()  # the late queries' channels, whatever their keys
    assert side.query_window is None and "qwindow" not in side.arrays()


def test_think_at_ratio_zero_holds_the_keys_and_scores_them_bit_for_bit(llama_model):
    _, side = think_side(llama_model, ["ratio=0"])
    x = keys_by_channel(D=64, L=96, H=3)
    side.append(x)
    side.finish_prompt()
    assert np.array_equal(np.array(side.decoded(mx.float16)), np.array(x))
    q = mx.random.normal((1, 3, 5, 64), key=mx.random.key(2))
    assert np.array_equal(np.array(side.scores(q)), np.array(q @ x.astype(mx.float32).swapaxes(-1, -2)))


def test_think_scores_are_exact_for_queries_on_the_kept_channels(llama_model):
    _, side = think_side(llama_model, ["ratio=0.75"])
    x = keys_by_channel(D=64, L=96, H=3)
    side.append(x)
    side.finish_prompt()
    mask = np.zeros((3, 1, 64), np.float32)
    mask[np.arange(3)[:, None], 0, kept(side.fitted)] = 1
    q = mx.random.normal((1, 3, 5, 64), key=mx.random.key(2)) * mx.array(mask)
    k = x.astype(mx.float32).swapaxes(-1, -2)
    # exact up to float32 summation order (the kept 16 channels vs all 64): the standard bound of a
    # float32 dot product, n * eps * sum |q_i k_i| (BLAS kernels sum in different orders)
    bound = 64 * np.finfo(np.float32).eps * np.array(mx.abs(q) @ mx.abs(k))
    assert (np.abs(np.array(side.scores(q)) - np.array(q @ k)) <= bound).all()
    assert side.latents().shape == (1, 3, 96, 16)  # only the kept channels are held


def prefilled(model, name, sets=()):
    caches = vq.make_prompt_cache(model, name, list(sets))
    feed(model, TOKENS[:, :512], caches, 256)
    for c in caches:
        c.finish_prompt()
    return caches


def held(caches):
    return sum(c.nbytes for c in caches)


@pytest.mark.parametrize("name,sets,kept", [("think", [], 32), ("think", ["ratio=0.75"], 16), ("think_kivi", [], 32)])
def test_think_recipes_hold_only_the_kept_channels(llama_model, tmp_path, name, sets, kept):
    caches = prefilled(llama_model, name, sets)
    tier = caches[0].tiers[-1]
    arrays = tier.arrays()
    host = sum(c.tiers[-1].sides["k"].widths.nbytes for c in caches)  # the kept widths, on the host too
    assert held(caches) == sum(a.nbytes for c in caches for t in c.tiers for a in t.arrays().values()) + host
    assert arrays["k.basis"].shape == (3, kept) and arrays["k.basis"].dtype == mx.uint8
    codes = [a for n, a in arrays.items() if n in ("k.f16", "k.c2.codes")][0]
    bits = 16 if name == "think" else 2
    assert codes.nbytes * 8 == tier.count * 3 * kept * bits  # [B, H, groups, kept x 32 tokens]
    assert held(caches) < held(prefilled(llama_model, "fp16"))
    path = str(tmp_path / "c.safetensors")
    save_prompt_cache(path, caches)
    step = TOKENS[:, 512:513]
    np.testing.assert_array_equal(
        np.array(llama_model(step, cache=caches)),
        np.array(llama_model(step, cache=load_prompt_cache(path, model=llama_model)[0])),
    )


def test_pruning_kivis_keys_holds_fewer_bytes_than_kivi(llama_model):
    assert held(prefilled(llama_model, "think_kivi")) < held(prefilled(llama_model, "kivi"))


def test_think_at_ratio_zero_gives_fp16s_logits(llama_model):
    ref = feed(llama_model, TOKENS[:, :400], vq.make_prompt_cache(llama_model, "fp16"), 128)
    got = feed(llama_model, TOKENS[:, :400], vq.make_prompt_cache(llama_model, "think", ["ratio=0"]), 128)
    np.testing.assert_allclose(np.array(got), np.array(ref), atol=1e-4)
