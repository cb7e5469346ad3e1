"""Affine tiers through MLX's own quantized matmul (kernels/mlx_affine.py, the `qmm` row):
MLX's bit order is ours, the partial matches the decode path's within 1e-5, and a cache
routed through it attends as the decoded one does (kivi 2/4-bit, kivi_sink, GQA)."""

import mlx.core as mx
import numpy as np
import pytest

from veloxquant.bench.e2e import random_llama
from veloxquant.kernels import dispatch, mlx_affine, table
from veloxquant.kernels.bitpack import pack
from veloxquant.kernels.partials import merge_partials, partial_attention
from veloxquant.runtime import make_prompt_cache, uninstall
from veloxquant.stages.store import Affine

KIVI2 = (Affine(2, 32, "channel"), Affine(2, 32, "token"))
KIVI4 = (Affine(4, 32, "channel"), Affine(4, 32, "token"))


@pytest.mark.parametrize("bits", mlx_affine.BITS)
def test_mlx_packs_codes_in_our_bit_order(bits):
    w = mx.random.normal((4, 128), key=mx.random.key(bits))
    packed, scales, biases = mx.quantize(w, group_size=32, bits=bits)
    deq = mx.dequantize(packed, scales, biases, group_size=32, bits=bits).reshape(4, 4, 32)
    codes = mx.round((deq - biases[..., None]) / scales[..., None]).reshape(4, 128)
    assert mx.array_equal(pack(codes.astype(mx.uint32), bits), packed).item()


