"""Budgets across layers and heads (SqueezeAttention, Ada-KV), decided once by the
coordinator, and the ragged per-head storage that holds unequal heads without padding."""

import mlx.core as mx
import numpy as np
import pytest

import veloxquant
from veloxquant.runtime.eviction.allocation import adakv, squeeze
from veloxquant.runtime.eviction.ragged import PAD, Ragged, RaggedBuffer, choose, gather
from veloxquant.runtime.persist import load_prompt_cache, save_prompt_cache

from conftest import pipeline_recipe, tiny_llama

PROMPT, STEPS = 96, 6


@pytest.fixture(scope="module")
def model():
    return tiny_llama(layers=4)


def tokens(n=PROMPT + STEPS, seed=3):
    return mx.array(np.random.default_rng(seed).integers(0, 500, (1, n)))


def drive(model, caches, toks):
    """The prompt in one block, then one token at a time (the last prompt token alone, as mlx-lm does)."""
    outs = [model(toks[:, : PROMPT - 1], cache=caches)[:, -1]]
    for i in range(PROMPT - 1, toks.shape[1]):
        outs.append(model(toks[:, i : i + 1], cache=caches)[:, -1])
    return mx.stack(outs, axis=1)


def run(model, tmp_path, pipeline, name="r"):
    caches = veloxquant.make_prompt_cache(model, pipeline_recipe(tmp_path, pipeline, name))
    logits = drive(model, caches, tokens())
    veloxquant.uninstall(model)
    return caches, logits


# --- the rules --------------------------------------------------------------
def test_squeeze_strength_zero_keeps_the_bases():
    assert squeeze([448, 256, 64], [900.0, 10.0, 50.0], [0.0] * 3, [5] * 3) == [448, 256, 64]


def test_squeeze_moves_budget_to_broad_layers_and_keeps_the_total():
    out = squeeze([256] * 4, [400.0, 20.0, 100.0, 100.0], [1.0] * 4, [5] * 4)
    assert sum(out) == 4 * 256
    assert out[0] > out[2] == out[3] > out[1] >= 5
    pinned = squeeze([64] * 3, [1e6, 1.0, 1.0], [1.0] * 3, [20] * 3)
    assert pinned == [152, 20, 20]  # the floor holds, the total too


def test_adakv_tied_heads_get_equal_budgets_and_concentrated_heads_give():
    flat = mx.array(np.tile(np.linspace(1, 2, 200)[None], (3, 1)), mx.float32)
    assert adakv(flat / mx.sum(flat, -1, keepdims=True), 64, 0.2, 5) == [64, 64, 64]
    rng = np.random.default_rng(0)
    spread = rng.random(200) + 1
    peaked = np.exp(4 * rng.standard_normal(200))
    p = mx.array(np.stack([spread / spread.sum(), peaked / peaked.sum(), spread[::-1] / spread.sum()]), mx.float32)
    out = adakv(p, 64, 0.2, 5)
    assert sum(out) == 3 * 64 and min(out) >= 12
    assert out[1] < 64 < min(out[0], out[2])


def test_ragged_layout_pads_flattens_and_chooses():
    lay = Ragged([3, 1, 2])
    flat = mx.arange(6).reshape(1, 1, 6)
    padded = lay.pad(flat, fill=PAD)
    assert padded.tolist() == [[[0, 1, 2], [3, PAD, PAD], [4, 5, PAD]]]
    assert lay.flatten(padded).tolist() == flat.tolist()
    buf = RaggedBuffer(lay, flat, None, fill=PAD)
    buf.append(mx.array([[[6], [7], [8]]]))  # a decode token for every head: the shared tail
    assert buf.view().tolist() == [[[0, 1, 2, 6], [3, PAD, PAD, 7], [4, 5, PAD, 8]]]
    assert buf.nbytes == flat.nbytes + 3 * flat.itemsize
    prio = mx.array([[[5, 1, 4, 3], [0, 9, 8, 7]]], mx.float32)
    lay2, idx = choose(prio, [2, 3])
    assert lay2.lens == [2, 3]
    assert gather(mx.arange(8).reshape(1, 2, 4), idx).tolist() == [[[0, 2, 5, 6, 7]]]


# --- pinned reductions on a model ------------------------------------------------
@pytest.mark.parametrize("extra", ["layers=squeeze, strength=0", "heads=adakv, alpha=1"])
def test_allocation_off_is_the_uniform_recipe_bit_for_bit(model, tmp_path, extra):
    base, want = run(model, tmp_path, "evict(budget=32, sinks=2)", "base")
    mine, got = run(model, tmp_path, f"evict(budget=32, sinks=2, {extra})", "mine")
    assert mx.array_equal(want, got).item()
    for a, b in zip(base, mine):
        assert mx.array_equal(a.tiers[0].positions, b.tiers[0].positions).item()


