"""Latent tiers (svdq, palu, kvtc): basis fitted at the end of the prompt, attention in latent space."""

import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import veloxquant as vq
from veloxquant.compiler import ModelShape, compile_recipe
from veloxquant.errors import RecipeError
from veloxquant.kernels.partials import partial_attention
from veloxquant.recipe import load_recipe
from veloxquant.runtime.kinds import latent_side, latent_tier
from veloxquant.runtime.make import caches_for
from veloxquant.runtime.persist import load_prompt_cache, save_prompt_cache
from veloxquant.stages.bit_alloc import allocate
from veloxquant.stages.latent import Latent, lloyd_distortions

from conftest import feed, tiny_gemma3, tiny_llama

SHAPE = ModelShape.uniform("one", 1, 3, 64)
TOKENS = mx.random.randint(0, 500, (1, 200), key=mx.random.key(3))


DIR = Path(tempfile.mkdtemp())


def from_text(text):
    path = DIR / f"r{abs(hash(text))}.yaml"
    path.write_text(text)
    return load_recipe(str(path))


def recipe_text(keys, values="fp16", window=32):
    return from_text(
        f"veloxquant: 1\nname: t\npipeline: |\n  recent({window})\n  >> keys: {keys}\n     values: {values}\n"
    )


def lowrank(L, rank, seed):
    """[1, 3, L, 64] vectors of exactly `rank` dimensions per head, plus a little noise."""
    a = mx.random.normal((1, 3, L, rank), key=mx.random.key(seed))
    b = mx.random.normal((1, 3, rank, 64), key=mx.random.key(seed + 1))
    return a @ b + 0.01 * mx.random.normal((1, 3, L, 64), key=mx.random.key(seed + 2))


def filled(keys, values="fp16", L=160, sets=()):
    cache = caches_for(compile_recipe(recipe_text(keys, values), SHAPE, sets))[0]
    cache.update_and_fetch(lowrank(L, 12, 1), lowrank(L, 20, 5))
    cache.finish_prompt()
    return cache


# --- the bit allocator (KVTC's DP) --------------------------------------------------------------


def test_equal_variances_get_floor_of_budget_and_the_remainder_goes_first():
    assert allocate([1.0] * 4, 10, range(9)).tolist() == [3, 3, 2, 2]
    assert allocate([2.5] * 64, 256, range(9)).tolist() == [4] * 64
    assert allocate([1.0] * 7, 20, range(9)).tolist() == [3] * 6 + [2]


def test_lloyd_rule_prices_widths_by_the_codebooks_own_error():
    table = lloyd_distortions()
    assert table[0] == 1.0 and 0.36 < table[1] < 0.37 and 0.11 < table[2] < 0.12  # a unit gaussian's
    # equal variances: still floor(budget/n), the remainder first (the table is convex)
    assert allocate([1.0] * 4, 10, range(9), distortion=table).tolist() == [3, 3, 2, 2]
    assert allocate([1.0] * 7, 20, range(9), distortion=table).tolist() == [3] * 6 + [2]
    # 3:1 variances, 2 bits: 4**-b prices (1, 1) lower (1.0 < 1.19); the real 1-bit error (0.36, not 0.25)
    # makes (2, 0) lower (1.35 < 1.45)
    assert allocate([3.0, 1.0], 2, range(9)).tolist() == [1, 1]
    assert allocate([3.0, 1.0], 2, range(9), distortion=table).tolist() == [2, 0]
    assert Latent(budget=2, rule="lloyd").widths(np.array([[3.0, 1.0]])).tolist() == [2, 0]


def test_allocator_drops_weak_components_and_keeps_the_budget():
    v = [100.0, 10.0, 1.0, 1e-6, 1e-9]
    w = allocate(v, 12, (0, 1, 2, 3, 4, 6, 8))
    assert w.sum() <= 12 and w[-1] == 0 and w[0] >= w[1] >= w[2]
    assert allocate(v, 0, (0, 2, 4)).tolist() == [0] * 5
    with pytest.raises(ValueError, match="include 0"):
        allocate(v, 8, (2, 4))


# --- the tier: attention from latents equals the reference path ------------------------------------


