"""RateQuant's per-layer widths (`ratebits`): the allocation across layers from measured
attention-output errors, calibration on a tiny random Llama, and the recipe end to end."""

import mlx.core as mx
import numpy as np
import pytest

import veloxquant as vq
from veloxquant.calibration.explain import calibration_lines
from veloxquant.calibration.fit import calibrate
from veloxquant.compiler import ModelShape
from veloxquant.kernels.partials import partial_attention
from veloxquant.runtime.code_attention import codes_partial_attention
from veloxquant.runtime.kinds.tier import Tier
from veloxquant.runtime.persist import load_prompt_cache, save_prompt_cache
from veloxquant.stages.ratebits import allocate_widths

from conftest import feed
from test_calibration import Tokens, _text


def test_equal_sensitivities_give_a_uniform_allocation():
    curve = np.array([1.0, 0.3, 0.08])  # widths 2, 3, 4: convex, as measured errors are
    assert list(allocate_widths(np.tile(curve, (6, 1)), 2, 3.0)) == [3] * 6
    assert list(allocate_widths(np.tile(curve, (4, 1)), 2, 2.0)) == [2] * 4


def test_the_sensitive_layers_get_the_bits_and_the_mean_is_the_target():
    errors = np.array([[1.0, 0.3, 0.08], [10.0, 3.0, 0.8], [1.0, 0.3, 0.08], [0.1, 0.03, 0.008]])
    widths = allocate_widths(errors, 2, 3.0)
    assert widths.sum() == 12 and widths[1] == 4 and widths[3] == 2
    assert list(allocate_widths(errors, 2, 9.0)) == [4] * 4  # clipped to what the widths allow


@pytest.fixture
def recipe(tmp_path, monkeypatch, llama_model):
    monkeypatch.setenv("VELOXQUANT_CACHE", str(tmp_path / "cache"))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(_text(0))
    plan = vq.compile_recipe(
        vq.load_recipe("ratequant"),
        ModelShape.from_model(llama_model),
        [f"corpus={corpus}", "tokens=256", "bits=2.5", "window=16"],
    )
    meta = calibrate(plan, llama_model, Tokens(), progress=False)
    return [f"corpus={corpus}", "tokens=256", "bits=2.5", "window=16"], meta


