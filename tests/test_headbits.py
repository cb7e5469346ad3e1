"""headbits / adakv_bits: a code width per kv head from real attention; pinned reductions to kivi."""

import mlx.core as mx
import numpy as np
import pytest

import veloxquant as vq
from veloxquant.compiler import SMOLLM2_135M, ModelShape, compile_recipe
from veloxquant.errors import RecipeError
from veloxquant.recipe import load_recipe
from veloxquant.runtime.cache import TieredCache
from veloxquant.stages.headbits import HeadBits, allocate
from veloxquant.stages.store import Affine

from conftest import feed


def test_allocation_meets_the_target_highest_entropy_first():
    assert list(allocate(np.array([0.5, 2.0, 1.0]), [2, 3, 4], 3.0)) == [2, 4, 3]
    bits = allocate(np.array([0.1, 0.9, 0.3, 0.7]), [2, 3, 4], 2.5)
    assert bits.mean() <= 2.5 and bits[1] == 4 and bits[0] == 2


@pytest.mark.parametrize(
    "entropy,target,width",
    [
        ([1.0, 1.0, 1.0], 3.0, 3),
        ([1.0, 1.0, 1.0], 3.5, 3),
        ([0.1, 0.5, 0.9], 2.0, 2),
        ([0.1, 0.5, 0.9], 4.0, 4),
        ([0.1, 0.5, 0.9], 9.0, 4),
        ([0.1, 0.5, 0.9], 1.0, 2),
    ],
)
def test_tied_heads_or_a_target_out_of_range_give_one_width(entropy, target, width):
    assert list(allocate(np.array(entropy), [2, 3, 4], target)) == [width] * 3


def test_one_width_is_affine_bit_for_bit():
    x = mx.random.normal((1, 3, 64, 64), key=mx.random.key(0))
    for axis in ("channel", "token"):
        hb = HeadBits(target=3.0, axis=axis)
        fitted = hb.fit(x, mx.array([1.0, 1.0, 1.0]))
        enc = hb.encode(x, fitted)
        ref = Affine(bits=3, group=32, axis=axis).encode(x)
        assert mx.array_equal(enc["mid.codes"], ref["codes"]) and enc["lo.codes"].shape[1] == 0
        assert mx.array_equal(enc["scales"], ref["scales"]) and mx.array_equal(enc["zeros"], ref["zeros"])
        assert mx.array_equal(hb.decode(enc, mx.float32, fitted), Affine(3, 32, axis).decode(ref, mx.float32))


def test_mixed_widths_round_trip_per_head():
    x = mx.random.normal((1, 3, 64, 64), key=mx.random.key(1))
    hb = HeadBits(target=3.0)
    fitted = hb.fit(x, mx.array([0.5, 2.0, 1.0]))
    got = hb.decode(hb.encode(x, fitted), mx.float32, fitted)
    for h, bits in enumerate([2, 4, 3]):
        ref = Affine(bits=bits, group=32, axis="channel")
        assert mx.array_equal(got[:, h : h + 1], ref.decode(ref.encode(x[:, h : h + 1]), mx.float32))


@pytest.mark.parametrize("sets", [["target=2"], ["target=3", "lo=3", "mid=3", "hi=3"]])
def test_adakv_bits_out_of_range_target_is_kivi_bit_for_bit(sets, llama_model):
    """Fed the same K/V and queries, the coded tier holds kivi's arrays and decodes to kivi's values."""
    vq.install(llama_model)  # scored caches refuse steps while no attention is routed; this test calls attend itself
    shape = ModelShape.uniform("t", 1, 3, 64)
    bits = "2" if sets == ["target=2"] else "3"
    ada = TieredCache(compile_recipe(load_recipe("adakv_bits"), shape, sets + ["sinks=0"]).layers[0])
    kivi = TieredCache(compile_recipe(load_recipe("kivi"), shape, [f"bits={bits}"]).layers[0])
    rng = np.random.default_rng(0)
    for _ in range(5):
        k, v = (mx.array(rng.normal(size=(1, 3, 64, 64)).astype(np.float32)) for _ in range(2))
        q = mx.array(rng.normal(size=(1, 9, 64, 64)).astype(np.float32))
        for c in (ada, kivi):
            c.update_and_fetch(k, v)
            c.attend(q, scale=0.125)
    ada._settle(), kivi._settle()
    assert ada.tiers[2].count == kivi.tiers[1].count == 192
    role = "lo"  # the heads' width is lo's (with lo=mid=hi=3, the first role holds them)
    a, b = ada.tiers[2].arrays(), kivi.tiers[1].arrays()
    for side in ("k", "v"):
        assert mx.array_equal(a[f"{side}.{role}.codes"], b[f"{side}.codes"])
        assert mx.array_equal(a[f"{side}.scales"], b[f"{side}.scales"])
    for got, want in zip(ada.tiers[2].decoded(mx.float32), kivi.tiers[1].decoded(mx.float32)):
        assert mx.array_equal(got, want)


def test_allocation_is_held_saved_and_counted(tmp_path, llama_model):
    tokens = mx.random.randint(0, 500, (1, 300), key=mx.random.key(3))
    caches = vq.make_prompt_cache(llama_model, "adakv_bits")
    feed(llama_model, tokens[:, :260], caches, 64)
    bits = [np.array(c.tiers[2].codecs["k"].fitted["bits"]) for c in caches]
    assert all(sorted(b) == [2, 3, 4] for b in bits)  # three distinct heads: one of each width, mean 3
    c = caches[0]
    c._settle()
    assert "k.fit.bits" in c.tiers[2].arrays() and c.nbytes == sum(t.nbytes for t in c.tiers)
    path = tmp_path / "c.safetensors"
    vq.save_prompt_cache(str(path), caches)
    loaded, _ = vq.load_prompt_cache(str(path))
    assert mx.array_equal(feed(llama_model, tokens[:, 260:], caches, 8), feed(llama_model, tokens[:, 260:], loaded, 8))


def test_headbits_misuse_is_located(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("veloxquant: 1\nname: r\npipeline: |\n  recent(32)\n  >> headbits(lo=4, mid=3, hi=2)\n")
    with pytest.raises(RecipeError, match="widths must rise") as e:
        compile_recipe(load_recipe(str(path)), SMOLLM2_135M)
    assert "r.yaml:5:6" in str(e.value.location)
    with pytest.raises(RecipeError, match="needs the attention hook"):
        compile_recipe(load_recipe("adakv_bits"), SMOLLM2_135M, hook=False)
