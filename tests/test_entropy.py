"""Entropy stages (delta, rans) and the cachegen recipe: lossless, real coder output, clear errors."""

import json

import mlx.core as mx
import numpy as np
import pytest

import veloxquant as vq
from veloxquant.bench.entropy import codes_bytes, keep_entropy
from veloxquant.compiler import ModelShape, compile_recipe
from veloxquant.compiler.explain import render
from veloxquant.compiler.lower import KERNEL_SPILL
from veloxquant.compiler.rebuild import plan_from_json
from veloxquant.errors import CacheFileError, RecipeError
from veloxquant.recipe import load_recipe
from veloxquant.runtime import checksums
from veloxquant.runtime.make import caches_for
from veloxquant.runtime.persist import load_prompt_cache, save_prompt_cache
from veloxquant.stages.entropy import Delta, Rans
from veloxquant.stages.store import Affine

from conftest import feed

SHAPE = ModelShape.uniform("tiny", 2, 3, 64)
WINDOW = 16


def codes(shape, bits, seed=0):
    return np.random.default_rng(seed).integers(0, 1 << bits, shape)


@pytest.mark.parametrize("bits", [1, 3, 4, 8])
def test_delta_round_trip(bits):
    q = codes((2, 3, 41, 64), bits)
    d = Delta().forward(q, bits)
    assert d.min() >= 0 and d.max() < 1 << bits  # same alphabet: modulo, not widened
    assert np.array_equal(Delta().inverse(d, bits), q)


@pytest.mark.parametrize("table", ["channel", "tensor"])
@pytest.mark.parametrize("bits,L", [(3, 57), (4, 1), (8, 20)])
def test_rans_round_trip_is_bit_exact(table, bits, L):
    q = codes((1, 3, L, 64), bits, seed=bits)
    out = Rans(table=table).encode(q, bits)
    assert out["rans"].dtype == np.uint32 and out["freq"].dtype == np.uint8
    assert np.array_equal(Rans(table=table).decode(out, q.shape, bits), q)


def _plan(sets=()):
    return compile_recipe(load_recipe("cachegen"), SHAPE, [f"window={WINDOW}", *sets])


def _filled(plan, k, v):
    caches = caches_for(plan)
    for c in caches:
        c.update_and_fetch(k, v)
    return caches


def _smooth(L, seed):
    """Correlated along tokens, like keys under slow RoPE rotations: a random walk per channel."""
    steps = mx.random.normal((1, 3, L, 64), key=mx.random.key(seed)) * 0.05
    return (mx.cumsum(steps, axis=2) + mx.random.normal((1, 3, 1, 64), key=mx.random.key(seed + 1))).astype(mx.float16)


def test_plan_carries_entropy_stages_through_json_and_explain():
    plan = _plan()
    rest = plan.layers[0].tiers[1]
    assert [s.stage_name for s in rest.keys.entropy] == ["delta", "rans"]
    assert [s.stage_name for s in rest.values.entropy] == ["rans"]
    again = plan_from_json(json.dumps(plan.to_dict()))
    assert again.fingerprint == plan.fingerprint and again.layers[0].tiers[1] == rest
    assert keep_entropy(plan, lambda s: False).fingerprint != plan.fingerprint
    assert "entropy-coded when saved (K: delta | rans(table=channel), V: rans(table=channel))" in render(plan)
    # the live cost is that of the affine codes: coding only shrinks saved files
    assert rest.keys.bits_per_element(64) == Affine(4, 32, "token").bits_per_element(64)


def test_saved_cachegen_decodes_to_plain_affine_quantization(tmp_path):
    L = 100
    k, v = _smooth(L, 0), _smooth(L, 5)
    caches = _filled(_plan(), k, v)
    save_prompt_cache(str(tmp_path / "c.safetensors"), caches)
    loaded, _ = load_prompt_cache(str(tmp_path / "c.safetensors"), expect_fingerprint=caches[0].fingerprint)
    plain = Affine(bits=4, group=32, axis="token")
    n = loaded[0].tiers[1].count  # the window spills whole KERNEL_SPILL chunks to the kernel-read tier
    assert n % KERNEL_SPILL == 0 and 0 <= L - n <= WINDOW
    for x, got in zip((k, v), loaded[0].tiers[1].decoded(mx.float16)):
        want = plain.decode(plain.encode(x[:, :, :n]), mx.float16)
        assert mx.array_equal(got, want).item()


