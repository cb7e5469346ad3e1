"""KVzip (recipes/kvzip.yaml): scores from one "repeat the context" pass the cache side runs
through the model (runtime/eviction/model_pass.py), checked against a NumPy model over plain mlx-lm
caches; the pass leaves every cache array as it was apart from the scores; probe=latest is
TOVA bit for bit; generate, save/load, Gemma-3 sliding layers, blocked memory, clear errors."""

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.models import llama
from mlx_lm.models.cache import KVCache

import veloxquant
from veloxquant.errors import VeloxError
from veloxquant.runtime.eviction import model_pass, per_head
from veloxquant.runtime.eviction.scorers.reconstruct import FIRST, LATER, SUFFIX
from veloxquant.runtime.persist import load_prompt_cache, save_prompt_cache

from conftest import CharTokenizer, feed, tiny_gemma3, tiny_llama

SETS = ["budget=12", "chunk=16"]


Tok = CharTokenizer


def tokens(n, seed=0):
    return mx.array(np.random.default_rng(seed).integers(0, 500, (1, n)))


def prefilled(model, recipe="kvzip", sets=SETS, n=40):
    caches = veloxquant.make_prompt_cache(model, recipe, sets, tokenizer=Tok())
    feed(model, tokens(n), caches, 16)
    mx.eval([c.state for c in caches])
    return caches


def arrays(caches):
    return [{k: np.array(v) for k, v in c.tiers[0].arrays().items()} for c in caches]


def test_the_pass_changes_nothing_but_the_scores(llama_model):
    caches = prefilled(llama_model)
    weights = [np.array(w) for _, w in tree_flatten(llama_model.parameters())]
    before, offsets = arrays(caches), [c.offset for c in caches]
    model_pass.run(caches[0].coordinator)
    after = arrays(caches)
    for b, a in zip(before, after):
        assert b.keys() == a.keys()
        assert all(np.array_equal(b[k], a[k]) for k in b if k != "score")  # K, V, positions: bit for bit
        assert (a["score"] > 0).all() and not np.array_equal(a["score"], b["score"])
    assert [c.offset for c in caches] == offsets and all(c.size() == 40 for c in caches)
    assert all(np.array_equal(w, np.array(x)) for w, (_, x) in zip(weights, tree_flatten(llama_model.parameters())))
    assert caches[0].coordinator.model_pass.fed == []  # the recorded prompt ids are dropped
    fed = 3 * len(SUFFIX) + 40 + len(FIRST) + 2 * (len(LATER) + 8)
    assert caches[0].coordinator.model_pass.ran == {
        "scorer": "reconstruct",
        "context_tokens": 40,
        "chunks": 3,
        "tokens_fed": fed,
    }


def test_repeat_prompt_follows_the_paper(llama_model):
    caches = prefilled(llama_model)
    driver, scorer = caches[0].coordinator.model_pass, caches[0].tiers[0].scorer
    context = np.array(tokens(40))[0].tolist()
    got = [(np.array(t)[0].tolist(), span) for t, span in scorer.passes(mx.array([context]), driver.texts)]
    enc = Tok().encode
    assert got[0] == (enc(FIRST) + enc(SUFFIX) + context[:16], (0, 16))
    assert got[1] == (enc(LATER) + context[8:16] + enc(SUFFIX) + context[16:32], (16, 32))
    assert got[2] == (enc(LATER) + context[24:32] + enc(SUFFIX) + context[32:40], (32, 40))


