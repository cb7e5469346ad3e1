"""RocketKV: SnapKV once, then per decode step exact attention over the survivors the query picks.

Stage 2 is checked against a NumPy model of Hybrid Sparse Attention written
here (page max/min bounds on the query's top channels, then partial dot
products), and reduces to SnapKV with tokens=0 or with every survivor picked."""

import mlx.core as mx
import numpy as np
import pytest

import veloxquant
from veloxquant.errors import RecipeError
from veloxquant.runtime.persist import load_prompt_cache, save_prompt_cache

from conftest import feed, tiny_gemma3
from test_evict import HKV, HQ, SCALE, blocks, layer_cache, recipe

ROCKET = "rocket(budget=48, window=4, pool=3, tokens={tokens}, page=8, channels=4) | identity"


def _drive(cache, sizes, seed=5):
    outs = []
    for q, k, v in blocks(seed, sizes):
        cache.update_and_fetch(mx.array(k), mx.array(v))
        outs.append(cache.attend(mx.array(q), SCALE))
    return outs


def test_tokens_zero_is_snapkv(llama_model, tmp_path):
    snap = layer_cache(llama_model, tmp_path, "snap(budget=48, window=4, pool=3) | identity")
    rocket = layer_cache(llama_model, tmp_path, ROCKET.format(tokens=0))
    for a, b in zip(_drive(snap, [70, 1, 1, 1]), _drive(rocket, [70, 1, 1, 1])):
        assert mx.array_equal(a, b).item()


def test_every_survivor_picked_is_snapkv(llama_model, tmp_path):
    """While the survivors fit the pages stage 2 reads, it attends to them all: SnapKV's output."""
    snap = layer_cache(llama_model, tmp_path, "snap(budget=48, window=4, pool=3) | identity")
    rocket = layer_cache(llama_model, tmp_path, ROCKET.format(tokens=24))  # 7 pages of 8 = 56 >= 48 + 3
    for a, b in zip(_drive(snap, [70, 1, 1, 1]), _drive(rocket, [70, 1, 1, 1])):
        np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-6)


def _reference_pick(k, pos, q, tokens, page, channels):
    """Per kv head: the positions Hybrid Sparse Attention attends to (slow NumPy)."""
    rep = HQ // HKV
    picked = []
    for h in range(HKV):
        qg = q[0, h * rep : (h + 1) * rep, 0]  # [rep, D]
        ch = np.argsort(-np.abs(qg).sum(0), kind="stable")[:channels]
        K = k[0, h]
        n_pages = -(-2 * tokens // page) + 1
        pages = [list(range(s, min(s + page, len(K)))) for s in range(0, len(K), page)]
        bound = [max(sum(max(qh[c] * K[p, c].max(), qh[c] * K[p, c].min()) for c in ch) for qh in qg) for p in pages]
        bound[-1] = np.inf
        best = np.argsort(-np.array(bound), kind="stable")[:n_pages]
        slots = [s for b in best for s in pages[b]]
        approx = {s: max(float(qh[ch] @ K[s, ch]) for qh in qg) for s in slots}
        picked.append(sorted(pos[0, h, s] for s in sorted(slots, key=lambda s: -approx[s])[:tokens]))
    return picked


def test_pick_matches_reference_and_attends_exactly(llama_model, tmp_path):
    cache = layer_cache(llama_model, tmp_path, ROCKET.format(tokens=8))
    _drive(cache, [70, 1])  # 70 prompt tokens, then the prompt ends: 48 survivors + 1
    tier = cache.tiers[0]
    assert tier.decided and tier.count == 49
    q = blocks(9, [1])[0][0]
    k, v, pos = tier.pick(mx.array(q), mx.float32)
    assert k.shape == (1, HKV, 8, k.shape[3])
    want = _reference_pick(np.array(tier.decoded(mx.float32)[0]), np.array(tier.positions), q, 8, 8, 4)
    assert [sorted(np.array(pos)[0, h].tolist()) for h in range(HKV)] == want
    # the decode step attends exactly over the picked tokens
    cache.update_and_fetch(*(mx.array(x) for x in blocks(9, [1])[0][1:]))
    tier = cache.tiers[0]
    k, v, _ = tier.pick(mx.array(q), mx.float32)
    out = np.array(cache.attend(mx.array(q), SCALE))
    rep = HQ // HKV
    for h in range(HQ):
        s = np.array(k)[0, h // rep] @ q[0, h, 0] * SCALE
        w = np.exp(s - s.max())
        np.testing.assert_allclose(out[0, h, 0], (w / w.sum()) @ np.array(v)[0, h // rep], atol=1e-5)


def test_summaries_are_held_and_current(llama_model, tmp_path):
    cache = layer_cache(llama_model, tmp_path, ROCKET.format(tokens=8))
    _drive(cache, [70, 1, 1, 1, 1, 1])
    tier = cache.tiers[0]
    keys = np.array(tier.decoded(mx.float32)[0])
    P = tier.count // 8  # full pages only: the newest, partial one always competes
    kmax, kmin = np.array(tier.summary["pages.kmax"]), np.array(tier.summary["pages.kmin"])
    assert kmax.shape[2] == P
    for p in range(P):
        np.testing.assert_array_equal(kmax[:, :, p], keys[:, :, p * 8 : (p + 1) * 8].max(axis=2))
        np.testing.assert_array_equal(kmin[:, :, p], keys[:, :, p * 8 : (p + 1) * 8].min(axis=2))
    from veloxquant.runtime.eviction.head_tier import HeadTier

    assert tier.nbytes == HeadTier.nbytes.fget(tier) + kmax.nbytes + kmin.nbytes  # summaries count in the bytes
    assert sum(a.shape == kmax.shape for a in cache.state) == 2  # and are in the state


def test_save_load_round_trip(llama_model, tmp_path):
    caches = veloxquant.make_prompt_cache(llama_model, "rocketkv", ["budget=32", "tokens=16", "window=8"])
    tokens = mx.array(np.random.default_rng(3).integers(0, 500, (1, 60)))
    feed(llama_model, tokens, caches, 16)
    for c in caches:
        c.finish_prompt()
    feed(llama_model, tokens[:, :3], caches, 1)
    save_prompt_cache(str(tmp_path / "r.safetensors"), caches)
    loaded, _ = load_prompt_cache(str(tmp_path / "r.safetensors"), model=llama_model)
    for a, b in zip(caches, loaded):
        assert all(mx.array_equal(x, y).item() for x, y in zip(a.state, b.state))
    step = tokens[:, 3:4]
    np.testing.assert_allclose(
        np.array(llama_model(step, cache=caches)), np.array(llama_model(step, cache=loaded)), atol=1e-5
    )


def test_tokens_below_a_page_is_refused(llama_model, tmp_path):
    with pytest.raises(RecipeError, match="tokens=4 must be at least one page"):
        veloxquant.make_prompt_cache(llama_model, recipe(tmp_path, "rocket(budget=64, tokens=4, page=8) | identity"))


def test_sliding_window_layers(tmp_path):
    model = tiny_gemma3(window=16)
    caches = veloxquant.make_prompt_cache(model, "rocketkv", ["budget=32", "tokens=16", "window=8"])
    tokens = mx.array(np.random.default_rng(4).integers(0, 200, (1, 50)))
    out = feed(model, tokens, caches, 1)
    assert np.isfinite(np.array(out)).all()
