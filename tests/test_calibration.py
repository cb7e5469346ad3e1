"""Calibration: the artifact's key, binding by key (never a random fallback), the
fingerprint it enters, and the `spectral` stage it feeds (tiny random Llama)."""

import mlx.core as mx
import numpy as np
import pytest

import veloxquant as vq
from veloxquant.artifacts import CalibrationError, directory
from veloxquant.calibration.explain import calibration_lines
from veloxquant.calibration.fit import calibrate
from veloxquant.compiler import binding
from veloxquant.errors import CacheFileError
from veloxquant.kernels.partials import partial_attention
from veloxquant.runtime.code_attention import codes_partial_attention
from veloxquant.runtime.make import plan_for
from veloxquant.runtime.persist import load_prompt_cache, save_prompt_cache
from veloxquant.stages.spectral import Spectral, water_fill

from conftest import feed


class Tokens:
    """A tokenizer stand-in: calibration only needs encode()."""

    def encode(self, text):
        return [(ord(c) - 1000) % 500 for c in text]


def _text(seed):
    """Calibration text whose stand-in tokens cover the tiny model's vocabulary."""
    return "".join(chr(1000 + int(i)) for i in np.random.default_rng(seed).integers(0, 500, 600))


@pytest.fixture
def setup(tmp_path, monkeypatch):
    monkeypatch.setenv("VELOXQUANT_CACHE", str(tmp_path / "cache"))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(_text(0))
    recipe = tmp_path / "spec.yaml"
    recipe.write_text(
        f"veloxquant: 1\nname: spec\npipeline: |\n"
        f'  keys: spectral(bits=3, corpus="{corpus}", tokens=256)\n'
        f'  values: spectral(bits=2, corpus="{corpus}", tokens=256)\n'
    )
    return str(recipe), corpus, tmp_path


def _calibrate(model, recipe):
    plan = vq.compile_recipe(vq.load_recipe(recipe), __import__("veloxquant").compiler.ModelShape.from_model(model))
    return calibrate(plan, model, Tokens(), progress=False)


def test_missing_artifact_is_a_clear_error_and_calibrate_makes_it(llama_model, setup):
    recipe, _, tmp = setup
    with pytest.raises(CalibrationError, match=r"needs a calibration artifact.*veloxquant calibrate spec"):
        vq.make_prompt_cache(llama_model, recipe)
    meta = _calibrate(llama_model, recipe)
    assert (directory() / f"{meta['key']}.safetensors").stat().st_size == meta["bytes"] > 0
    caches = vq.make_prompt_cache(llama_model, recipe)
    store = caches[0].plan.tiers[0].keys.store
    assert store._artifact == meta["content"] and store._slot == "0.0.k"
    tokens = mx.random.randint(0, 500, (1, 64), key=mx.random.key(0))
    exact = feed(llama_model, tokens, vq.make_prompt_cache(llama_model, "fp16"), 32)
    got = feed(llama_model, tokens, vq.make_prompt_cache(llama_model, recipe), 32)
    plain = tmp / "tq2.yaml"  # TurboQuant's codes alone: the built-in also keeps sinks and a window in fp16
    plain.write_text("veloxquant: 1\nname: tq2\npipeline: rotation | lloydmax(bits=2)\n")
    two_bit = feed(llama_model, tokens, vq.make_prompt_cache(llama_model, str(plain)), 32)
    # a random model's keys are isotropic (nothing for PCA to find): about as good as 2-bit TurboQuant
    assert float(mx.mean(mx.abs(got - exact))) < 1.5 * float(mx.mean(mx.abs(two_bit - exact)))
    assert any(
        "artifact: " in line and meta["key"] in line for line in calibration_lines(caches[0].plan_root, llama_model)
    )


def test_a_changed_corpus_changes_the_key_and_an_old_saved_cache_is_refused(llama_model, setup):
    recipe, corpus, tmp = setup
    _calibrate(llama_model, recipe)
    old = vq.make_prompt_cache(llama_model, recipe)
    feed(llama_model, mx.random.randint(0, 500, (1, 40), key=mx.random.key(1)), old, 20)
    save_prompt_cache(str(tmp / "old.safetensors"), old)
    key_before = binding.key_for(old[0].plan_root, llama_model)
    corpus.write_text(_text(1))
    with pytest.raises(CalibrationError, match="stale"):
        vq.make_prompt_cache(llama_model, recipe)
    _calibrate(llama_model, recipe)
    new = vq.make_prompt_cache(llama_model, recipe)
    assert binding.key_for(new[0].plan_root, llama_model) != key_before
    assert new[0].fingerprint != old[0].fingerprint  # the artifact's content hash is in the fingerprint
    with pytest.raises(CacheFileError, match="fingerprint"):
        load_prompt_cache(str(tmp / "old.safetensors"), expect_fingerprint=new[0].fingerprint)
    loaded, _ = load_prompt_cache(str(tmp / "old.safetensors"), expect_fingerprint=old[0].fingerprint)
    assert loaded[0].plan.tiers[0].keys.store._artifact == old[0].plan.tiers[0].keys.store._artifact


