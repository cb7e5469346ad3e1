"""Hybrid and KV-shared layouts under mlx-lm's batch protocol (BatchGenerator: merge, right-padded prompts,
extend, filter, extract): the attention entries are veloxquant's batches, the non-attention state caches
(ArraysCache) mlx-lm's own, passed through; Gemma 4's shared layers read their owners' batches.

Qwen3-Next, Qwen3.5 and Gemma 4 (tiny, random-init, float32): fp16 and kivi batched give every sequence the
tokens it gets alone, logprobs within float tolerance. Jamba's Mamba layers do not batch ragged prompts in
mlx-lm 0.32.2 (with mlx-lm's own caches a padded row's logprobs differ from alone by up to 5.4): there the
fp16 recipe's batch equals mlx-lm's own batch instead, which is all a pass-through can promise."""

import mlx.core as mx
import pytest

import veloxquant as vq

from test_batch import LOGPROB_TOL, MAX_TOKENS, _alone, _batched, _prompts
from test_batch_eviction import _run
from test_layouts import KIVI, gemma4, tiny_jamba, tiny_qwen3_5, tiny_qwen3_next


@pytest.fixture(autouse=True)
def _unhook():
    yield
    vq.uninstall()


def _gemma4():
    return gemma4(mx.float32)


@pytest.mark.parametrize("make", [tiny_qwen3_next, tiny_qwen3_5, _gemma4], ids=["qwen3_next", "qwen3_5", "gemma4"])
@pytest.mark.parametrize("recipe,sets", [("fp16", []), ("kivi", KIVI)], ids=["fp16", "kivi"])
def test_hybrid_batch_equals_alone(make, recipe, sets):
    model = make()
    prompts = _prompts()
    alone = [_alone(model, recipe, p, n, sets) for p, n in zip(prompts, MAX_TOKENS)]
    batched, caches = _batched(model, recipe, prompts, MAX_TOKENS, sets=sets)
    for a, b, p, n, c in zip(alone, batched, prompts, MAX_TOKENS, caches):
        assert [t for t, _ in a] == [t for t, _ in b]
        assert max(float(mx.abs(x - y).max()) for (_, x), (_, y) in zip(a, b)) < LOGPROB_TOL
        ours = [x for x in c if hasattr(x, "tiers")]  # an extracted sequence: its own tokens, at its positions
        assert ours and all(x.offset == len(p) + n and x.rows is None for x in ours)


def test_jamba_batch_equals_mlx_lms_own_batch():
    model = tiny_jamba()
    prompts, steps = _prompts()[:3], 6

    own = _run(model, prompts, [steps] * 3, None)
    ours = _run(model, prompts, [steps] * 3, [vq.make_prompt_cache(model, "fp16") for _ in prompts])
    for a, b in zip(own, ours):
        assert [t for t, _ in a] == [t for t, _ in b]
        assert max(float(mx.abs(x - y).max()) for (_, x), (_, y) in zip(a, b)) < LOGPROB_TOL