SHAPES = [  # (B, Hq, Hkv, Lq, L, D)
    (1, 9, 3, 1, 256, 64),  # SmolLM2's heads
    (2, 32, 8, 1, 512, 128),  # GQA 4:1, Llama-3-8B's heads
    (1, 8, 2, 3, 128, 64),  # a few queries per kv head
]
SPECS = [
    KIVI2,
    KIVI4,
    (Affine(4, 64, "token"), Affine(3, 32, "channel")),
    (Affine(8, 128, "token"), Affine(2, 64, "token")),
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("specs", SPECS, ids=lambda s: f"{s[0].bits}{s[0].axis[0]}{s[0].group}")
@pytest.mark.parametrize("hidden", [0, 5])
def test_partial_matches_the_decode_path(shape, specs, hidden):
    B, Hq, Hkv, Lq, L, D = shape
    ks, vs = specs
    if D % max(s.group for s in specs if s.axis == "token"):
        pytest.skip(f"a group of {specs} does not tile head_dim {D}")
    keys, values, q = (
        mx.random.normal(s, key=mx.random.key(i))
        for i, s in enumerate([(B, Hkv, L, D), (B, Hkv, L, D), (B, Hq, Lq, D)])
    )
    k_enc, v_enc = ks.encode(keys), vs.encode(values)
    call = (B, Hq, Lq, D, Hkv, L, (ks.bits, ks.group, ks.axis), (vs.bits, vs.group, vs.axis))
    assert mlx_affine.scope(*call) == ""
    out, lse = mlx_affine.partial_attention(q, k_enc, v_enc, ks, vs, D**-0.5, hidden)
    mask = (mx.arange(L) >= hidden)[None] if hidden else None
    want_out, want_lse = partial_attention(q, ks.decode(k_enc, mx.float32), vs.decode(v_enc, mx.float32), D**-0.5, mask)
    assert out.shape == (B, Hq, Lq, D) and lse.shape == (B, Hq, Lq)
    assert float(mx.abs(out - want_out).max()) <= 1e-5
    assert float(mx.abs(lse - want_lse).max()) <= 1e-5


@pytest.mark.parametrize("tiers,hidden", [(1, 0), (2, 0), (2, 7)])
def test_the_dense_tail_folds_into_one_softmax(tiers, hidden):
    """With the layer's 16-bit tiers (KIVI's window; kivi_sink's sinks too) the route answers the
    whole attention, as the merge of its partial with theirs does (in float32 here)."""
    B, Hq, Hkv, D, L = 1, 8, 2, 64, 256
    ks, vs = KIVI2
    keys, values, q = (
        mx.random.normal(s, key=mx.random.key(i)) for i, s in enumerate([(B, Hkv, L, D)] * 2 + [(B, Hq, 1, D)])
    )
    tail = [
        tuple(mx.random.normal((B, Hkv, n, D), key=mx.random.key(9 + i + n)) for i in (0, 1)) for n in (5, 140)[-tiers:]
    ]
    k_enc, v_enc = ks.encode(keys), vs.encode(values)
    run = mlx_affine.launch(
        (B, Hq, 1, D), mx.float32, tuple(k_enc["codes"].shape), (2, 32, "channel"), (2, 32, "token"), D**-0.5
    )
    got = run(q, k_enc, v_enc, tail, hidden)
    dense = tuple(mx.concatenate([kv[i] for kv in tail], axis=2) for i in (0, 1))
    want = merge_partials(
        [mlx_affine.partial_attention(q, k_enc, v_enc, ks, vs, D**-0.5, hidden), partial_attention(q, *dense, D**-0.5)]
    )
    assert got.dtype == q.dtype and got.shape == q.shape
    assert float(mx.abs(got - want).max()) <= 1e-5


def test_scope_refuses_what_mlx_cannot_take():
    kivi = ((2, 32, "channel"), (2, 32, "token"))
    assert mlx_affine.scope(1, 8, 1, 64, 2, 256, *kivi) == ""
    assert "bits 7" in mlx_affine.scope(1, 8, 1, 64, 2, 256, (7, 32, "channel"), (2, 32, "token"))
    assert "channel group 16" in mlx_affine.scope(1, 8, 1, 64, 2, 256, (2, 32, "channel"), (2, 16, "token"))
    assert "tier length" in mlx_affine.scope(1, 8, 1, 64, 2, 250, *kivi)
    assert "query rows" in mlx_affine.scope(1, 8, 32, 64, 2, 256, *kivi)


def test_the_route_is_metals_default_and_selectable(monkeypatch):
    monkeypatch.delenv(table.ROUTE_ENV, raising=False)
    assert table.mlx_attend("metal") == "qmm"
    assert table.mlx_attend("cpu") == ("qmm" if "cpu" in table.MLX_ATTEND_BACKENDS else "")
    assert table.mlx_attend("cuda") == ""  # our kernels, else decode: MLX's qmm refuses some CUDA shapes
    monkeypatch.setenv(table.ROUTE_ENV, "qmm")
    assert table.mlx_attend("cpu") == "qmm"
    monkeypatch.setenv(table.ROUTE_ENV, "decode")
    assert table.mlx_attend("metal") == ""


@pytest.fixture(scope="module")
def model():
    mx.random.seed(3)
    return random_llama(2, 8, 2, 64, 500, mx.float32)


def _decoded_caches(model, recipe, settings=()):
    caches = make_prompt_cache(model, recipe, list(settings))
    tokens = mx.random.randint(0, 500, (1, 300), key=mx.random.key(1))
    try:
        mx.eval([model(tokens[:, s : s + 100], cache=caches) for s in (0, 100, 200)])
        for t in range(40):  # crosses spills of the window into the coded tier
            mx.eval(model(mx.array([[t + 7]]), cache=caches))
    finally:
        uninstall(model)
    return caches


@pytest.mark.skipif(dispatch.backend() == "cuda", reason="on CUDA our fused kernels answer")
@pytest.mark.parametrize("recipe,settings", [("kivi", ()), ("kivi", ("bits=4",)), ("kivi_sink", ())])
def test_cache_attends_through_qmm_as_the_decode_path(model, recipe, settings, monkeypatch):
    caches = _decoded_caches(model, recipe, settings)
    for seed, cache in enumerate(caches):
        q = mx.random.normal((1, 8, 1, 64), key=mx.random.key(10 + seed)) * 3
        outs = {}
        for route in ("decode", "qmm"):
            monkeypatch.setenv(table.ROUTE_ENV, route)
            for t in cache.tiers:
                t.launch_key = None  # choose again under this route
            outs[route] = np.array(cache.attend(q, 64**-0.5, observe=False))
            coded = [t for t in cache.tiers if t.fusable and t.count]
            assert coded and all((t.launch is not None) == (route == "qmm") for t in coded), route
        np.testing.assert_allclose(outs["qmm"], outs["decode"], rtol=0, atol=1e-5)
