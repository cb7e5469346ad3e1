"""Same tokens, same cache (issue 35): what a cache holds must not depend on how the tokens arrive
(one block, prefill chunks, multi-token chunks after the prompt, one at a time), and `nbytes` is
every array the cache keeps alive (walked from its attributes; storage shared by views counted once).

The random-init model runs a scaled feed (448 tokens: (a) one 447-token block + one decode step,
(b) 3 x 128 + 8 x 8, (c) a 384 prefix then 64 single steps) so the non-slow part stays fast; the
default model runs the issue's 1,792 tokens with (c) as 256 single steps after a 1,536 prefix
(1,280 single steps per recipe would take minutes each on the CPU)."""
import mlx.core as mx
import numpy as np
import pytest

import veloxquant
from conftest import tiny_llama
from veloxquant.artifacts import CalibrationError
from veloxquant.recipe.load import builtin_names
from veloxquant.runtime.make import plan_for

TINY = dict(total=448, prefix=384, first=128, later=8)
DEFAULT = dict(total=1792, prefix=1536, first=512, later=32)


def _storage(a: mx.array):
    """The byte span [start, end) of an evaluated array's storage (a slice shares its base's)."""
    view = np.asarray(memoryview(a))
    if view.size == 0:
        return None
    start = view.__array_interface__["data"][0]
    span = sum((n - 1) * abs(s) for n, s in zip(view.shape, view.strides)) + view.itemsize
    return start, start + span


def reachable_bytes(roots) -> int:
    """Bytes of every distinct storage reachable from the roots' attributes (recursively)."""
    spans, stack, visited = [], list(roots), set()
    while stack:
        o = stack.pop()
        if isinstance(o, mx.array):
            mx.eval(o)
            s = _storage(o)
            if s is not None:
                spans.append(s)
            continue
        if isinstance(o, (str, bytes, int, float, bool, type(None))) or id(o) in visited:
            continue
        visited.add(id(o))
        if isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)):
            stack.extend(o)
        elif type(o).__module__.startswith("veloxquant"):
            stack.extend(getattr(o, "__dict__", {}).values())
            stack.extend(getattr(o, s) for s in getattr(type(o), "__slots__", ()) if hasattr(o, s))
    total, end = 0, 0
    for a, b in sorted(spans):  # the union of the spans
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _feed(model, recipe, ids, blocks):
    caches = veloxquant.make_prompt_cache(model, recipe)
    at = 0
    for n in blocks:
        mx.eval(model(ids[:, at:at + n], cache=caches))
        at += n
    mx.eval([c.state for c in caches])
    return caches


def feeds(s):
    later = s["total"] - s["prefix"]
    return {"block": [s["total"] - 1, 1],
            "chunks": [s["first"]] * (s["prefix"] // s["first"]) + [s["later"]] * (later // s["later"]),
            "singles": [s["prefix"]] + [1] * later}


def _once(caches) -> bool:
    return any(getattr(t, "route", None) is not None and getattr(t.route, "once", False) and t.scorer is not None
               for c in caches for t in c.tiers if getattr(t, "per_head", False))


def check(model, recipe, s):
    try:
        plan_for(model, recipe)
    except CalibrationError as e:
        pytest.skip(str(e))
    ids = mx.random.randint(0, 500, (1, s["total"]), key=mx.random.key(3))
    runs = {name: _feed(model, recipe, ids, blocks) for name, blocks in feeds(s).items()}
    attn = model.layers[0].self_attn
    slack = 64 * 2 * 2 * attn.n_kv_heads * attn.head_dim * len(model.layers)  # one 64-token fp16 group per layer
    held = {name: sum(c.nbytes for c in caches) for name, caches in runs.items()}
    for name, caches in runs.items():
        assert reachable_bytes(caches) == held[name], (recipe, name, "arrays outside nbytes")
    if _once(runs["block"]):
        # The decision is made at the prompt's end, which differs by feed (the block's at its last
        # token, the singles' after the prefix, the chunks' only when told: docs/eviction.md).
        # Told, the chunks hold no more than the block, which decided one token before its end.
        for c in runs["chunks"]:
            c.finish_prompt()
        chunks = sum(c.nbytes for c in runs["chunks"])
        assert chunks <= held["block"] + slack and held["block"] <= held["singles"], (recipe, held, chunks)
        assert reachable_bytes(runs["chunks"]) == chunks
        return held
    lo, hi = min(held.values()), max(held.values())
    assert hi - lo <= slack, (recipe, held)
    return held


RECIPES = builtin_names()


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(layers=2)


# Measured gaps still open (issue 35), strict: a fix makes them fail until the entry goes.
KNOWN = {"amc": "chunks after the prompt hold more than one block or single steps",
         **{r: "arrays reachable from the cache outside nbytes" for r in
            ("adakv", "anchorkv", "kvtc", "nestedkv", "palu", "squeezeattention", "svdq", "xkv")}}


def _known_gaps(recipes):
    return [pytest.param(r, marks=pytest.mark.xfail(reason=KNOWN[r], strict=True)) if r in KNOWN else r
            for r in recipes]


@pytest.mark.parametrize("recipe", _known_gaps(RECIPES))
def test_same_tokens_same_cache_tiny(tiny, recipe):
    check(tiny, recipe, TINY)


@pytest.mark.slow
def test_two_turn_chat_snapkv_decides_again():
    """Turn 2 appended to a held cache through mlx_lm.generate (the prompt cache reused): snapkv
    decides again over what it held plus the new turn, so after turn 2 it holds at most its budget
    plus the tokens decoded since the decision."""
    import mlx_lm
    from veloxquant.data.corpus import austen_text
    from veloxquant.models import load_model
    model, tok = load_model()
    budget, decode = 128, 8
    caches = veloxquant.make_prompt_cache(model, "snapkv", sets=[f"budget={budget}"])
    text = austen_text()
    for turn in (text[:2000], text[2000:4000]):
        mlx_lm.generate(model, tok, turn, max_tokens=decode, prompt_cache=caches)
        # + 1: the prompt's last token is fed alone, after the decision it triggers
        assert max(c.size() for c in caches) <= budget + 1 + decode
    assert caches[0].offset > 2 * budget


@pytest.fixture(scope="module")
def smollm2():
    from veloxquant.models import load_model
    return load_model()[0]


@pytest.mark.long  # minutes per recipe on a 2-core CPU: `python -m pytest -m long tests/test_chunk_invariance.py`
@pytest.mark.parametrize("recipe", _known_gaps(RECIPES))
def test_same_tokens_same_cache_default(smollm2, recipe):
    check(smollm2, recipe, DEFAULT)