def test_a_saved_cache_without_its_artifact_names_it(llama_model, setup):
    recipe, _, tmp = setup
    _calibrate(llama_model, recipe)
    caches = vq.make_prompt_cache(llama_model, recipe)
    feed(llama_model, mx.random.randint(0, 500, (1, 40), key=mx.random.key(1)), caches, 20)
    save_prompt_cache(str(tmp / "c.safetensors"), caches)
    tokens = mx.random.randint(0, 500, (1, 8), key=mx.random.key(2))
    loaded, _ = load_prompt_cache(str(tmp / "c.safetensors"))
    assert float(mx.abs(llama_model(tokens, cache=caches) - llama_model(tokens, cache=loaded)).max()) == 0.0
    from veloxquant import artifacts as artifact

    digest = caches[0].plan.tiers[0].keys.store._artifact
    for p in directory().iterdir():
        p.unlink()
    artifact._LOADED.clear(), artifact._SLOTS.clear()
    loaded, _ = load_prompt_cache(str(tmp / "c.safetensors"))
    with pytest.raises(CalibrationError, match=f"artifact {digest} is not in"):
        llama_model(tokens, cache=loaded)


def test_spectral_scores_equal_decode_then_attend(llama_model, setup):
    recipe, _, _ = setup
    _calibrate(llama_model, recipe)
    tier = vq.make_prompt_cache(llama_model, recipe)[1].tiers[0]
    from veloxquant.runtime.kinds.tier import Tier

    tier = Tier(tier.plan)
    k = mx.random.normal((1, 3, 50, 64), key=mx.random.key(0))
    tier.append(k, k * 0.5, 0)
    q = mx.random.normal((1, 9, 3, 64), key=mx.random.key(1))
    kd, vd = tier.decoded(mx.float32)
    ref, got = (
        partial_attention(q, kd, vd, 0.125),
        codes_partial_attention(q, tier.encoded("k"), tier.encoded("v"), tier.codecs["k"], tier.codecs["v"], 0.125),
    )
    assert float(mx.abs(ref[0] - got[0]).max()) < 1e-4
    assert tier.nbytes == 256 * 3 * (64 * 3 // 8 + 2 + 64 * 2 // 8 + 2)  # codes + float16 scale; one 256-token step


def test_water_filling_gives_bits_to_variance_and_equal_variances_a_uniform_split():
    assert list(water_fill(np.ones(8), 24)) == [3] * 8
    bits = water_fill(np.array([16.0, 4.0, 1.0, 0.25]), 8)
    assert bits.sum() == 8 and list(bits) == sorted(bits, reverse=True) and bits[0] > bits[-1]


def test_an_unbound_spectral_stage_refuses_to_run_rather_than_guess():
    with pytest.raises(CalibrationError, match="not bound"):
        Spectral().encode(mx.zeros((1, 1, 4, 64)))


def test_calibrate_command_names_a_setting_the_recipe_lacks(capsys):
    from veloxquant.cli import main

    assert main(["calibrate", "kivi", "--corpus", "austen:emma"]) == 2
    assert "recipe 'kivi' has no 'corpus' parameter" in capsys.readouterr().err


def test_explain_lists_calibrated_stages_without_a_model():
    plan = vq.compile_recipe(vq.load_recipe("spectralquant"), __import__("veloxquant").compiler.SMOLLM2_135M)
    lines = calibration_lines(plan)
    assert "spectral on keys x30, spectral on values x30" in lines[1] and "4096 tokens of 'austen:emma'" in lines[1]
    assert "pass --model" in lines[2]


def test_vecinfer_look_up_table_scores_equal_decode_then_attend(llama_model, setup):
    from veloxquant.stages.productvq import ProductVQ

    recipe, corpus, tmp = setup
    path = tmp / "vi.yaml"
    path.write_text(
        f'veloxquant: 1\nname: vi\npipeline: |\n  keys: pvq(corpus="{corpus}", tokens=256)\n'
        "  values: rotation | lloydmax(bits=4)\n"
    )
    _calibrate(llama_model, str(path))
    plan = plan_for(llama_model, str(path))
    from veloxquant.runtime.kinds.tier import Tier

    tier = Tier(plan.layers[2].tiers[0])
    k = mx.random.normal((1, 3, 40, 64), key=mx.random.key(0))
    tier.append(k, k, 0)
    assert tier.codecs["k"].scores_from_codes and tier.encoded("k")["codes"].shape[-1] == 2  # 8 one-byte indices
    q = mx.random.normal((1, 9, 3, 64), key=mx.random.key(1))
    kd, vd = tier.decoded(mx.float32)
    ref, got = (
        partial_attention(q, kd, vd, 0.125),
        codes_partial_attention(q, tier.encoded("k"), tier.encoded("v"), tier.codecs["k"], tier.codecs["v"], 0.125),
    )
    assert float(mx.abs(ref[0] - got[0]).max()) < 1e-4 and float(mx.abs(ref[1] - got[1]).max()) < 1e-4
    assert ProductVQ().bits_per_element(64) == 1.0
    tokens = mx.random.randint(0, 500, (1, 48), key=mx.random.key(3))
    assert feed(llama_model, tokens, vq.make_prompt_cache(llama_model, str(path)), 16).shape == (1, 48, 500)


def test_run_reports_the_artifact_beside_the_cache_bytes(llama_model, setup):
    from veloxquant.run import cache_report

    recipe, _, _ = setup
    meta = _calibrate(llama_model, recipe)
    caches = vq.make_prompt_cache(llama_model, recipe)
    feed(llama_model, mx.random.randint(0, 500, (1, 40), key=mx.random.key(1)), caches, 20)
    report = cache_report(caches)
    assert report["calibration_bytes"] == meta["bytes"] and report["cache_bytes"] == sum(c.nbytes for c in caches)
    assert cache_report(vq.make_prompt_cache(llama_model, "kivi"))["calibration_bytes"] == 0
