"""Lloyd-Max codebooks, the residual composition, and the turboquant_rvq recipe."""

import mlx.core as mx
import numpy as np
import pytest

import veloxquant as vq
from veloxquant.compiler import SMOLLM2_135M, compile_recipe
from veloxquant.compiler.rebuild import plan_from_dict
from veloxquant.errors import RecipeError
from veloxquant.recipe import load_recipe
from veloxquant.runtime.codec import Codec
from veloxquant.stages.codebook import LloydMax, lloyd_max

from conftest import feed


def test_lloyd_max_matches_the_textbook_gaussian_quantizers():
    # Max (1960): 1 bit at +-0.7979, 2 bits at +-0.4528, +-1.5104.
    assert np.allclose(lloyd_max(1, "gaussian"), [-0.7979, 0.7979], atol=2e-3)
    assert np.allclose(lloyd_max(2, "gaussian"), [-1.5104, -0.4528, 0.4528, 1.5104], atol=2e-3)
    laplace = lloyd_max(1, "laplace")  # unit variance: E|x| = 1/sqrt(2)
    assert np.allclose(laplace, [-0.7071, 0.7071], atol=2e-3)


def test_more_bits_and_a_residual_stage_each_cut_the_error():
    x = mx.random.normal((1, 3, 64, 64), key=mx.random.key(0))
    plan = compile_recipe(load_recipe("turboquant_rvq"), SMOLLM2_135M).layers[0].tiers[0].keys
    with_residual = Codec(plan)
    without = Codec(type(plan)(plan.transforms, plan.store))
    err = lambda c: float(mx.mean((c.decode(c.encode(x), mx.float32) - x) ** 2))
    one_bit = LloydMax(bits=1)
    assert err(with_residual) < 0.5 * err(without)
    assert float(mx.mean((one_bit.decode(one_bit.encode(x), mx.float32) - x) ** 2)) > err(without)
    enc = with_residual.encode(x)
    assert set(enc) == {"codes", "norms", "r0.codes", "r0.norms"}
    assert enc["codes"].dtype == mx.uint32 and enc["codes"].shape[-1] == 64 * 2 // 32


def test_turboquant_rvq_plan_round_trips_through_json():
    plan = compile_recipe(load_recipe("turboquant_rvq"), SMOLLM2_135M)
    again = plan_from_dict(plan.to_dict(), plan.recipe)
    assert again.fingerprint == plan.fingerprint
    assert again.layers[0].tiers[0].keys.residuals[0].inner == LloydMax(bits=2, dist="laplace")


def test_turboquant_rvq_runs_in_a_model_and_bytes_are_what_it_holds(llama_model):
    tokens = mx.random.randint(0, 500, (1, 96), key=mx.random.key(1))
    ref = feed(llama_model, tokens, vq.make_prompt_cache(llama_model, "fp16"), 32)
    caches = vq.make_prompt_cache(llama_model, "turboquant_rvq")
    got = feed(llama_model, tokens, caches, 32)
    assert float(mx.abs(ref - got).max()) < 1.0
    # 96 tokens x 3 heads, K and V: 2 planes of 64 2-bit codes + 2 float16 norms, allocated in
    # UNBOUNDED_STEP-token steps (the slack is held memory, so it is counted).
    from veloxquant.runtime.kinds.tier import UNBOUNDED_STEP

    per_token = 2 * 3 * (2 * 64 * 2 // 8 + 2 * 2)
    assert caches[0].nbytes == -(-96 // UNBOUNDED_STEP) * UNBOUNDED_STEP * per_token


def test_residual_needs_a_store_before_it(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("veloxquant: 1\nname: r\npipeline: hadamard | residual(lloydmax(bits=1))\n")
    with pytest.raises(RecipeError, match="none comes before it"):
        compile_recipe(load_recipe(str(path)), SMOLLM2_135M)
