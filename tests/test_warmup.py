"""runtime/warmup.py: the warm-up launches every kernel variant a later generation of the
same shape launches. Checked on any machine: the dispatch is told the backend is CUDA and
every launch is answered by zeros (kernels/variants.stand_in), so the real bindings choose
their kernels, plans and templates, and `variants.recording` sees what they ask for."""

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from veloxquant.kernels import dispatch, variants
from veloxquant.runtime import make_prompt_cache, uninstall
from veloxquant.runtime.warmup import warmup

from conftest import tiny_llama


@pytest.fixture
def as_cuda(monkeypatch):
    monkeypatch.setattr(dispatch, "backend", lambda: "cuda")
    with variants.stand_in():
        yield


def decode_variants(model, recipe, context, tokens):
    """The variants launched by the decode steps (not the prefill) of one generation."""
    prompt = mx.random.randint(0, 500, (context,), key=mx.random.key(7))
    cache = make_prompt_cache(model, recipe)
    try:
        steps = generate_step(prompt, model, max_tokens=tokens, prompt_cache=cache)
        next(steps)  # the prefill and the first token
        with variants.recording() as seen:
            for _ in steps:
                pass
    finally:
        uninstall(model)
    return seen


@pytest.mark.parametrize("recipe", ["kivi", "kivi_sink"])
def test_warmup_launches_what_a_generation_does(as_cuda, recipe):
    model = tiny_llama(mx.float16, layers=2)
    later = decode_variants(model, recipe, 700, 80)
    assert later, "no kernel was asked for: the dispatch did not route to CUDA"
    warmed, _ = warmup(model, recipe, context=700)
    assert later <= warmed, f"not warmed: {later - warmed}"


def test_warmup_at_another_context_misses_variants(as_cuda):
    """The check can fail: a warm-up too short to cross kivi's window spill misses variants."""
    model = tiny_llama(mx.float16, layers=2)
    later = decode_variants(model, "kivi", 700, 80)
    warmed, _ = warmup(model, "kivi", context=8, decode=1)
    assert not later <= warmed


def test_warmup_rejects_bad_shape():
    with pytest.raises(ValueError, match="context"):
        warmup(tiny_llama(layers=1), "kivi", context=1)
