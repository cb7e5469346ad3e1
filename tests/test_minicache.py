"""MiniCache: pairs of layers share one SLERP direction per token through the cross-layer coordinator."""

import mlx.core as mx
import pytest

import veloxquant as vq
from veloxquant.compiler import ModelShape, compile_recipe
from veloxquant.compiler.explain import render
from veloxquant.kernels.partials import partial_attention
from veloxquant.recipe import load_recipe
from veloxquant.runtime.cache import TieredCache
from veloxquant.runtime.kinds.merged_side import MergedSide
from veloxquant.runtime.persist import load_prompt_cache, save_prompt_cache
from veloxquant.stages.slerp import Slerp

from conftest import feed, tiny_llama

TOKENS = mx.random.randint(0, 500, (1, 200), key=mx.random.key(5))
SETS = ["start=0", "window=32"]


def settled(caches):
    for c in caches:  # in layer order, as the next step would: every reuse layer merges its last chunk
        c._settle()
    return caches


def prompt(model, sets=()):
    caches = vq.make_prompt_cache(model, "minicache", SETS + list(sets))
    model(TOKENS[:, :150], cache=caches)
    return settled(caches)


def test_merge_arithmetic():
    a = mx.random.normal((1, 2, 5, 8), key=mx.random.key(1))
    e, ma, mb, d = Slerp().merge(a, 3 * a)  # one direction: shared exactly, distance 0
    assert float(mx.abs(ma * e - a).max()) < 1e-5 and float(mx.abs(mb * e - 3 * a).max()) < 1e-5
    assert float(d.max()) < 1e-3
    b = mx.random.normal((1, 2, 5, 8), key=mx.random.key(2))
    e0, ma, _, d = Slerp(t=0.0).merge(a, b)  # t=0: the anchor's own direction
    assert float(mx.abs(ma * e0 - a).max()) < 1e-5
    e, *_ = Slerp(t=0.5).merge(a, b)  # the midpoint: unit, equally far from both
    ua, ub = a / mx.linalg.norm(a, axis=-1, keepdims=True), b / mx.linalg.norm(b, axis=-1, keepdims=True)
    assert float(mx.abs(mx.linalg.norm(e, axis=-1) - 1).max()) < 1e-5
    assert float(mx.abs(mx.sum(e * ua, -1) - mx.sum(e * ub, -1)).max()) < 1e-5
    assert 0.0 < float(d.min()) and float(d.max()) < 1.0


def test_lone_slerp_layers_are_a_lossless_passthrough():
    model = tiny_llama()
    ref = feed(model, TOKENS, vq.make_prompt_cache(model, "fp16"), 50)
    grouped_none = feed(model, TOKENS, vq.make_prompt_cache(model, "minicache", ["start=1", "window=32"]), 50)
    plan = compile_recipe(load_recipe("minicache"), ModelShape.from_model(model), SETS)
    lone = feed(model, TOKENS, [TieredCache(layer) for layer in plan.layers], 50)  # no coordinator
    for out in (grouped_none, lone):
        assert float(mx.abs(out - ref).max()) < 1e-4


def test_unmerged_tokens_keep_both_layers_exact():
    model = tiny_llama()
    ref = feed(model, TOKENS, vq.make_prompt_cache(model, "fp16"), 50)
    caches = vq.make_prompt_cache(model, "minicache", SETS + ["threshold=0"])
    out = feed(model, TOKENS, caches, 50)
    assert float(mx.abs(out - ref).max()) < 5e-3  # float16 magnitude x direction
    reuse = caches[1].tiers[1].sides["k"]
    assert reuse.role == "reuse" and reuse.bufs["ret"].used == reuse.merged > 0


def test_partial_equals_attention_over_the_rebuilt_kv():
    model = tiny_llama()
    caches = prompt(model, ["threshold=0.5"])  # random layers are ~90 degrees apart: a mix of both kinds
    reuse = caches[1].tiers[1].sides["k"]
    assert 0 < reuse.bufs["ret"].used < reuse.merged
    q = mx.random.normal((1, 9, 3, 64), key=mx.random.key(2))
    mask = mx.random.uniform(shape=(3, caches[0].tiers[1].count), key=mx.random.key(3)) > 0.3
    for c in caches:
        tier = c.tiers[1]
        for m in (None, mask):
            out, lse = tier.partial(q, 0.125, m)
            ref, ref_lse = partial_attention(q, *tier.decoded(mx.float32), 0.125, m)
            assert float(mx.abs(out - ref).max()) < 1e-4 and float(mx.abs(lse - ref_lse).max()) < 1e-4