def test_squeeze_budgets_are_chosen_once_and_sum_to_the_total(model, tmp_path):
    caches, _ = run(model, tmp_path, "evict(budget=32, sinks=2, layers=squeeze, strength=16)")
    chosen = caches[0].coordinator.budgets
    assert sum(chosen["layers"]) == 4 * 32 and len(set(chosen["layers"])) > 1
    for cache, b in zip(caches, chosen["layers"]):
        cache.size()  # settles: the newest token is evicted for lazily
        assert cache.tiers[0].lengths() == [b] * 3  # every step evicts to the layer's own budget


# --- ragged heads hold no padding and attend exactly ------------------------------
def ragged_caches(model, tmp_path, once):
    return run(model, tmp_path, f"evict(budget=24, sinks=2, score=mean, heads=adakv, alpha=0.1, once={once})")


@pytest.mark.parametrize("once", ["true", "false"])
def test_adakv_heads_hold_their_budgets_without_padding(model, tmp_path, once):
    caches, logits = ragged_caches(model, tmp_path, once)
    assert bool(mx.all(mx.isfinite(logits)).item())
    unequal = 0
    for cache, heads in zip(caches, caches[0].coordinator.budgets["heads"]):
        tier = cache.tiers[0]
        assert sum(heads) == 3 * 24
        cache.size()  # settles: the newest token is evicted for lazily
        lens = tier.lengths()
        grown = 0 if once == "false" else STEPS + 1  # once: the last prompt token and the steps are appended
        assert lens == [b + grown for b in heads]
        unequal += len(set(heads)) > 1
        per_token = 2 * 64 * 2 + 4 + 4  # fp16 K and V, int32 position, float32 score
        if tier.ragged is None:
            continue
        bufs = [b for side in (*tier.buffers.values(), tier.meta) for b in side.values()]
        assert sum(b.flat.nbytes for b in bufs) == sum(tier.ragged.lens) * per_token  # no padded slot held
        H, W, N = len(tier.ragged.lens), tier.ragged.width, sum(tier.ragged.lens)
        # saved int32 lengths and budgets, and the pad/flatten index arrays (int32 pad_idx and sel, bool valid)
        books = 4 * H + 4 * len(tier.budgets) + 4 * H * W + H * W + 4 * N
        assert cache.nbytes == sum(b.flat.nbytes + b.tail.nbytes for b in bufs) + books
        assert sum(a.nbytes for a in cache.state) <= cache.nbytes  # what is saved is counted
        if once == "false":
            assert cache.nbytes == sum(lens) * per_token + books
    assert unequal  # the allocation did move budget between heads


def test_ragged_attention_equals_each_heads_own_tokens(model, tmp_path):
    caches, _ = ragged_caches(model, tmp_path, "true")
    cache = next(c for c in caches if c.tiers[0].ragged is not None)
    tier = cache.tiers[0]
    q = mx.random.normal((1, 9, 1, 64), key=mx.random.key(5))
    got = np.array(cache.attend(q, scale=0.125, observe=False))
    k, v = (np.array(a.astype(mx.float32)) for a in tier.decoded(mx.float32))
    pos = np.array(tier.positions)
    for h in range(9):
        kv = h // 3
        keep = pos[0, kv] < PAD
        s = (np.array(q[0, h, 0]) @ k[0, kv][keep].T) * 0.125
        w = np.exp(s - s.max())
        want = (w / w.sum()) @ v[0, kv][keep]
        np.testing.assert_allclose(got[0, h, 0], want, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("once", ["true", "false"])  # once: decode tokens wait in the tail when saved
def test_ragged_cache_saves_loads_and_continues_identically(model, tmp_path, once):
    recipe = pipeline_recipe(
        tmp_path, f"evict(budget=24, sinks=2, score=mean, heads=adakv, alpha=0.1, once={once})", "rag"
    )
    caches = veloxquant.make_prompt_cache(model, recipe)
    toks = tokens()
    drive(model, caches, toks)
    path = str(tmp_path / "c.safetensors")
    save_prompt_cache(path, caches, {})
    loaded, _ = load_prompt_cache(path, model=model)
    assert [c.tiers[0].lengths() for c in loaded] == [c.tiers[0].lengths() for c in caches]
    assert [c.tiers[0].budgets for c in loaded] == [c.tiers[0].budgets for c in caches]
    assert any(c.tiers[0].ragged is not None for c in loaded)
    nxt = toks[:, -3:-2]
    a, b = model(nxt, cache=caches), model(nxt, cache=loaded)
    assert mx.array_equal(a, b).item()
