"""Eviction scorers behind one protocol (runtime/eviction/scorers/): each checked against
a NumPy model of its formula, the pinned reductions bit for bit, `once` mode,
and every new recipe through generate-style feeding, save/load and bytes."""

import mlx.core as mx
import numpy as np
import pytest

import veloxquant
from veloxquant.runtime.persist import load_prompt_cache, save_prompt_cache

from conftest import feed, tiny_gemma3
from test_evict import HKV, HQ, SCALE, blocks, layer_cache

NEW = [
    "knorm",
    "keydiff",
    "expected_attention",
    "keyformer",
    "morphkv",
    "chunkkv",
    "qfilters",
    "curdkv",
    "observed_attention",
]


def drive(cache, data):
    for q, k, v in data:
        cache.update_and_fetch(mx.array(k), mx.array(v))
        cache.attend(mx.array(q), SCALE)
    return cache


def held(cache):
    cache._settle()
    return np.array(cache.tiers[0].positions)


def top(priority, budget, protect):
    """Kept positions per head from a NumPy priority [H, L] (protected positions always kept)."""
    p = np.where(protect, np.inf, priority)
    return [sorted(np.argsort(-p[h], kind="stable")[:budget].tolist()) for h in range(p.shape[0])]


def causal_weights(Q, K):
    """Q [Hq, Lq, D] at positions L-Lq.., K [Hkv, L, D] -> received per kv head [Hkv, L] (float64)."""
    L, Lq, rep = K.shape[1], Q.shape[1], Q.shape[0] // K.shape[0]
    got = np.zeros((K.shape[0], L))
    for qh in range(Q.shape[0]):
        logits = Q[qh].astype(np.float64) @ K[qh // rep].T.astype(np.float64) * SCALE
        logits[np.arange(L)[None] > (L - Lq + np.arange(Lq))[:, None]] = -np.inf
        w = np.exp(logits - logits.max(-1, keepdims=True))
        got[qh // rep] += (w / w.sum(-1, keepdims=True)).sum(0)
    return got


def test_once_mean_decides_at_prompt_end_like_observed_attention(llama_model, tmp_path):
    """kvpress's ObservedAttention: mass / number of queries that could see the token, pruned once."""
    budget, sinks = 12, 2
    cache = layer_cache(llama_model, tmp_path, f"evict(budget={budget}, sinks={sinks}, score=mean, once=true)")
    data = blocks(11, [16, 16, 8])
    drive(cache, data)
    assert cache.tiers[0].count == 40  # nothing evicted before the prompt ends
    cache.finish_prompt()
    Q = np.concatenate([d[0] for d in data], axis=2)[0]
    K = np.concatenate([d[1] for d in data], axis=2)[0]
    mean = causal_weights(Q, K) / (40 - np.arange(40))
    protect = np.broadcast_to(np.arange(40) < sinks, mean.shape)
    got = held(cache)
    assert [list(got[0, h]) for h in range(HKV)] == top(mean, budget, protect)
    drive(cache, blocks(12, [1, 3]))  # later tokens are appended, never evicted
    assert held(cache).shape[2] == budget + 4 and cache.tiers[0].scorer.nbytes == 0


@pytest.mark.parametrize("score", ["mass", "current", "keydiff"])
def test_once_keeps_everything_until_the_end_then_appends(llama_model, tmp_path, score):
    cache = layer_cache(llama_model, tmp_path, f"evict(budget=8, sinks=1, score={score}, once=true)")
    drive(cache, blocks(3, [12, 12]))
    assert cache.tiers[0].count == 24
    drive(cache, blocks(4, [1]))  # a one-token step ends the prompt (mlx-lm's generate)
    assert held(cache).shape[2] == 9


def test_knorm_is_path_independent(llama_model, tmp_path):
    """recent=0: one-block arrival and token-by-token arrival keep the same set, the lowest norms."""
    ((q, k, v),) = blocks(5, [30])
    one = drive(layer_cache(llama_model, tmp_path, "evict(budget=10, sinks=2, score=knorm)"), [(q, k, v)])
    steps = [(q[:, :, i : i + 1], k[:, :, i : i + 1], v[:, :, i : i + 1]) for i in range(30)]
    each = drive(layer_cache(llama_model, tmp_path, "evict(budget=10, sinks=2, score=knorm)"), steps)
    want = top(-np.linalg.norm(k[0], axis=-1), 10, np.broadcast_to(np.arange(30) < 2, (HKV, 30)))
    for cache in (one, each):
        assert [list(x) for x in held(cache)[0]] == want


def test_keydiff_keeps_keys_least_like_the_mean_direction(llama_model, tmp_path):
    data = blocks(6, [20, 10])
    cache = drive(layer_cache(llama_model, tmp_path, "evict(budget=9, sinks=1, score=keydiff, once=true)"), data)
    cache.finish_prompt()
    K = np.concatenate([d[1] for d in data], axis=2)[0].astype(np.float64)
    unit = K / np.linalg.norm(K, axis=-1, keepdims=True)
    anchor = unit.mean(1, keepdims=True)
    anchor /= np.linalg.norm(anchor, axis=-1, keepdims=True)
    want = top(-(unit * anchor).sum(-1), 9, np.broadcast_to(np.arange(30) < 1, (HKV, 30)))
    assert [list(x) for x in held(cache)[0]] == want


def test_expected_attention_matches_its_formula(llama_model, tmp_path):
    window = 6
    data = blocks(7, [20, 10])
    cache = drive(
        layer_cache(llama_model, tmp_path, f"evict(budget=9, sinks=1, score=expected, window={window}, once=true)"),
        data,
    )
    cache.finish_prompt()
    Q = np.concatenate([d[0] for d in data], axis=2)[0, :, -window:].astype(np.float64)
    K = np.concatenate([d[1] for d in data], axis=2)[0].astype(np.float64)
    V = np.concatenate([d[2] for d in data], axis=2)[0].astype(np.float64)
    rep = HQ // HKV
    score = np.zeros((HKV, 30))
    for qh in range(HQ):
        mu, cov = Q[qh].mean(0), np.cov(Q[qh].T)
        k = K[qh // rep]
        logits = SCALE * k @ mu + 0.5 * SCALE**2 * np.einsum("ld,de,le->l", k, cov, k)
        e = np.exp(logits - logits.max())
        score[qh // rep] += e / e.sum() / rep
    score *= np.linalg.norm(V, axis=-1)
    want = top(score, 9, np.broadcast_to(np.arange(30) < 1, (HKV, 30)))
    assert [list(x) for x in held(cache)[0]] == want


def test_qfilters_direction_is_the_queries_principal_axis_with_its_sign(llama_model, tmp_path):
    rng = np.random.default_rng(9)
    axis = rng.standard_normal(16)
    axis /= np.linalg.norm(axis)
    q = (rng.standard_normal((1, HQ, 24, 16)) * 0.3 + 4.0 * axis).astype(np.float32)  # queries point along +axis
    k = rng.standard_normal((1, HKV, 24, 16)).astype(np.float32)
    v = rng.standard_normal((1, HKV, 24, 16)).astype(np.float32)
    cache = drive(
        layer_cache(llama_model, tmp_path, "evict(budget=8, sinks=0, score=qfilters, window=16)"), [(q, k, v)]
    )
    u = np.array(cache.tiers[0].scorer.direction)[0]
    assert np.all(u @ axis > 0.99)  # the axis, and the end the queries point to
    want = top(k[0] @ axis, 8, np.zeros((HKV, 24), bool))
    assert [list(x) for x in held(cache)[0]] == want


def test_curd_scores_are_energy_weighted_leverage(llama_model, tmp_path):
    rank = 3
    data = blocks(10, [20, 10])
    cache = drive(
        layer_cache(llama_model, tmp_path, f"evict(budget=9, sinks=1, score=curd, rank={rank}, once=true)"), data
    )
    tier = cache.tiers[0]
    pri = np.array(tier.scorer.priority(tier, cache.offset, None))[0]
    Q = np.concatenate([d[0] for d in data], axis=2)[0]
    K = np.concatenate([d[1] for d in data], axis=2)[0]
    V = np.concatenate([d[2] for d in data], axis=2)[0].astype(np.float64)
    a = causal_weights(Q, K) / (30 - np.arange(30))
    for h in range(HKV):
        u, s, _ = np.linalg.svd(a[h][:, None] * V[h], full_matrices=False)
        lev = (u[:, :rank] ** 2 * s[:rank] ** 2).sum(1) / (s**2).sum()
        np.testing.assert_allclose(pri[h], lev, rtol=2e-3, atol=1e-7)


def test_morph_relevance_is_the_mean_of_the_last_window_rows(llama_model, tmp_path):
    window = 3
    cache = layer_cache(llama_model, tmp_path, f"evict(budget=40, sinks=1, score=morph, window={window}) | identity")
    data = blocks(13, [10, 1, 1, 1, 1])
    drive(cache, data)
    tier = cache.tiers[0]
    pri = np.array(tier.scorer.priority(tier, cache.offset, None))[0]
    Q = np.concatenate([d[0] for d in data], axis=2)[0]
    K = np.concatenate([d[1] for d in data], axis=2)[0]
    # each of the last `window` queries: its weights over what it saw (positions up to its own)
    want = sum(np.pad(causal_weights(Q[:, n - 1 : n], K[:, :n]), ((0, 0), (0, 14 - n))) for n in (12, 13, 14)) / window
    np.testing.assert_allclose(pri, want, atol=1e-5)


REDUCTIONS = [
    ("keyformer", ["tau=0"], "h2o", []),
    ("chunkkv", ["chunk=1"], "h2o", []),
    ("morphkv", ["window=1"], "tova", []),
]


@pytest.mark.parametrize("name, sets, target, tsets", REDUCTIONS)
def test_pinned_reductions_bit_for_bit(llama_model, name, sets, target, tsets):
    tokens = mx.array(np.random.default_rng(14).integers(0, 500, (1, 48)))
    runs = []
    for n, s in ((name, sets), (target, tsets)):
        caches = veloxquant.make_prompt_cache(llama_model, n, ["budget=12", *s])
        logits = np.array(feed(llama_model, tokens, caches, 8))
        runs.append((logits, [np.array(c.tiers[0].positions) for c in caches]))
    assert np.array_equal(runs[0][0], runs[1][0])
    assert all(np.array_equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))


def test_keyformer_noise_changes_what_is_kept(llama_model):
    tokens = mx.array(np.random.default_rng(15).integers(0, 500, (1, 48)))
    kept = []
    for tau in (0, 4):
        caches = veloxquant.make_prompt_cache(llama_model, "keyformer", ["budget=12", f"tau={tau}"])
        feed(llama_model, tokens, caches, 8)
        kept.append([np.array(c.tiers[0].positions) for c in caches])
    assert any(not np.array_equal(a, b) for a, b in zip(*kept))


@pytest.mark.parametrize("name", NEW)
def test_new_recipes_run_save_load_and_hold_their_bytes(llama_model, tmp_path, name):
    tokens = mx.array(np.random.default_rng(16).integers(0, 500, (1, 40)))
    caches = veloxquant.make_prompt_cache(llama_model, name, ["budget=16", "sinks=2"])
    feed(llama_model, tokens[:, :31], caches, 16)
    feed(llama_model, tokens[:, 31:32], caches, 1)  # the prompt's last token alone: `once` recipes decide
    for c in caches:
        c._settle()
        assert c.size() in (16, 17)  # once: the budget, then the appended token
        tier = c.tiers[0]  # buffers as allocated (once routes grow in steps), plus the scorer's own arrays
        allocated = sum(b.data.nbytes for bufs in (*tier.buffers.values(), tier.meta) for b in bufs.values())
        assert c.nbytes == allocated + tier.scorer.nbytes >= sum(a.nbytes for a in tier.arrays().values())
    save_prompt_cache(tmp_path / "c.safetensors", caches)
    loaded, _ = load_prompt_cache(tmp_path / "c.safetensors")
    a = feed(llama_model, tokens[:, 32:], caches, 1)
    b = feed(llama_model, tokens[:, 32:], loaded, 1)
    assert np.array_equal(np.array(a), np.array(b))


@pytest.mark.parametrize("name", NEW)
def test_new_recipes_on_sliding_window_layers(name):
    """Gemma-style local layers: with nothing evicted, the recipe sees what fp16 sees."""
    model = tiny_gemma3(window=32)
    tokens = mx.array(np.random.default_rng(17).integers(0, 500, (1, 100)))
    want = feed(model, tokens, veloxquant.make_prompt_cache(model, "fp16"), 16)
    got = feed(model, tokens, veloxquant.make_prompt_cache(model, name, ["budget=200"]), 16)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-3)


@pytest.mark.parametrize("name", ["observed_attention", "snapkv", "knorm"])
def test_kvpress_bench_fork_decides_like_a_fresh_cache(llama_model, name):
    """bench kvpress feeds the prompt once and decides at each budget on copies: same as a fresh run."""
    from veloxquant.bench.kvpress import fork

    tokens = mx.array(np.random.default_rng(18).integers(0, 500, (1, 48)))
    sets = {"knorm": ["once=true"], "snapkv": ["window=8"]}.get(name, [])
    wide = veloxquant.make_prompt_cache(llama_model, name, [*sets, "budget=30"])
    feed(llama_model, tokens[:, :40], wide, 16)
    forked = fork(wide, 12)
    fresh = veloxquant.make_prompt_cache(llama_model, name, [*sets, "budget=12"])
    feed(llama_model, tokens[:, :40], fresh, 16)
    for caches in (forked, fresh):
        for c in caches:
            c.finish_prompt()
    a, b = (np.array(feed(llama_model, tokens[:, 40:], c, 4)) for c in (forked, fresh))
    assert np.array_equal(a, b)
    assert all(
        np.array_equal(np.array(x.tiers[0].positions), np.array(y.tiers[0].positions)) for x, y in zip(forked, fresh)
    )


def test_a_new_scorer_is_one_registration(llama_model, tmp_path):
    """The protocol: a scorer declared in the stage layer (stages/scorers.py) and registered in the
    runtime is fed what its declaration says it needs, and ranks; an undeclared one is refused."""
    from veloxquant.runtime.eviction.scorers import SCORERS, Scorer, scorer
    from veloxquant.stages.scorers import SPECS, ScorerSpec, declare

    with pytest.raises(ValueError, match="not declared in stages/scorers.py"):
        scorer("test_undeclared")(type("Undeclared", (Scorer,), {}))
    declare(ScorerSpec("test_oldest_first", frozenset({"queries", "new_keys"})))

    @scorer("test_oldest_first")
    class OldestFirst(Scorer):
        seen = []

        def observe(self, tier, seen):
            OldestFirst.seen.append((seen.queries.shape, seen.new_keys.shape, seen.received))

        def priority(self, tier, offset, weigh):
            return -tier.positions.astype(mx.float32)

    try:
        cache = drive(
            layer_cache(llama_model, tmp_path, "evict(budget=6, sinks=0, score=test_oldest_first)"), blocks(19, [10, 1])
        )
        assert [list(h) for h in held(cache)[0]] == [list(range(6))] * HKV
        assert OldestFirst.seen[0] == ((1, HQ, 10, 16), (1, HKV, 10, 16), None)  # no weights asked, none computed
    finally:
        del SCORERS["test_oldest_first"], SPECS["test_oldest_first"]


@pytest.mark.parametrize(
    "pipeline",
    ["snap(budget=48, window=4) | identity", "evict(budget=48, score=expected, window=4, once=true) | identity"],
)
def test_query_window_is_compact_and_in_the_state(llama_model, tmp_path, pipeline):
    """The kept queries are their own window-sized array, not a view of (or a lazy concatenation over)
    every prefill block's queries, and the cache's state lists them so generate's eval computes them."""
    cache = layer_cache(llama_model, tmp_path, pipeline)
    for q, k, v in blocks(2, [20, 30, 2]):
        cache.update_and_fetch(mx.array(k), mx.array(v))
        cache.attend(mx.array(q), SCALE)
    scorer = cache.tiers[0].scorer
    assert scorer.queries.shape[2] == 4
    np.testing.assert_array_equal(
        np.array(scorer.queries), np.concatenate([b[0] for b in blocks(2, [20, 30, 2])], axis=2)[:, :, -4:]
    )
    assert any(a is scorer.queries for a in cache.state)


def test_scorers_own_their_parameters(tmp_path):
    """A scorer parameter set on a scorer that does not read it is an error naming the scorers that do
    (stages/scorers.py declares who reads what); the field at its default, or on its scorer, is fine."""
    from veloxquant.compiler import SMOLLM2_135M, compile_recipe
    from veloxquant.errors import RecipeError
    from veloxquant.recipe import load_recipe

    def compiled(pipeline):
        path = tmp_path / "r.yaml"
        path.write_text(f"veloxquant: 1\nname: r\npipeline: {pipeline}\n")
        return compile_recipe(load_recipe(str(path)), SMOLLM2_135M)

    compiled("evict(budget=64, score=keyformer, tau=2.0)")
    compiled("evict(budget=64, score=mass, tau=1.0)")  # the default: nothing was set
    with pytest.raises(
        RecipeError,
        match=r"r.yaml:3:.*tau=2.0 is a parameter of score=keyformer, nested, "
        r"not of score=mass",
    ):
        compiled("evict(budget=64, score=mass, tau=2.0)")
    with pytest.raises(RecipeError, match=r"window=16 is a parameter of score=expected, morph, nested, qfilters"):
        compiled("evict(budget=64, score=curd, window=16)")
