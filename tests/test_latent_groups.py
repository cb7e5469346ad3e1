"""xKV: one latent basis shared by a group of adjacent layers through the cross-layer coordinator."""

import mlx.core as mx

import veloxquant as vq
from veloxquant.compiler import ModelShape, compile_recipe
from veloxquant.compiler.explain import render
from veloxquant.kernels.partials import partial_attention
from veloxquant.recipe import load_recipe
from veloxquant.runtime.persist import load_prompt_cache, save_prompt_cache

from conftest import feed, tiny_gemma3, tiny_llama

TOKENS = mx.random.randint(0, 500, (1, 200), key=mx.random.key(5))
SVDQ_LIKE = ["rank=0", "energy=0.95", "hi_bits=4", "lo_bits=4", "window=32"]


def test_a_group_of_one_is_svdq_bit_for_bit():
    model = tiny_llama()
    shape = ModelShape.from_model(model)
    xkv = compile_recipe(load_recipe("xkv"), shape, ["group_size=1", "window=32"])
    svdq = compile_recipe(load_recipe("svdq"), shape, SVDQ_LIKE)
    assert xkv.fingerprint == svdq.fingerprint
    a = feed(model, TOKENS, vq.make_prompt_cache(model, "xkv", ["group_size=1", "window=32"]), 50)
    b = feed(model, TOKENS, vq.make_prompt_cache(model, "svdq", SVDQ_LIKE), 50)
    assert mx.array_equal(a, b)


def prompt(model, sets=("window=32",)):
    caches = vq.make_prompt_cache(model, "xkv", list(sets))
    model(TOKENS[:, :150], cache=caches)
    for c in caches:
        c.finish_prompt()
    return caches


def test_the_group_shares_one_basis_held_by_the_anchor():
    model = tiny_llama()
    caches = prompt(model)
    anchor, member = (c.tiers[1].sides["k"] for c in caches[:2])
    assert anchor.fitted["basis"] is member.fitted["basis"]  # one array, fitted on both layers' keys
    assert "k.basis" in caches[0].tiers[1].arrays() and "k.basis" not in caches[1].tiers[1].arrays()
    basis_bytes = anchor.fitted["basis"].nbytes + anchor.fitted["mean"].nbytes + anchor.fitted["widths"].nbytes
    assert caches[0].tiers[1].nbytes - caches[1].tiers[1].nbytes == basis_bytes
    q = mx.random.normal((1, 9, 2, 64), key=mx.random.key(2))
    for c in caches[:2]:  # each layer attends from its own latents on the shared basis
        out, lse = c.tiers[1].partial(q, 0.125)
        ref, ref_lse = partial_attention(q, *c.tiers[1].decoded(mx.float32), 0.125)
        assert float(mx.abs(out - ref).max()) < 1e-4 and float(mx.abs(lse - ref_lse).max()) < 1e-4


def test_saved_group_continues_identically(tmp_path):
    model = tiny_llama()
    caches = prompt(model)
    save_prompt_cache(tmp_path / "x.safetensors", caches)
    loaded, _ = load_prompt_cache(tmp_path / "x.safetensors", expect_fingerprint=caches[0].fingerprint)
    for c, d in zip(caches, loaded):  # the same arrays; members saved no basis and took the anchor's back
        a, b = c.tiers[1].arrays(), d.tiers[1].arrays()
        assert a.keys() == b.keys() and all(mx.array_equal(a[n], b[n]) for n in a)
    assert loaded[1].tiers[1].sides["k"].fitted["basis"] is loaded[0].tiers[1].sides["k"].fitted["basis"]
    a = feed(model, TOKENS[:, 150:], caches, 1)
    b = feed(model, TOKENS[:, 150:], loaded, 1)
    assert float(mx.abs(a - b).max()) == 0.0


def test_explain_shows_the_groups_and_sliding_layers_keep_their_own_basis():
    model = tiny_gemma3(window=64)
    text = render(compile_recipe(load_recipe("xkv"), ModelShape.from_model(model)))
    assert "cross-layer groups (latent" in text
    out = feed(model, TOKENS, vq.make_prompt_cache(model, "xkv", ["window=32"]), 50)
    assert not bool(mx.isnan(out).any())
