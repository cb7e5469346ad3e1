"""Deferred scoring (runtime/eviction/deferred.py): with `slack`, decode queries are held and scored in one
block before a cut. Pinned here: the same kept tokens, scores and logits as scoring every step,
through a real model; held queries count in nbytes, are scored into saved files, and a trim forgets
the newest; and a decode step between cuts computes no explicit softmax."""

import mlx.core as mx
import numpy as np
import pytest

import veloxquant
from veloxquant.runtime.eviction import deferred, per_head, scoring
from veloxquant.runtime.persist import load_prompt_cache, save_prompt_cache

from conftest import tiny_llama

PROMPT = mx.array(np.random.default_rng(3).integers(0, 500, (1, 40)))
SETS = ["budget=16", "sinks=2", "slack=5"]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(layers=2)


def decode(model, caches, steps, first=None):
    """Greedy decode `steps` tokens after the prompt (or after `first`); logits of each step."""
    y = mx.argmax(model(PROMPT, cache=caches)[:, -1:], axis=-1) if first is None else first
    out = []
    for _ in range(steps):
        logits = model(y, cache=caches)[:, -1]
        out.append(np.array(logits))
        y = mx.argmax(logits, axis=-1)[:, None]
    return out, y


def held(caches):
    for c in caches:
        c._settle()
    tiers = [t for c in caches for t in c.tiers if getattr(t, "per_head", False)]
    return [np.array(t.positions) for t in tiers], [np.array(t.scores) for t in tiers]


@pytest.mark.parametrize("recipe", ["h2o", "tova", "morphkv", "chunkkv", "keyformer", "curdkv", "cam"])
def test_held_queries_score_as_every_step_would(model, monkeypatch, recipe):
    lazy = veloxquant.make_prompt_cache(model, recipe, SETS)
    lazy_logits, _ = decode(model, lazy, 23)
    with monkeypatch.context() as m:
        m.setattr(deferred, "defers", lambda *a: False)
        eager = veloxquant.make_prompt_cache(model, recipe, SETS)
        eager_logits, _ = decode(model, eager, 23)
    for c in lazy:
        per_head.score_held(c)  # what is still held is scored too, so the scores compare
    (lp, ls), (ep, es) = held(lazy), held(eager)
    for a, b in zip(lp, ep):
        np.testing.assert_array_equal(a, b)  # the same tokens kept, in every head
    for a, b in zip(ls, es):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.stack(lazy_logits), np.stack(eager_logits), atol=1e-4)


def test_decode_between_cuts_builds_no_explicit_softmax(model, monkeypatch):
    caches = veloxquant.make_prompt_cache(model, "h2o", SETS)
    decode(model, caches, 7)  # past the first cut after the prompt
    calls = []
    monkeypatch.setattr(scoring, "attention_weights", lambda *a, **k: calls.append(1))
    y = mx.array([[1]])
    model(y, cache=caches)  # one step, no cut due: SDPA, the query held
    assert calls == [] and all(len(c.held_queries) > 0 for c in caches)


def test_held_queries_count_are_saved_scored_and_trimmed(model, tmp_path):
    caches = veloxquant.make_prompt_cache(model, "h2o", SETS)
    _, y = decode(model, caches, 8)
    c = caches[0]
    n = len(c.held_queries)
    assert n > 0
    assert c.nbytes == sum(t.nbytes for t in c.tiers) + sum(q.nbytes for q in c.held_queries)
    path = tmp_path / "h2o.safetensors"
    save_prompt_cache(str(path), caches)
    assert all(not x.held_queries for x in caches)  # scored into the saved scores
    loaded, _ = load_prompt_cache(str(path))
    want, _ = decode(model, caches, 9, y)
    got, _ = decode(model, loaded, 9, y)
    np.testing.assert_allclose(np.stack(got), np.stack(want), atol=1e-5)
    n = len(c.held_queries)  # the steps after saving hold theirs again
    assert n > 1
    deferred.rewind(c, 1)
    assert len(c.held_queries) == n - 1
