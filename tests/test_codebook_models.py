"""The codebook/sketch recipes in mlx_lm.generate on SmolLM2 and Gemma-3-270M (sliding-window
layers): they run, attend through the hook, hold what they claim, and save/load identically."""

import mlx.core as mx
import mlx_lm
import pytest

import veloxquant as vq
from veloxquant.artifacts import CalibrationError
from veloxquant.run import cache_report

pytestmark = pytest.mark.slow

RECIPES = [
    "turboquant_mse",
    "turboquant_prod",
    "qjl",
    "rabitq",
    "polarquant",
    "spectralquant",
    "nsnquant",
    "ratequant",
    "ratekivi",
]


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def model(request):
    from veloxquant.models import load_model
    from veloxquant.models.default import default_model_path, gemma3_model_path

    path = default_model_path() if request.param == "smollm2" else gemma3_model_path()
    return load_model(path, dtype=mx.float32)


@pytest.mark.parametrize("recipe", RECIPES)
def test_generates_holds_its_bytes_and_round_trips(model, recipe, tmp_path):
    m, tok = model
    try:
        caches = vq.make_prompt_cache(m, recipe)
    except CalibrationError as e:
        pytest.skip(f"not calibrated for this model here: {e}"[:200])
    prompt = "It is a truth universally acknowledged, that a single man in possession of a good fortune " * 6
    text = mlx_lm.generate(m, tok, prompt, max_tokens=6, prompt_cache=caches)
    assert isinstance(text, str)
    report = cache_report(caches)
    assert report["attention"] == "by tiers (hook)" and report["tokens"] > 100
    vq.save_prompt_cache(str(tmp_path / "c.safetensors"), caches)
    loaded, _ = vq.load_prompt_cache(str(tmp_path / "c.safetensors"), expect_fingerprint=caches[0].fingerprint)
    nxt = mx.array(tok.encode(" Mr"))[None]
    assert float(mx.abs(m(nxt, cache=caches) - m(nxt, cache=loaded)).max()) == 0.0
