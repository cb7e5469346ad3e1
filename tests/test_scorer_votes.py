"""SnapKV's window votes as a share of any `once` score's budget (runtime/eviction/scorers/votes.py):
the two pinned reductions bit for bit (votes=0 == observed_attention, votes=1 == snapkv), the
union rule against a NumPy model, save/load, sliding-window layers and the clear error."""

import mlx.core as mx
import numpy as np
import pytest

import veloxquant
from veloxquant.errors import RecipeError
from veloxquant.runtime.persist import load_prompt_cache, save_prompt_cache

from conftest import feed, tiny_gemma3
from test_evict import HKV, blocks, layer_cache
from test_scorers import causal_weights, drive, held

TOKENS = mx.array(np.random.default_rng(21).integers(0, 500, (1, 48)))


def run(model, name, sets):
    """Logits and kept positions: the prompt in chunks, its last token alone (the decision), then decode."""
    caches = veloxquant.make_prompt_cache(model, name, sets)
    logits = [feed(model, TOKENS[:, :39], caches, 16), feed(model, TOKENS[:, 39:], caches, 1)]
    return np.array(mx.concatenate(logits, axis=1)), [np.array(c.tiers[0].positions) for c in caches]


def same(a, b):
    assert np.array_equal(a[0], b[0])
    assert all(np.array_equal(x, y) for x, y in zip(a[1], b[1]))


def test_votes_zero_is_observed_attention_bit_for_bit(llama_model):
    same(
        run(llama_model, "observed_snap", ["budget=12", "votes=0"]),
        run(llama_model, "observed_attention", ["budget=12"]),
    )


def test_votes_one_is_snapkv_bit_for_bit(llama_model):
    same(
        run(llama_model, "observed_snap", ["budget=12", "votes=1", "sinks=0", "window=4", "pool=3"]),
        run(llama_model, "snapkv", ["budget=12", "window=4", "pool=3"]),
    )


def test_a_share_changes_what_is_kept(llama_model):
    base = run(llama_model, "observed_attention", ["budget=12"])
    voted = run(llama_model, "observed_snap", ["budget=12", "votes=0.5", "window=4", "pool=3"])
    assert any(not np.array_equal(a, b) for a, b in zip(base[1], voted[1]))


def pool(x, size):
    left = size // 2
    padded = np.pad(x, ((0, 0), (left, size - 1 - left)), constant_values=-np.inf)
    return np.max([padded[:, i : i + x.shape[1]] for i in range(size)], axis=0)


def test_union_of_vote_share_and_score(llama_model, tmp_path):
    """Each head keeps its top round(votes x budget) pooled window votes (the window itself among
    them), then fills its budget with the highest mass per observing query; sinks always."""
    budget, sinks, share, window, width = 16, 2, 0.5, 4, 1  # no pooling: no tied votes to break
    cache = layer_cache(
        llama_model,
        tmp_path,
        f"evict(budget={budget}, sinks={sinks}, score=mean, once=true, "
        f"votes={share}, vote_window={window}, vote_pool={width})",
    )
    data = blocks(22, [16, 16, 8])
    drive(cache, data)
    cache.finish_prompt()
    Q = np.concatenate([d[0] for d in data], axis=2)[0]
    K = np.concatenate([d[1] for d in data], axis=2)[0]
    L = K.shape[1]
    mean = causal_weights(Q, K) / (L - np.arange(L))
    votes = pool(causal_weights(Q[:, -window:], K), width)
    votes[:, L - window :] = np.inf
    got = held(cache)[0]
    for h in range(HKV):
        chosen = set(np.argsort(-votes[h], kind="stable")[: round(share * budget)].tolist())
        rest = [int(i) for i in np.argsort(-mean[h], kind="stable") if i not in chosen and i >= sinks]
        want = sorted(chosen | set(range(sinks)) | set(rest[: budget - len(chosen | set(range(sinks)))]))
        assert list(got[h]) == want


def test_saves_loads_and_holds_its_bytes(llama_model, tmp_path):
    caches = veloxquant.make_prompt_cache(llama_model, "observed_snap", ["budget=16", "sinks=2", "window=4"])
    feed(llama_model, TOKENS[:, :31], caches, 16)
    for c in caches:
        assert c.tiers[0].scorer.nbytes > 0  # the window's queries, until the decision
    feed(llama_model, TOKENS[:, 31:32], caches, 1)
    for c in caches:
        c._settle()
        assert c.size() == 17 and c.tiers[0].scorer.nbytes == 0
    save_prompt_cache(tmp_path / "c.safetensors", caches)
    loaded, _ = load_prompt_cache(tmp_path / "c.safetensors")
    a, b = (np.array(feed(llama_model, TOKENS[:, 32:], c, 1)) for c in (caches, loaded))
    assert np.array_equal(a, b)


def test_sliding_window_layers_see_what_fp16_sees():
    model = tiny_gemma3(window=32)
    tokens = mx.array(np.random.default_rng(23).integers(0, 500, (1, 100)))
    want = feed(model, tokens, veloxquant.make_prompt_cache(model, "fp16"), 16)
    got = feed(model, tokens, veloxquant.make_prompt_cache(model, "observed_snap", ["budget=200"]), 16)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-3)


def test_votes_need_once(llama_model, tmp_path):
    with pytest.raises(RecipeError, match="votes=0.5 needs once=true"):
        layer_cache(llama_model, tmp_path, "evict(budget=16, score=mean, votes=0.5)")


def test_with_adakv_budgets_each_head_keeps_its_allocation(llama_model):
    """The vote share is taken of each head's allocated budget; the layer's total stays H x budget."""
    caches = veloxquant.make_prompt_cache(llama_model, "observed_snap", ["budget=12", "heads=adakv", "window=4"])
    feed(llama_model, TOKENS[:, :39], caches, 16)
    feed(llama_model, TOKENS[:, 39:40], caches, 1)
    for c in caches:
        tier = c.tiers[0]
        assert tier.budgets is not None and sum(tier.budgets) == 12 * len(tier.budgets)
        assert [n - 1 for n in tier.lengths()] == tier.budgets  # the allocation, then the appended token
