"""Batched per-head eviction (runtime/eviction/batch_heads.py): a sequence in a batch keeps, scores and
sees what it does alone.

mlx-lm's BatchGenerator drives the caches as its server does (tests/test_batch.py's `_batched`): ragged
prompts, right-padded while processed, two sequences joining the running batch (extend) and sequences
leaving at different steps (filter, extract). Budgets are small, so every sequence but the shortest is
cut in the prompt and on every decode step (h2o, tova, pyramidkv) or once at its own prompt's end
(snapkv)."""

import copy
import types

import mlx.core as mx
import pytest
from mlx_lm import batch_generate
from mlx_lm.generate import BatchGenerator, generate_step

import veloxquant
from veloxquant.runtime.batch import BatchRefused

from conftest import tiny_gemma3, tiny_llama
from test_batch import _alone, _batched

LENGTHS = [5, 70, 40, 23]  # 5: never over the budget; the others are cut while their prompt is processed
TOKENS = [10, 4, 12, 7]  # they leave at different steps
LOGPROB_TOL = 2e-3  # float32: the same softmax over slots in another order, and sums in another order
CASES = {
    "h2o": ["budget=16", "sinks=2"],
    "h2o-recent": ["budget=16", "sinks=2", "recent=4"],
    "h2o-once": ["budget=16", "sinks=2", "once=true"],
    "tova": ["budget=12"],
    "pyramidkv": ["budget=pyramid(from=24, to=8)"],
    "snapkv": ["budget=16", "window=4", "pool=3", "sinks=1"],
    "observed_attention": ["budget=16", "pool=3"],
    "observed_attention-steps": ["budget=16", "pool=3", "once=false"],
    "knorm": ["budget=12"],
    "keydiff": ["budget=12"],
}


def _prompts():
    return [[1 + (i * 11 + j * 3) % 400 for j in range(n)] for i, n in enumerate(LENGTHS)]


def _batch_and_alone(model, recipe, sets, prompts, tokens, tol):
    """Each prompt run alone and all in one batch: the same tokens, logprobs within `tol`. Returns the
    batch's extracted caches and the alone caches, for the caller's checks of what they hold."""
    alone_caches = [veloxquant.make_prompt_cache(model, recipe, sets) for _ in prompts]
    alone = [_alone(model, recipe, p, n, sets, c) for p, n, c in zip(prompts, tokens, alone_caches)]
    batched, caches = _batched(model, recipe, prompts, tokens, sets=sets)
    for a, b in zip(alone, batched):
        assert [t for t, _ in a] == [t for t, _ in b]
        assert max(float(mx.abs(x - y).max()) for (_, x), (_, y) in zip(a, b)) < tol
    return caches, alone_caches


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_eviction_batch_equals_alone(case):
    """Tokens as alone, logprobs within float tolerance, and each extracted cache holds what the alone cache
    holds: the same positions per head, the same bytes."""
    model = tiny_llama()
    recipe, sets = case.split("-")[0], CASES[case]
    prompts = _prompts()
    caches, alone_caches = _batch_and_alone(model, recipe, sets, prompts, TOKENS, LOGPROB_TOL)
    for mine, theirs in zip(caches, alone_caches):
        for x, y in zip(mine, theirs):
            assert x.rows is None and x.offset == y.offset
            assert x.nbytes == y.nbytes  # settles the alone cache's last step
            assert mx.array_equal(x.tiers[0].positions, y.tiers[0].positions)
    assert all(c.tiers[0].count < c.offset for c in caches[1])  # the longest prompt was cut in every layer


def _run(model, prompts, max_tokens, caches, prefill_step_size=2048):
    """Each sequence's (token, logprobs) from one BatchGenerator holding them all."""
    gen = BatchGenerator(model, prefill_batch_size=4, completion_batch_size=4, prefill_step_size=prefill_step_size)
    uids = gen.insert(prompts, max_tokens, caches=caches)
    got = {}
    while responses := gen.next_generated():
        for r in responses:
            got.setdefault(r.uid, []).append((r.token, r.logprobs))
    gen.close()
    return [got[u] for u in uids]


@pytest.mark.parametrize("recipe", ["h2o", "snapkv", "tova"])
def test_prompts_in_chunks_batch_as_alone(recipe):
    """Prompts fed in 16-token chunks (mlx-lm's prefill_step_size): rows are cut between chunks, end their
    prompts at different steps and leave the prompt batch at different times; alone is fed the same chunks."""
    model = tiny_llama()
    sets, prompts = CASES[recipe], _prompts()
    alone = []
    for p, n in zip(prompts, TOKENS):
        cache = veloxquant.make_prompt_cache(model, recipe, sets)
        steps = generate_step(mx.array(p), model, prompt_cache=cache, max_tokens=n, prefill_step_size=16)
        alone.append([(int(t), lp) for t, lp in steps])
    caches = [veloxquant.make_prompt_cache(model, recipe, sets) for _ in prompts]
    batched = _run(model, prompts, TOKENS, caches, prefill_step_size=16)
    for a, b in zip(alone, batched):
        assert [t for t, _ in a] == [t for t, _ in b]
        assert max(float(mx.abs(x - y).max()) for (_, x), (_, y) in zip(a, b)) < LOGPROB_TOL


