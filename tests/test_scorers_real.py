"""The pinned reductions and knorm's path independence on SmolLM2 (slow): same kept sets, same logits."""

import mlx.core as mx
import numpy as np
import pytest

import veloxquant

from conftest import feed

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    from veloxquant.data import load_text
    from veloxquant.models import load_model

    model, tokenizer = load_model()
    return model, mx.array(tokenizer.encode(load_text("austen"))[:200])[None]


@pytest.mark.parametrize(
    "name, sets, target",
    [("keyformer", ["tau=0"], "h2o"), ("chunkkv", ["chunk=1"], "h2o"), ("morphkv", ["window=1"], "tova")],
)
def test_reductions_on_smollm2(smollm2, name, sets, target):
    model, tokens = smollm2
    runs = []
    for n, s in ((name, sets), (target, [])):
        caches = veloxquant.make_prompt_cache(model, n, ["budget=64", *s])
        logits = np.array(feed(model, tokens[:, :160], caches, 64))  # prefill chunks, then decode steps
        logits = np.concatenate([logits, np.array(feed(model, tokens[:, 160:], caches, 1))], axis=1)
        runs.append((logits, [np.array(c.tiers[0].positions) for c in caches]))
    assert np.array_equal(runs[0][0], runs[1][0])
    assert all(np.array_equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))


def test_knorm_path_independent_on_smollm2(smollm2):
    """Layer 0's keys do not depend on what was evicted: one block or token by token, same kept set."""
    model, tokens = smollm2
    kept = []
    for chunk in (tokens.shape[1], 1):
        caches = veloxquant.make_prompt_cache(model, "knorm", ["budget=48"])
        feed(model, tokens, caches, chunk)
        caches[0]._settle()
        kept.append(np.array(caches[0].tiers[0].positions))
    assert np.array_equal(kept[0], kept[1])