def test_calibration_allocates_per_layer_widths_that_the_caches_use(llama_model, recipe):
    sets, meta = recipe
    caches = vq.make_prompt_cache(llama_model, "ratequant", sets)
    key_stages = [c.plan.tiers[-1].keys.residuals[0].inner for c in caches]  # keys: groupmean | residual(ratebits)
    assert key_stages[2]._slot == "2.2.k.r0" and key_stages[2]._artifact == meta["content"]
    widths = [s.width() for s in key_stages]
    v_widths = [c.plan.tiers[-1].values.store.width() for c in caches]
    assert sum(widths + v_widths) == 20 and set(widths + v_widths) <= {2, 3, 4}  # mean 2.5 over 4 layers, K and V
    tokens = mx.random.randint(0, 500, (1, 96), key=mx.random.key(0))
    exact = feed(llama_model, tokens, vq.make_prompt_cache(llama_model, "fp16"), 32)
    got = feed(llama_model, tokens, caches, 32)
    assert float(mx.abs(got - exact).max()) < 2.0
    for cache, k_bits in zip(caches, widths):
        cache.size()  # settles: the last chunk leaves the window
        tier, v_bits = cache.tiers[-1], cache.plan.tiers[-1].values.store.width()
        assert tier.count == 64  # past the sinks and the fp16 window, in whole 64-token groups
        # codes at the layer's widths + a float16 norm per token, K and V, in one 256-token step,
        # and the keys' float16 group means (4 groups of 64 per step)
        assert tier.nbytes == 256 * 3 * ((k_bits + v_bits) * 64 // 8 + 4) + 3 * 4 * 64 * 2
    assert any(meta["key"] in line for line in calibration_lines(caches[0].plan_root, llama_model))


def test_ratebits_scores_equal_decode_then_attend_and_a_saved_cache_continues(llama_model, recipe, tmp_path):
    sets, _ = recipe
    caches = vq.make_prompt_cache(llama_model, "ratequant", sets)
    from veloxquant.stages import ratebits

    ratebits._WIDTHS.clear()  # the first read of a width may come inside the compiled encode of a 64-token block
    tier = Tier(caches[1].plan.tiers[-1])
    tier.append(mx.random.normal((1, 3, 64, 64)), mx.random.normal((1, 3, 64, 64)), 0)
    q = mx.random.normal((1, 9, 3, 64))
    kd, vd = tier.decoded(mx.float32)
    ref = partial_attention(q, kd, vd, 0.125)
    got = codes_partial_attention(q, tier.encoded("k"), tier.encoded("v"), tier.codecs["k"], tier.codecs["v"], 0.125)
    assert float(mx.abs(ref[0] - got[0]).max()) < 1e-4
    tokens = mx.random.randint(0, 500, (1, 110), key=mx.random.key(3))
    feed(llama_model, tokens[:, :100], caches, 50)
    save_prompt_cache(str(tmp_path / "c.safetensors"), caches)
    loaded, _ = load_prompt_cache(str(tmp_path / "c.safetensors"), expect_fingerprint=caches[0].fingerprint)
    a, b = llama_model(tokens[:, 100:], cache=caches), llama_model(tokens[:, 100:], cache=loaded)
    assert float(mx.abs(a - b).max()) == 0.0


def test_keys_and_values_share_one_budget():
    from veloxquant.stages.ratebits import RateBits

    st = RateBits(target=3.0)
    curve = np.array([1.0, 0.3, 0.08])
    fits = {(i, 2, side, st): {"errors": curve * (10 if side == "k" else 1)} for i in range(3) for side in "kv"}
    got = RateBits.allocate(fits)
    k, v = ([int(got[(i, 2, side, st)]["bits"][0]) for i in range(3)] for side in "kv")
    assert sum(k + v) == 18 and k == [4] * 3 and v == [2] * 3  # the keys' errors are 10x: they get the bits


def test_a_sliding_window_limits_the_keys_the_errors_are_measured_over():
    from veloxquant.stages.ratebits import RateBits

    rng = np.random.default_rng(0)
    k, v = rng.standard_normal((1, 256, 64)).astype(np.float32), rng.standard_normal((1, 256, 64)).astype(np.float32)
    q = rng.standard_normal((3, 64, 64)).astype(np.float32)  # every 4th position's query, 3 query heads
    layer = {"k": k, "v": v, "q": q}
    fit = lambda w: RateBits().fit(k, q, layer, "k", w)["errors"]
    assert np.array_equal(fit(None), fit(256)) and not np.allclose(fit(None), fit(16))
    assert np.all(np.diff(fit(None)) < 0)  # more bits, less error


# --- byte-weighted allocation and min/max codes (recipe `ratekivi`) ---------------


def test_unit_weights_are_the_unweighted_allocation_bit_for_bit():
    rng = np.random.default_rng(1)
    errors = np.sort(rng.random((12, 5)), axis=1)[:, ::-1]  # convex-ish decreasing curves
    for target in (2.0, 2.5, 3.0, 3.7, 6.0):
        assert np.array_equal(allocate_widths(errors, 2, target), allocate_widths(errors, 2, target, np.ones(12)))


def test_a_site_that_holds_more_tokens_pays_more_for_its_bits():
    from veloxquant.stages.ratebits import site_weights

    assert site_weights(np.array([512, 0]), 0) is None  # context 0: every layer alike
    w = site_weights(np.array([512, 512, 0, 0]), 4096)  # two 512-token sliding layers, two full ones
    assert list(w) == [1, 1, 8, 8] and list(site_weights(np.array([512, 0]), 256)) == [1, 1]
    curve = np.array([1.0, 0.3, 0.08])
    errors = np.tile(curve, (4, 1))
    # mean 2.5 over held tokens: 9 bits above 2 to spend; the cheap sites take 2 each (cost 4),
    # a dear site's one bit costs 8 and no longer fits
    assert list(allocate_widths(errors, 2, 2.5, w)) == [4, 4, 2, 2]
    assert sorted(allocate_widths(errors, 2, 2.5)) == [2, 2, 3, 3]  # unweighted: one bit each to two
    assert list(allocate_widths(errors, 2, 3.0, w)) == [3] * 4  # 18 bits: one bit each is the best spend


def test_affine_ratebits_at_a_width_is_affine_bit_for_bit_and_holds_its_group():
    from veloxquant.stages.ratebits import _WIDTHS, RateBits
    from veloxquant.stages.store import Affine

    st = RateBits(codec="affine", group=32, axis="channel", lo=2, hi=5, artifact="t", slot="0.1.k")
    _WIDTHS[("t", "0.1.k")] = 3
    try:
        ref = Affine(bits=3, group=32, axis="channel")
        x = mx.random.normal((1, 2, 64, 64), key=mx.random.key(2))
        enc, want = st.encode(x), ref.encode(x)
        assert all(mx.array_equal(enc[n], want[n]).item() for n in want)
        assert mx.array_equal(st.decode(enc, mx.float32), ref.decode(want, mx.float32)).item()
        q = mx.random.normal((1, 2, 5, 64), key=mx.random.key(3))
        dense = q @ ref.decode(want, mx.float32).swapaxes(-1, -2)
        assert float(mx.abs(st.scores(q, enc) - dense).max()) < 1e-4
        assert st.token_multiple == 32 and st.units() == ref.units()
        assert st.bits_per_element(64) == st.target + 1.0  # a float16 scale and zero per 32 tokens
    finally:
        _WIDTHS.pop(("t", "0.1.k"))
    assert "does not divide" in RateBits(codec="affine", group=48, axis="token").check_head_dim(64)


def test_affine_fit_measures_whole_groups_and_more_bits_cut_the_error():
    from veloxquant.stages.ratebits import RateBits

    rng = np.random.default_rng(0)
    k, v = rng.standard_normal((1, 250, 64)).astype(np.float32), rng.standard_normal((1, 250, 64)).astype(np.float32)
    q = rng.standard_normal((3, 63, 64)).astype(np.float32)
    fit = RateBits(codec="affine", axis="channel", group=64, lo=2, hi=5).fit(k, q, {"k": k, "v": v, "q": q}, "k", 128)
    assert np.all(np.diff(fit["errors"]) < 0) and int(fit["held"][0]) == 128