@pytest.mark.parametrize("recipe", ["h2o", "snapkv", "tova"])
def test_a_stored_cache_continues_in_a_batch_as_alone(recipe):
    """mlx-lm's server merges a stored cache (a finished sequence's: cut, and for snapkv decided) into a batch
    with the next turn's tokens, beside a fresh sequence: it goes on as the same cache goes on alone (a new
    turn: snapkv listens again and decides again at the turn's end)."""
    model = tiny_llama()
    sets = CASES[recipe]
    stored = veloxquant.make_prompt_cache(model, recipe, sets)
    _alone(model, recipe, _prompts()[1], 4, sets, stored)
    assert stored[0].tiers[0].count < stored[0].offset  # cut
    twin = copy.deepcopy(stored)
    turn, other = [7 + j % 50 for j in range(30)], _prompts()[2]
    alone = [_alone(model, recipe, turn, 6, sets, twin), _alone(model, recipe, other, 6, sets)]
    batched = _run(model, [turn, other], [6, 6], [stored, veloxquant.make_prompt_cache(model, recipe, sets)])
    for a, b in zip(alone, batched):
        assert [t for t, _ in a] == [t for t, _ in b]
        assert max(float(mx.abs(x - y).max()) for (_, x), (_, y) in zip(a, b)) < LOGPROB_TOL


def test_batch_generate_with_h2o_caches():
    model = tiny_llama()
    tokenizer = types.SimpleNamespace(eos_token_ids=[], decode=lambda ids: " ".join(map(str, ids)))
    prompts = _prompts()
    sets = CASES["h2o"]
    caches = [veloxquant.make_prompt_cache(model, "h2o", sets) for _ in prompts]
    out = batch_generate(model, tokenizer, prompts, prompt_caches=caches, max_tokens=5, return_token_ids=True)
    assert out.token_ids == [[t for t, _ in _alone(model, "h2o", p, 5, sets)] for p in prompts]


def test_a_refused_eviction_says_why():
    """An eviction option a batch does not carry yet: no merge (mlx-lm's server serves it one at a time), and
    batch_generate raises the recipe's reason as a VeloxError."""
    model = tiny_llama()
    caches = [veloxquant.make_prompt_cache(model, "h2o", ["slack=4"]) for _ in range(2)]
    assert not hasattr(caches[0][0], "merge")
    with pytest.raises(BatchRefused, match=r"layer 0: its evict\(slack=4: decode queries held .*\) is not batched yet"):
        caches[0][0].merge([c[0] for c in caches])
    tokenizer = types.SimpleNamespace(eos_token_ids=[], decode=lambda ids: "")
    with pytest.raises(BatchRefused, match="recipe 'h2o' does not batch: layer 0: .*one sequence at a time"):
        batch_generate(model, tokenizer, _prompts()[:2], prompt_caches=caches, max_tokens=2)  # not mlx-lm's ValueError


# Not knorm: Gemma 3's k_norm gives every key the same norm, so knorm's scores tie (-16.0 +- 1e-5) and which
# tokens a cut keeps is the sort's tie-break, alone as in a batch (measured: on the tiny Llama it is exact).
GEMMA_CASES = ["h2o", "tova", "snapkv", "observed_attention"]


@pytest.mark.parametrize("case", GEMMA_CASES)
def test_an_eviction_batch_equals_alone_on_sliding_layers(case):
    """Gemma 3's sliding-window layers (window 24): each row's window masks its own queries and its cuts rank
    expired tokens last (`once` routes drop them once the row holds more than the window). Tokens as alone,
    logprobs within float tolerance, bytes as alone; the kept positions as alone on the global layer (on a
    sliding layer, which expired tokens fill a budget no query still reaches is a tie both ways)."""
    model = tiny_gemma3(window=24)
    sets = CASES[case]
    prompts = _prompts()
    caches, alone_caches = _batch_and_alone(model, case, sets, prompts, TOKENS, LOGPROB_TOL)
    for mine, theirs in zip(caches, alone_caches):
        assert {x.plan.window for x in mine} == {None, 24}
        for x, y in zip(mine, theirs):
            assert x.offset == y.offset and x.nbytes == y.nbytes
            if x.plan.window is None:
                assert mx.array_equal(x.tiers[0].positions, y.tiers[0].positions)


@pytest.fixture(scope="module")
def smollm2():
    from veloxquant.data.corpus import austen_text
    from veloxquant.models import load_model

    model, tokenizer = load_model()
    ids = tokenizer.encode(austen_text()[:6000])
    return model, [ids[i * 500 : i * 500 + n] for i, n in enumerate([40, 300, 170, 90])]


# float32 over 30 layers: fp16's own batched logprobs differ from alone by up to 5.9e-3 on these prompts
# (measured); h2o, tova and snapkv by up to 1.0e-2 (their explicit softmax sums in another order too).
SMOLLM2_TOL = 2e-2


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["h2o", "tova", "snapkv"])
def test_an_eviction_batch_equals_alone_on_smollm2(smollm2, recipe):
    """SmolLM2's real weights (real attention, no ties): Austen prompts of 40 to 300 tokens, budget 64, two
    sequences joining and each leaving at its own step. Tokens as alone, and every layer's kept positions
    per head and bytes as alone."""
    model, prompts = smollm2
    sets, tokens = ["budget=64"], [8, 4, 10, 6]
    caches, alone_caches = _batch_and_alone(model, recipe, sets, prompts, tokens, SMOLLM2_TOL)
    for mine, theirs in zip(caches, alone_caches):
        for x, y in zip(mine, theirs):
            assert x.nbytes == y.nbytes and mx.array_equal(x.tiers[0].positions, y.tiers[0].positions)
    assert all(c.tiers[0].count < c.offset for c in caches[1])  # the 300-token prompt was cut in every layer
    veloxquant.uninstall(model)