def reference_scores(model, context, passes, sinks, monkeypatch):
    """Per layer [Hkv, L]: each chunk's repeat fed after the context through mlx-lm's KVCache; the
    repeat queries' softmax over sinks + chunk + own tokens, max over queries and GQA group (float64)."""
    seen = []
    original = llama.scaled_dot_product_attention
    monkeypatch.setattr(
        llama,
        "scaled_dot_product_attention",
        lambda q, k, v, cache, scale, mask, **kw: (
            seen.append((q, k, scale)) or original(q, k, v, cache=cache, scale=scale, mask=mask, **kw)
        ),
    )
    caches = [KVCache() for _ in model.layers]
    model(context, cache=caches)
    L = context.shape[1]
    out = np.zeros((len(caches), model.args.num_key_value_heads, L))
    for ids, (s, e) in passes:
        seen.clear()
        model(ids, cache=caches)
        for layer, (q, k, scale) in enumerate(seen):
            q, k = np.array(q, np.float64)[0], np.array(k, np.float64)[0]  # [Hq, n, D], [Hkv, L + n, D]
            n, rep = q.shape[1], q.shape[0] // k.shape[0]
            allowed = np.zeros(L + n, bool)
            allowed[:sinks], allowed[s:e], allowed[L:] = True, True, True
            causal = np.arange(L + n)[None] <= L + np.arange(n)[:, None]
            for h in range(q.shape[0]):
                logits = np.where(causal & allowed, q[h] @ k[h // rep].T * scale, -np.inf)
                w = np.exp(logits - logits.max(-1, keepdims=True))
                w /= w.sum(-1, keepdims=True)
                out[layer, h // rep, s:e] = np.maximum(out[layer, h // rep, s:e], w[:, s:e].max(0))
        for c in caches:
            c.trim(n)
    return out


@pytest.mark.parametrize("run", [True, False], ids=["one-run", "per-head-masks"])
def test_scores_are_the_max_attention_of_the_repeat_pass(llama_model, monkeypatch, run):
    """Both ways the pass attends: SDPA over one contiguous run (scores over the sinks, the chunk and the
    repeat only), and per-head position masks (heads that hold different tokens, windows)."""
    if not run:
        monkeypatch.setattr(per_head, "_causal", lambda *a: False)
    caches = prefilled(llama_model)
    model_pass.run(caches[0].coordinator)
    got = np.stack([np.array(c.tiers[0].scores)[0] for c in caches])
    driver, scorer = caches[0].coordinator.model_pass, caches[0].tiers[0].scorer
    passes = list(scorer.passes(tokens(40), driver.texts))
    veloxquant.uninstall()
    want = reference_scores(llama_model, tokens(40), passes, 4, monkeypatch)
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-4)  # the tier holds K/V in fp16


def test_the_decision_keeps_each_heads_best_scores_and_the_sinks(llama_model):
    caches = prefilled(llama_model)
    model_pass.run(caches[0].coordinator)
    scores = [np.array(c.tiers[0].scores)[0] for c in caches]
    feed(llama_model, tokens(41)[:, 40:], caches, 1)  # the prompt's last token alone: the decision
    for c, s in zip(caches, scores):
        held = np.array(c.tiers[0].positions)[0]
        for h in range(s.shape[0]):
            best = sorted(np.argsort(-np.where(np.arange(40) < 4, np.inf, s[h]), kind="stable")[:12].tolist())
            assert held[h].tolist() == best + [40]


def test_recent_keeps_the_prompts_end_whatever_its_score(llama_model):
    """recent=n: the newest n prompt tokens stay (a question at the prompt's end); the rest by score."""
    caches = prefilled(llama_model, sets=[*SETS, "recent=6"])
    model_pass.run(caches[0].coordinator)
    scores = [np.array(c.tiers[0].scores)[0] for c in caches]
    feed(llama_model, tokens(41)[:, 40:], caches, 1)
    for c, s in zip(caches, scores):
        held = np.array(c.tiers[0].positions)[0]
        for h in range(s.shape[0]):
            kept = set(held[h].tolist())
            # decided on the 40 prompt tokens held when the last one arrives: sinks, the newest 6, 2 by score;
            # the last token is appended after the decision
            best = sorted(range(4, 34), key=lambda p: -s[h][p])[: 12 - 4 - 6]
            assert kept == set(range(4)) | set(best) | set(range(34, 41))
    with pytest.raises(VeloxError, match="leave no room"):
        veloxquant.make_prompt_cache(llama_model, "kvzip", ["budget=12", "recent=8"], tokenizer=Tok())


def test_probe_latest_is_tova_bit_for_bit(llama_model):
    ids = tokens(48, seed=14)
    runs = []
    for name, sets in (("kvzip", ["probe=latest"]), ("tova", [])):
        caches = veloxquant.make_prompt_cache(llama_model, name, ["budget=12", *sets])
        logits = np.array(feed(llama_model, ids, caches, 8))
        runs.append((logits, [np.array(c.tiers[0].positions) for c in caches]))
    assert np.array_equal(runs[0][0], runs[1][0])
    assert all(np.array_equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))


def test_generate_then_save_and_load(llama_model, tmp_path):
    caches = veloxquant.make_prompt_cache(llama_model, "kvzip", SETS, tokenizer=Tok())
    out = [int(t) for t, _ in generate_step(tokens(40)[0], llama_model, prompt_cache=caches, max_tokens=3)]
    assert len(out) == 3 and {c.size() for c in caches} == {12 + caches[0].offset - 39}  # budget, then appended
    save_prompt_cache(tmp_path / "c.safetensors", caches)
    loaded, _ = load_prompt_cache(tmp_path / "c.safetensors", model=llama_model)
    nxt = mx.array([[out[-1]]])
    assert np.array_equal(np.array(llama_model(nxt, cache=caches)), np.array(llama_model(nxt, cache=loaded)))


def test_gemma3_sliding_layers():
    """Local layers: the pass's queries see the window, as the model's do; expired tokens leave first."""
    model = tiny_gemma3(window=32)
    ids = tokens(100, seed=17)
    want = feed(model, ids, veloxquant.make_prompt_cache(model, "fp16"), 16)
    whole = veloxquant.make_prompt_cache(model, "kvzip", ["budget=200", "chunk=16"], tokenizer=Tok())
    np.testing.assert_allclose(np.array(feed(model, ids, whole, 16)), np.array(want), atol=1e-3)
    caches = veloxquant.make_prompt_cache(model, "kvzip", ["budget=24", "chunk=32"], tokenizer=Tok())
    feed(model, ids[:, :99], caches, 16)
    feed(model, ids[:, 99:], caches, 1)
    for c in caches:
        held = np.array(c.tiers[0].positions)[0]
        assert held.shape[-1] == 25  # the budget (at most the window), then the last prompt token
        if c.plan.window:
            assert held.min() >= 99 - c.plan.window + 1 or held.min() < 4


def test_pass_memory_is_blocked():
    """A 2,048-token context: the pass never holds [heads x queries x keys] weights (300 MB here)."""
    model = tiny_llama(layers=1)
    caches = veloxquant.make_prompt_cache(model, "kvzip", ["budget=64"], tokenizer=Tok())
    feed(model, tokens(2048, seed=3), caches, 1024)
    mx.eval([c.state for c in caches])
    mx.synchronize()
    mx.reset_peak_memory()
    start = mx.get_active_memory()
    model_pass.run(caches[0].coordinator)
    materialised = 9 * 2048 * (2 * 2048 + 40) * 4  # one float32 weights array for the whole pass: 291 MiB
    assert mx.get_peak_memory() - start < materialised / 2  # measured 92 MiB (8,192 tokens: 101 MiB)


def test_a_prompt_within_the_budget_runs_no_pass_and_stops_recording(llama_model):
    caches = prefilled(llama_model, sets=["budget=64"])
    feed(llama_model, tokens(44)[:, 40:], caches, 1)
    driver = caches[0].coordinator.model_pass
    assert driver.done and driver.fed == [] and driver.ran == {} and all(c.size() == 44 for c in caches)


def test_clear_errors(llama_model):
    with pytest.raises(VeloxError, match="tokenizer"):  # a model that came without one
        veloxquant.make_prompt_cache(llama.Model(llama_model.args), "kvzip", SETS)
    caches = veloxquant.make_prompt_cache(llama_model, "kvzip", SETS, tokenizer=Tok())
    llama_model(None, cache=caches, input_embeddings=llama_model.model.embed_tokens(tokens(40)))
    with pytest.raises(VeloxError, match="token ids"):
        feed(llama_model, tokens(41)[:, 40:], caches, 1)


def test_eval_fidelity_feeds_the_pass_through_its_tee(llama_model):
    """The eval's fidelity probe wraps each layer's caches in a tee: the prompt's ids still reach the pass."""
    from veloxquant.eval import fidelity
    from veloxquant.eval.rows import parse_row

    rows = [parse_row("fp16"), parse_row("kvzip[budget=24,chunk=32]")]
    windows = np.random.default_rng(5).integers(0, 500, (1, 129)).tolist()
    per_layer = fidelity.measure(llama_model, rows[0], rows, windows, prefix=96, prefill_chunk=32, score_chunk=8)
    assert all(0.5 < c < 1 - 1e-6 for c in per_layer["kvzip[budget=24,chunk=32]"])


def test_heads_compete_on_the_repeat_scores(llama_model, tmp_path):
    """heads=score: a layer's kv heads share its budget by the repeat scores (allocated after the pass)."""
    caches = prefilled(llama_model, sets=[*SETS, "heads=score", "alpha=0"])
    feed(llama_model, tokens(41)[:, 40:], caches, 1)
    heads = caches[0].coordinator.budgets["heads"]
    assert all(sum(b) == 3 * 12 for b in heads) and any(len(set(b)) > 1 for b in heads)
    save_prompt_cache(tmp_path / "c.safetensors", caches)
    loaded, _ = load_prompt_cache(tmp_path / "c.safetensors", model=llama_model)
    a, b = (np.array(feed(llama_model, tokens(44)[:, 41:], c, 1)) for c in (caches, loaded))
    assert np.array_equal(a, b)


def test_kvpress_bench_fork_after_the_pass_decides_like_a_fresh_cache(llama_model):
    """bench kvpress runs the pass once on the wide cache, then forks per budget: same as a fresh run."""
    from veloxquant.bench.kvpress import fork

    wide = prefilled(llama_model, sets=["budget=30", "chunk=16"])
    model_pass.run(wide[0].coordinator)
    forked, fresh = fork(wide, 12), prefilled(llama_model, sets=SETS)
    for caches in (forked, fresh):
        for c in caches:
            c.finish_prompt()
    for a, b in zip(forked, fresh):
        assert np.array_equal(np.array(a.tiers[0].positions), np.array(b.tiers[0].positions))
    x = tokens(44)[:, 40:]
    assert np.array_equal(np.array(feed(llama_model, x, forked, 1)), np.array(feed(llama_model, x, fresh, 1)))
