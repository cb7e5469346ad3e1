"""`latent(calibrated=true)`: KVTC's global basis from `veloxquant calibrate`, widths still per prompt,
and saved caches that name the artifact instead of holding a basis (tiny random Llama)."""

import mlx.core as mx
import numpy as np
import pytest

import veloxquant as vq
from veloxquant.artifacts import CalibrationError
from veloxquant.calibration.fit import calibrate
from veloxquant.compiler import ModelShape, binding
from veloxquant.runtime.persist import load_prompt_cache, save_prompt_cache

from conftest import feed

TOKENS = mx.random.randint(0, 500, (1, 200), key=mx.random.key(3))


class Tokens:
    def encode(self, text):
        return [(ord(c) - 1000) % 500 for c in text]


def recipe(tmp_path, corpus, k_budget=192, calibrated="true"):
    path = tmp_path / f"kvtc{k_budget}{calibrated}.yaml"
    opts = f'center=true, quant=gauss, calibrated={calibrated}, corpus="{corpus}", tokens=256'
    path.write_text(
        "veloxquant: 1\nname: kvtc_cal\npipeline: |\n  sink(4) >> recent(32)\n"
        f"  >> keys: latent(budget={k_budget}, queries=true, {opts}) | rans(table=tensor)\n"
        f"     values: latent(budget=160, {opts}) | rans(table=tensor)\n"
    )
    return str(path)


@pytest.fixture
def setup(tmp_path, monkeypatch, llama_model):
    monkeypatch.setenv("VELOXQUANT_CACHE", str(tmp_path / "cache"))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(chr(1000 + int(i)) for i in np.random.default_rng(0).integers(0, 500, 600)))
    path = recipe(tmp_path, corpus)
    plan = vq.compile_recipe(vq.load_recipe(path), ModelShape.from_model(llama_model))
    with pytest.raises(CalibrationError, match="needs a calibration artifact"):
        vq.make_prompt_cache(llama_model, path)
    calibrate(plan, llama_model, Tokens(), progress=False)
    return path, corpus


def test_saved_cache_holds_no_basis_and_continues_identically(llama_model, setup, tmp_path):
    path, corpus = setup
    caches = vq.make_prompt_cache(llama_model, path)
    feed(llama_model, TOKENS[:, :150], caches, 50)
    size = save_prompt_cache(tmp_path / "c.safetensors", caches)
    names = set(mx.load(str(tmp_path / "c.safetensors")))
    assert not any(n.endswith(".basis") for n in names) and "0.2.k.keep" in names and "0.2.v.keep" in names
    loaded, _ = load_prompt_cache(tmp_path / "c.safetensors", expect_fingerprint=caches[0].fingerprint)
    for c, d in zip(caches, loaded):  # the loaded cache keeps the same axes of the artifact
        assert mx.array_equal(c.tiers[2].sides["k"]._basis(), d.tiers[2].sides["k"]._basis())
    a = feed(llama_model, TOKENS[:, 150:], caches, 1)
    b = feed(llama_model, TOKENS[:, 150:], loaded, 1)
    assert float(mx.abs(a - b).max()) == 0.0
    # the same cache fitted per prompt saves its bases: the calibrated file is smaller by about them
    plain = vq.make_prompt_cache(llama_model, recipe(tmp_path, corpus, calibrated="false"))
    feed(llama_model, TOKENS[:, :150], plain, 50)
    plain_size = save_prompt_cache(tmp_path / "p.safetensors", plain)
    bases = sum(s.fitted["basis"].nbytes for c in plain for s in c.tiers[2].sides.values())
    assert plain_size - size > 0.8 * bases


def test_the_cache_holds_which_axes_it_keeps_not_the_basis_and_widths_are_per_prompt(llama_model, setup):
    path, _ = setup
    caches = vq.make_prompt_cache(llama_model, path)
    feed(llama_model, TOKENS[:, :150], caches, 50)
    for c in caches:
        c.finish_prompt()
    side = caches[0].tiers[2].sides["k"]
    keep = np.array(side.fitted["keep"])
    axes = side.store.axes()
    assert mx.array_equal(side._basis(), axes[:, :, mx.array(keep.astype(np.int32))])
    assert "basis" not in side.fitted and "basis" not in side.arrays()  # the artifact's, held once per process
    assert side.nbytes == sum(a.nbytes for a in side.arrays().values()) + side.widths.nbytes  # + their host copy
    assert {"keep", "widths", "mean", "loc", "std"} <= set(side.arrays())
    assert int(np.array(side.fitted["widths"]).astype(int).sum()) <= 192


def test_budgets_share_one_artifact(llama_model, setup, tmp_path):
    path, corpus = setup
    other = recipe(tmp_path, corpus, k_budget=128)
    shape = ModelShape.from_model(llama_model)
    keys = [binding.key_for(vq.compile_recipe(vq.load_recipe(p), shape), llama_model) for p in (path, other)]
    assert keys[0] == keys[1]
    vq.make_prompt_cache(llama_model, other)  # binds without calibrating again


def test_a_cache_naming_axes_the_artifact_lacks_is_refused(llama_model, setup):
    path, _ = setup
    caches = vq.make_prompt_cache(llama_model, path)
    feed(llama_model, TOKENS[:, :150], caches, 50)
    caches[0].finish_prompt()
    tier = caches[0].tiers[2]
    arrays = {n: a for n, a in tier.arrays().items()}
    arrays["k.keep"] = mx.full(arrays["k.keep"].shape, 999, mx.uint16)
    assert "keep does not name" in vq.make_prompt_cache(llama_model, path)[0].tiers[2].restore(
        tier.start, tier.count, arrays
    )


def test_gemma3_sliding_layers_calibrate_save_and_load(tmp_path, monkeypatch):
    from conftest import tiny_gemma3

    monkeypatch.setenv("VELOXQUANT_CACHE", str(tmp_path / "cache"))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(chr(1000 + int(i)) for i in np.random.default_rng(1).integers(0, 500, 600)))
    model, path = tiny_gemma3(), recipe(tmp_path, corpus)
    calibrate(vq.compile_recipe(vq.load_recipe(path), ModelShape.from_model(model)), model, Tokens(), progress=False)
    caches = vq.make_prompt_cache(model, path)
    feed(model, TOKENS[:, :150], caches, 50)  # past the sliding window (32): old latents expire
    save_prompt_cache(tmp_path / "g.safetensors", caches)
    loaded, _ = load_prompt_cache(tmp_path / "g.safetensors", expect_fingerprint=caches[0].fingerprint)
    a = feed(model, TOKENS[:, 150:170], caches, 1)
    b = feed(model, TOKENS[:, 150:170], loaded, 1)
    assert float(mx.abs(a - b).max()) == 0.0
