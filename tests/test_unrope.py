"""unrope: pre-RoPE keys from the cache's positions and the model's RoPE settings."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache as mlx_prompt_cache

import veloxquant as vq
from veloxquant.compiler import ModelShape, compile_recipe
from veloxquant.compiler.rebuild import plan_from_dict
from veloxquant.errors import RecipeError
from veloxquant.stages.unrope import Unrope, rope_spec, rotate

from conftest import feed, tiny_gemma3, tiny_llama
from conftest import pipeline_recipe as _recipe


def _check_inverts_every_layer(model, start=37, atol=1e-4):
    x = mx.random.normal((1, 2, 9, model.layers[0].self_attn.rope.dims), key=mx.random.key(3))
    for layer in model.layers:
        spec, why = rope_spec(layer.self_attn.rope)
        assert spec is not None, why
        roped = layer.self_attn.rope(x, offset=start)
        assert float(mx.abs(rotate(roped, spec, start, inverse=True) - x).max()) < atol  # unrope
        assert float(mx.abs(rotate(x, spec, start) - roped).max()) < atol  # re-rope: the model's own RoPE


def test_rope_settings_are_read_per_layer_gemma3_has_two_bases():
    shape = ModelShape.from_model(tiny_gemma3())
    bases = [spec[2] for spec in shape.ropes]
    assert bases == [10000.0, 1000000.0, 10000.0, 1000000.0]  # sliding layers local base, global layers theta
    assert ModelShape.from_model(tiny_llama(layers=2)).ropes[0] == (64, False, 100000.0, 1.0, None)


def test_unrope_then_rerope_is_the_models_rope_on_tiny_llama_and_gemma3():
    _check_inverts_every_layer(tiny_llama(layers=2))
    _check_inverts_every_layer(tiny_gemma3())


def test_llama3_scaled_rope_is_inverted_too():
    from mlx_lm.models.rope_utils import initialize_rope

    rope = initialize_rope(
        64,
        500000.0,
        False,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        4096,
    )
    spec, _ = rope_spec(rope)
    assert spec[2] is None and len(spec[4]) == 32
    x = mx.random.normal((1, 1, 5, 64), key=mx.random.key(0))
    assert float(mx.abs(rotate(rope(x, offset=1000), spec, 1000, inverse=True) - x).max()) < 1e-3


def test_unrope_recovers_the_pre_rope_keys_of_layer_0():
    model = tiny_llama(layers=1)
    tokens = mx.random.randint(0, 500, (1, 24), key=mx.random.key(2))
    cache = mlx_prompt_cache(model)
    model(tokens, cache=cache)
    attn = model.layers[0].self_attn
    h = model.layers[0].input_layernorm(model.model.embed_tokens(tokens))
    pre = attn.k_proj(h).reshape(1, 24, 3, 64).transpose(0, 2, 1, 3)
    spec = ModelShape.from_model(model).ropes[0]
    got = Unrope(_rope=spec).forward(cache[0].keys[:, :, :24], 0)
    assert float(mx.abs(got - pre).max()) < 1e-4


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3])
def test_a_cache_coding_keys_pre_rope_exactly_gives_the_same_logits(tmp_path, make):
    model = make()
    recipe = _recipe(tmp_path, "recent(8)\n>> keys: unrope | identity\n   values: identity")
    plain = _recipe(tmp_path, "recent(8)\n>> identity", "plain")
    tokens = mx.random.randint(0, 500, (1, 40), key=mx.random.key(1))
    caches = vq.make_prompt_cache(model, recipe)
    got = feed(model, tokens, caches, 16)
    ref = feed(model, tokens, vq.make_prompt_cache(model, plain), 16)
    assert float(mx.abs(got - ref).max()) < 2e-3 * float(mx.abs(ref).max())
    k_settled = caches[0].tiers[1].decoded(mx.float32)[0]
    raw = caches[0].tiers[1].buffers["k"]["x"].view()
    assert float(mx.abs(k_settled - raw).max()) > 1e-2  # it really holds other (pre-RoPE) values


def test_unrope_settings_enter_the_plan_and_survive_json(tmp_path):
    model = tiny_gemma3()
    plan = vq.runtime.make.plan_for(
        model, _recipe(tmp_path, "recent(8)\n>> keys: unrope | affine(bits=4)\n   values: affine(bits=4)")
    )
    again = plan_from_dict(plan.to_dict(), plan.recipe)
    assert again.fingerprint == plan.fingerprint
    assert again.layers[1].tiers[1].keys.transforms[0]._rope[2] == 1000000.0
    assert "unrope | affine" in plan.layers[0].tiers[1].keys.text()  # the bound settings are not printed


def test_unrope_misuse_is_located(tmp_path):
    with pytest.raises(RecipeError, match="only keys carry") as e:
        compile_recipe(
            _recipe(tmp_path, "recent(8)\n>> unrope | affine(bits=4)"), ModelShape.from_model(tiny_llama(layers=1))
        )
    assert "r.yaml:5:6" in str(e.value.location)
    with pytest.raises(RecipeError, match="different tokens in each head"):
        compile_recipe(
            _recipe(tmp_path, "evict(budget=16) | keys: unrope | affine(bits=4) values: fp16"),
            ModelShape.from_model(tiny_llama(layers=1)),
        )
    bare = ModelShape.uniform("bare", 2, 3, 64)
    with pytest.raises(RecipeError, match="carries no RoPE settings"):
        compile_recipe(_recipe(tmp_path, "recent(8)\n>> keys: unrope | affine(bits=4)\n   values: fp16"), bare)
    odd = ModelShape("odd", (3,), (64,), (None,), ("its RoPE is YarnRoPE, which also rescales the keys",))
    with pytest.raises(RecipeError, match="YarnRoPE"):
        compile_recipe(_recipe(tmp_path, "recent(8)\n>> keys: unrope | affine(bits=4)\n   values: fp16"), odd)


@pytest.mark.slow
@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_real_models_unrope_then_rerope_equals_their_keys(which):
    from veloxquant.data import load_text
    from veloxquant.models import load_model

    model, tokenizer = load_model(None if which == "smollm2" else "gemma3")
    _check_inverts_every_layer(model, start=1500, atol=2e-3)
    tokens = mx.array(tokenizer.encode(load_text("austen"))[:300])[None]
    cache = mlx_prompt_cache(model)
    model(tokens, cache=cache)
    shape = ModelShape.from_model(model)
    for i, c in enumerate(cache):
        k = c.keys[:, :, :300].astype(mx.float32)
        back = rotate(rotate(k, shape.ropes[i], 0, inverse=True), shape.ropes[i], 0)
        assert float(mx.abs(back - k).max()) < 1e-3 * float(mx.abs(k).max()) + 1e-3, i