@pytest.mark.parametrize(
    "keys,values",
    [
        ("latent(rank=16)", "fp16"),
        ("latent(rank=12, heads=3, hi_bits=8, lo_bits=4)", "latent(rank=24, heads=0, lo_bits=3)"),
        ("latent(budget=96, center=true)", "latent(budget=128, center=true, group=64)"),
    ],
)
def test_latent_partial_equals_attention_over_the_rebuilt_kv(keys, values):
    cache = filled(keys, values, L=192)
    tier = cache.tiers[1]
    assert isinstance(tier, latent_tier.LatentTier) and tier.count > 0
    q = mx.random.normal((1, 9, 3, 64), key=mx.random.key(9))
    out, lse = tier.partial(q, 0.125)
    ref_out, ref_lse = partial_attention(q, *tier.decoded(mx.float32), 0.125)  # the reference decode path
    assert float(mx.abs(out - ref_out).max()) < 1e-4
    assert float(mx.abs(lse - ref_lse).max()) < 1e-4


def test_full_rank_float_latents_match_fp16_in_a_model():
    model = tiny_llama()
    ref = feed(model, TOKENS, vq.make_prompt_cache(model, "fp16"), 200)
    caches = vq.make_prompt_cache(
        model, recipe_text("latent(rank=64, hi_bits=16, lo_bits=16)", "latent(rank=64, hi_bits=16, lo_bits=16)")
    )
    out = [model(TOKENS[:, :150], cache=caches)] + [model(TOKENS[:, s : s + 1], cache=caches) for s in range(150, 200)]
    assert caches[0].tiers[1].sides["k"].widths is not None  # fitted at the first single-token step
    assert float(mx.abs(mx.concatenate(out, axis=1) - ref).max()) < 5e-3


def test_decode_never_rebuilds_kv_from_latents(monkeypatch):
    model = tiny_llama()
    caches = vq.make_prompt_cache(model, "palu", ["window=32"])
    model(TOKENS[:, :150], cache=caches)
    [c.finish_prompt() for c in caches]

    def refuse(self, dtype):
        raise AssertionError("decode rebuilt K/V from latents")

    monkeypatch.setattr(latent_side.LatentSide, "decoded", refuse)
    logits = mx.concatenate([model(TOKENS[:, s : s + 1], cache=caches) for s in range(150, 190)], axis=1)
    mx.eval(logits)
    assert caches[0].attended and caches[0].tiers[-1].count >= 96


def test_decode_peak_stays_below_one_fp16_copy_of_the_keys():
    shape = ModelShape.uniform("big", 1, 8, 256)
    cache = caches_for(
        compile_recipe(
            recipe_text("latent(rank=8, hi_bits=4, lo_bits=4)", "latent(rank=8, hi_bits=4, lo_bits=4)"), shape
        )
    )[0]
    L = 8192
    x = mx.random.normal((1, 8, L, 256), key=mx.random.key(0)).astype(mx.float16)
    cache.update_and_fetch(x, x)
    cache.finish_prompt()
    del x
    q = mx.random.normal((1, 8, 1, 256), key=mx.random.key(1))
    mx.eval(q, cache.state)
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    mx.eval(cache.attend(q, 0.0625))
    fp16_keys = L * 8 * 256 * 2
    assert mx.get_peak_memory() - before < fp16_keys / 2


# --- bytes, persistence, models ---------------------------------------------------------------------


def test_bytes_are_basis_plus_latents_and_no_fp16_copy():
    cache = filled("latent(rank=16)", "latent(rank=32, lo_bits=3)", L=192)
    tier = cache.tiers[1]
    names = set(tier.arrays())
    assert not any(n.endswith(".x") for n in names) and {"k.basis", "v.basis", "k.c4.codes"} <= names
    assert tier.arrays()["k.basis"].shape == (3, 64, 16)
    held = sum(b.nbytes for s in tier.sides.values() for b in s._live().values())
    held += sum(a.nbytes for s in tier.sides.values() for a in s.fitted.values())
    held += sum(s.widths.nbytes for s in tier.sides.values())  # the widths' host copy
    assert tier.nbytes == held
    assert tier.nbytes < 0.4 * (tier.count * 3 * 64 * 2 * 2)


def test_energy_mode_picks_the_rank_the_spectrum_needs():
    cache = filled("latent(energy=0.99, hi_bits=16, lo_bits=16)", L=192)
    assert cache.tiers[1].arrays()["k.basis"].shape[-1] in range(12, 16)  # 12 true dimensions + noise