def test_the_pair_reads_one_direction_array_held_by_the_anchor():
    model = tiny_llama()
    caches = prompt(model, ["threshold=1"])
    anchor, reuse = (c.tiers[1] for c in caches[:2])
    assert anchor.count == reuse.count > 0 and anchor.sides["k"].bufs["x"].used == 0  # the fp16 copy is freed
    assert "k.dir" in anchor.arrays() and not any(n.endswith(".dir") or n.endswith(".x") for n in reuse.arrays())
    assert reuse.sides["k"]._direction().shape == anchor.sides["k"].view("dir").shape
    reuse_bytes = sum(a.nbytes for a in reuse.arrays().values())
    assert reuse.nbytes == reuse_bytes < anchor.nbytes / 20  # magnitudes and flags only: nothing retained
    fp16 = 2 * 2 * anchor.count * 3 * 64
    assert (anchor.nbytes + reuse.nbytes) < 0.55 * 2 * fp16


def test_decode_never_rebuilds_kv(monkeypatch):
    model = tiny_llama()
    caches = prompt(model, ["threshold=0.5"])
    monkeypatch.setattr(MergedSide, "decoded", lambda *a: (_ for _ in ()).throw(AssertionError("rebuilt")))
    feed(model, TOKENS[:, 150:160], caches, 1)


def test_saved_pair_continues_identically(tmp_path):
    model = tiny_llama()
    caches = prompt(model, ["threshold=0.5"])
    save_prompt_cache(tmp_path / "m.safetensors", caches)
    loaded, _ = load_prompt_cache(tmp_path / "m.safetensors", expect_fingerprint=caches[0].fingerprint)
    for c, d in zip(caches, loaded):
        a, b = c.tiers[1].arrays(), d.tiers[1].arrays()
        assert a.keys() == b.keys() and all(mx.array_equal(a[n], b[n]) for n in a)
    a = feed(model, TOKENS[:, 150:], caches, 1)
    b = feed(model, TOKENS[:, 150:], loaded, 1)
    assert float(mx.abs(a - b).max()) == 0.0


def test_explain_shows_the_pairs_from_the_start_depth():
    model = tiny_llama(layers=8)
    text = render(compile_recipe(load_recipe("minicache"), ModelShape.from_model(model)))
    assert "cross-layer groups (slerp" in text and "layers 4-5:" in text and "layers 6-7:" in text
    assert "layers 0-1:" not in text


def gemma_with_sliding_pairs():
    """Layers 0-2 slide (a window of 64), layer 3 is global: one sliding pair, 0-1."""
    from mlx_lm.models import gemma3_text

    args = gemma3_text.ModelArgs(
        model_type="gemma3_text",
        hidden_size=128,
        num_hidden_layers=4,
        intermediate_size=256,
        num_attention_heads=2,
        head_dim=64,
        num_key_value_heads=1,
        vocab_size=500,
        sliding_window=64,
        sliding_window_pattern=4,
    )
    mx.random.seed(1)
    return gemma3_text.Model(args)


def test_sliding_pairs_expire_together_and_stay_exact_when_unmerged():
    model = gemma_with_sliding_pairs()
    text = render(compile_recipe(load_recipe("minicache"), ModelShape.from_model(model), SETS))
    assert "layers 0-1:" in text and "layers 2-3:" not in text  # a group never spans two windows
    assert "layer 2:" not in text  # a layer without a partner is no group (a passthrough)
    ref = feed(model, TOKENS, vq.make_prompt_cache(model, "fp16"), 50)
    caches = vq.make_prompt_cache(model, "minicache", SETS + ["threshold=0"])
    out = feed(model, TOKENS, caches, 50)
    assert float(mx.abs(out - ref).max()) < 5e-3
    caches = vq.make_prompt_cache(model, "minicache", SETS + ["threshold=0.5"])
    feed(model, TOKENS, caches, 50)
    feed(model, TOKENS[:, :40], caches, 1)  # decode past the window: old tokens expire from both layers
    anchor, reuse = (c.tiers[1] for c in settled(caches)[:2])
    assert anchor.start == reuse.start > 0 and anchor.count == reuse.count
    q = mx.random.normal((1, 2, 1, 64), key=mx.random.key(2))
    for tier in (anchor, reuse):
        o, lse = tier.partial(q, 0.125)
        r, rl = partial_attention(q, *tier.decoded(mx.float32), 0.125)
        assert float(mx.abs(o - r).max()) < 1e-4 and float(mx.abs(lse - rl).max()) < 1e-4


def test_bad_group_size_is_a_clear_error():
    model = tiny_llama()
    with pytest.raises(vq.RecipeError if hasattr(vq, "RecipeError") else Exception, match="pairs"):
        vq.make_prompt_cache(model, "minicache", ["group_size=3"])