def test_save_load_round_trip_gives_identical_attention(llama_model, tmp_path):
    tokens = mx.random.randint(0, 500, (1, 140), key=mx.random.key(7))
    caches = vq.make_prompt_cache(llama_model, "cachegen", [f"window={WINDOW}", "table=tensor"])
    feed(llama_model, tokens[:, :120], caches, 40)
    path = tmp_path / "cachegen.safetensors"
    size = save_prompt_cache(str(path), caches)
    assert any(k.endswith("k.codes.rans") for k in mx.load(str(path)))  # really coded, not packed
    loaded, _ = load_prompt_cache(str(path), expect_fingerprint=caches[0].fingerprint)
    for a, b in zip(caches, loaded):
        for ta, tb in zip(a.tiers, b.tiers):
            assert ta.arrays().keys() == tb.arrays().keys()
            assert all(mx.array_equal(x, tb.arrays()[name]).item() for name, x in ta.arrays().items())
    q = mx.random.normal((1, 9, 1, 64), key=mx.random.key(1))
    for a, b in zip(caches, loaded):
        assert mx.array_equal(a.attend(q, 0.125, observe=False), b.attend(q, 0.125, observe=False)).item()
    out_a = llama_model(tokens[:, 120:], cache=caches)
    out_b = llama_model(tokens[:, 120:], cache=loaded)
    assert float(mx.abs(out_a - out_b).max()) == 0.0 and size == path.stat().st_size


def test_coded_file_is_smaller_on_correlated_codes(tmp_path):
    k, v = _smooth(400, 0), _smooth(400, 9)
    sizes = [
        save_prompt_cache(str(tmp_path / f"{i}.safetensors"), _filled(plan, k, v))
        for i, plan in enumerate((_plan(), keep_entropy(_plan(), lambda s: False)))
    ]
    assert sizes[0] < 0.95 * sizes[1]


def test_iid_uniform_codes_round_trip(tmp_path):
    # i.i.d. uniform codes carry a full `bits` per code: no saving is claimed, only
    # losslessness, and that the codes never take more room than packed ones.
    k = mx.random.uniform(shape=(1, 3, 200, 64), key=mx.random.key(2)).astype(mx.float16)
    v = mx.random.uniform(shape=(1, 3, 200, 64), key=mx.random.key(3)).astype(mx.float16)
    for i, plan in enumerate((_plan(["table=tensor"]), _plan())):
        caches = _filled(plan, k, v)
        path = tmp_path / f"u{i}.safetensors"
        save_prompt_cache(str(path), caches)
        loaded, _ = load_prompt_cache(str(path))
        for a, b in zip(caches, loaded):
            for ta, tb in zip(a.tiers, b.tiers):
                assert all(mx.array_equal(x, tb.arrays()[name]).item() for name, x in ta.arrays().items())
        packed = tmp_path / "packed.safetensors"
        save_prompt_cache(str(packed), _filled(keep_entropy(plan, lambda s: False), k, v))
        assert codes_bytes(path) <= codes_bytes(packed)


def _tamper(path, out, change):
    arrays, meta = mx.load(str(path), return_metadata=True)
    arrays = {k: np.array(a) for k, a in arrays.items()}
    change(arrays)
    arrays = {k: mx.array(a) for k, a in arrays.items()}
    # Re-signed: the checksums would refuse the file first; this reaches the decoder's own checks.
    mx.save_safetensors(str(out), arrays, checksums.sign(arrays, meta))
    return out


@pytest.mark.parametrize(
    "damage,message",
    [
        (lambda a: a.__setitem__("0.1.k.codes.rans", a["0.1.k.codes.rans"] ^ np.uint32(0x5A5A5A5A)), "k.codes"),
        (
            lambda a: a.__setitem__("0.1.k.codes.rans", a["0.1.k.codes.rans"][: a["0.1.k.codes.rans"].size // 2]),
            "k.codes",
        ),
        (lambda a: a.__setitem__("0.1.v.codes.freq", a["0.1.v.codes.freq"][:-1]), "frequency table"),
        (lambda a: a.__setitem__("0.1.v.codes.head", a["0.1.v.codes.head"] * 1000), "header shape"),
        (lambda a: a.pop("0.1.k.codes.freq"), "missing k.codes.freq"),
    ],
)
def test_corrupt_coded_stream_is_a_clear_error(tmp_path, damage, message):
    caches = _filled(_plan(), _smooth(100, 0), _smooth(100, 3))
    path = tmp_path / "ok.safetensors"
    save_prompt_cache(str(path), caches)
    bad = _tamper(path, tmp_path / "bad.safetensors", damage)
    with pytest.raises(CacheFileError, match=r"layer 0 tier 1 \(rest\): coded array") as info:
        load_prompt_cache(str(bad))
    assert message in str(info.value)


@pytest.mark.parametrize(
    "pipeline,message",
    [
        ("affine(bits=4) | delta", "no coder follows it"),
        ("affine(bits=4) | rans | delta", "follows the coder 'rans'"),
        ("affine(bits=4) | rans | residual(affine(bits=2))", "follows the entropy stage 'rans'"),
        ("fp16 | rans", "yields codes"),
    ],
)
def test_entropy_stage_order_errors(tmp_path, pipeline, message):
    path = tmp_path / "r.yaml"
    path.write_text(f"veloxquant: 1\nname: r\npipeline: {pipeline}\n")
    with pytest.raises(RecipeError, match=message):
        compile_recipe(load_recipe(str(path)), SHAPE)