@pytest.mark.parametrize("name,sets", [("svdq", ["window=32"]), ("palu", ["window=32"]), ("kvtc", ["window=64"])])
def test_saved_cache_continues_identically(tmp_path, name, sets):
    model = tiny_llama()
    caches = vq.make_prompt_cache(model, name, sets)
    model(TOKENS[:, :150], cache=caches)
    path = tmp_path / "c.safetensors"
    save_prompt_cache(path, caches)
    loaded, _ = load_prompt_cache(path, expect_fingerprint=caches[0].fingerprint)
    for c, d in zip(caches, loaded):  # the same arrays (the live one may hold growth slack)
        a, b = c.tiers[-1].arrays(), d.tiers[-1].arrays()
        assert a.keys() == b.keys() and all(mx.array_equal(a[n], b[n]) for n in a)
    a = feed(model, TOKENS[:, 150:], caches, 1)
    b = feed(model, TOKENS[:, 150:], loaded, 1)
    assert float(mx.abs(a - b).max()) == 0.0


def test_kvtc_saved_latent_codes_are_entropy_coded(tmp_path):
    model = tiny_llama()
    caches = vq.make_prompt_cache(model, "kvtc", ["window=64"])
    model(TOKENS, cache=caches)
    save_prompt_cache(tmp_path / "c.safetensors", caches)
    names = mx.load(str(tmp_path / "c.safetensors")).keys()
    assert any(n.endswith(".codes.rans") for n in names)


@pytest.mark.parametrize("name", ["svdq", "palu", "kvtc"])
def test_sliding_window_layers_run_and_forget_old_latents(name):
    model = tiny_gemma3(window=80)
    caches = vq.make_prompt_cache(model, name, ["window=32"])
    # The window expires staged tokens during the prompt (not a whole group: 150 - 80 + 1 = 71),
    # then the single-token steps end the prompt and the sliding layers fit on what is left.
    out = mx.concatenate(
        [feed(model, TOKENS[:, :150], caches, 50)]
        + [model(TOKENS[:, s : s + 1], cache=caches) for s in range(150, 200)],
        axis=1,
    )
    assert not bool(mx.isnan(out).any())
    sliding = caches[0]
    assert sliding.plan.window == 80 and sliding.tiers[-1].sides["k"].widths is not None
    assert sliding.tiers[-1].count % 32 == 0 and sliding.size() <= 80 + 32 + 32 + 4


# --- recipe errors ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "keys,match",
    [
        ("latent(heads=2, rank=8)", "heads=2 does not divide the 3 kv heads"),
        ("latent(rank=80)", "rank=80 exceeds the 64 channels"),
        ("latent(hi_bits=4)", "give rank=, energy= or budget="),
        ("latent(rank=8, group=48)", "multiple of 32"),
        ('latent(rank=8, choices="1,x")', "comma-separated integers"),
    ],
)
def test_bad_latent_parameters_are_located_errors(keys, match):
    with pytest.raises(RecipeError, match=match) as e:
        compile_recipe(recipe_text(keys), SHAPE)
    assert e.value.location is not None


def test_latent_must_stand_in_the_last_tier():
    bad = from_text(
        "veloxquant: 1\nname: t\npipeline: |\n  recent(32) >> keys: latent(rank=8) values: fp16\n  >> drop\n"
    )
    with pytest.raises(RecipeError, match="must stand in the last tier"):
        compile_recipe(bad, SHAPE)


def test_stage_arithmetic_round_trips_codes():
    store = Latent(rank=8, hi_bits=16, lo_bits=3)
    z = mx.random.normal((1, 2, 64, 8), key=mx.random.key(4))
    widths = np.array([16, 16, 3, 3, 3, 3, 3, 3])
    back = store.decode(store.encode(z, widths, {}), widths, {})
    assert float(mx.abs(back[..., :2] - z[..., :2]).max()) < 1e-2
    assert float(mx.abs(back - z).max()) < 0.7
    gauss = Latent(rank=8, quant="gauss")
    stats = gauss.stats(z)
    enc = gauss.encode(z, widths, stats)
    assert set(enc) == {"f16", "c3.codes"}  # no per-token metadata
    err = gauss.decode(enc, widths, stats) - z
    assert float(mx.mean(err[..., 2:] ** 2)) < 0.06  # Lloyd-Max 3-bit gaussian MSE is 0.0345


def test_saved_ppl_scores_the_live_and_the_loaded_cache_alike(tmp_path):
    from benchmarks.saved_ppl import saved_then_scored

    model = tiny_llama()
    window = np.random.default_rng(0).integers(0, 500, 230).tolist()
    size, live, loaded = saved_then_scored(model, "kvtc", ["window=32"], window, 192, tmp_path)
    assert size == (tmp_path / "kvtc.safetensors").stat().st_size and live == loaded > 0
