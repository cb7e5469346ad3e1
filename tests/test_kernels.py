"""Fused affine decode attention: reference vs decoded attention, dispatch vs
reference on the backend present, and (gpu-marked) the CUDA kernel vs the
reference. Run the CUDA part with `pytest -m gpu tests/test_kernels.py` on a
machine whose MLX has the CUDA backend; elsewhere it is skipped."""

import json
import os

import mlx.core as mx
import pytest

from veloxquant.kernels import backend, choice, fused_affine_partial
from veloxquant.kernels.partials import partial_attention
from veloxquant.kernels.reference import affine_partial_attention as reference
from veloxquant.stages.store import Affine

TOL = 1e-3


def on_cpu(fn, *args, **kw):
    """Evaluate on the CPU: MLX's CUDA backend runs float32 matmuls at reduced
    (TF32-like) precision, ~2e-3 off on these shapes, so exact answers come from the CPU."""
    with mx.stream(mx.cpu):
        out = fn(*args, **kw)
        mx.eval(out)
    return out


def spec(bits, group, axis):
    return {"bits": bits, "group": group, "axis": axis}


def make(B, Hq, Hkv, Lq, D, L, kspec, vspec, qdtype=mx.float16, seed=0):
    key = mx.random.key(seed)
    kq, kk, kv = mx.random.split(key, 3)
    q = (1.5 * mx.random.normal((B, Hq, Lq, D), key=kq)).astype(qdtype)
    k = 2.0 * mx.random.normal((B, Hkv, L, D), key=kk) + 0.5
    v = mx.random.normal((B, Hkv, L, D), key=kv)
    return q, Affine(**kspec).encode(k), Affine(**vspec).encode(v)


def decoded(q, ke, ve, kspec, vspec, scale):
    return partial_attention(q, Affine(**kspec).decode(ke, mx.float32), Affine(**vspec).decode(ve, mx.float32), scale)


def maxerr(a, b):
    return max(float(mx.abs(x.astype(mx.float32) - y.astype(mx.float32)).max()) for x, y in zip(a, b))


KIVI2 = (spec(2, 32, "channel"), spec(2, 32, "token"))
CASES = [  # (B, Hq, Hkv, Lq, D, L, kspec, vspec)
    (1, 8, 2, 1, 128, 96, *KIVI2),
    (2, 9, 3, 1, 64, 64, spec(4, 32, "channel"), spec(4, 32, "token")),
    (1, 4, 1, 3, 256, 64, spec(8, 64, "channel"), spec(8, 64, "token")),
    (1, 4, 2, 2, 64, 40, spec(4, 32, "token"), spec(2, 16, "token")),
    (1, 2, 2, 1, 128, 128, spec(2, 128, "channel"), spec(4, 64, "channel")),
    (1, 6, 3, 1, 64, 33, spec(3, 32, "token"), spec(5, 64, "token")),  # odd widths: reference only
]


@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: f"{c[6]['bits']}{c[6]['axis'][0]}-{c[7]['bits']}{c[7]['axis'][0]}"
)
def test_reference_matches_attention_on_decoded_tensors(case):
    B, Hq, Hkv, Lq, D, L, ks, vs = case
    q, ke, ve = make(*case)
    scale = D**-0.5
    assert maxerr(on_cpu(reference, q, ke, ve, ks, vs, scale), on_cpu(decoded, q, ke, ve, ks, vs, scale)) <= TOL


@pytest.mark.parametrize("case", CASES[:3])
def test_dispatch_matches_reference_on_present_backend(case):
    q, ke, ve = make(*case)
    ks, vs = case[6], case[7]
    scale = case[4] ** -0.5
    out, lse = fused_affine_partial(q, ke, ve, ks, vs, scale)
    assert out.shape == q.shape and lse.shape == q.shape[:3]
    assert out.dtype == mx.float32 and lse.dtype == mx.float32
    # The kernel is held to the exact (CPU) answer; the reference path on a
    # GPU is the same ops on the same device, so it must agree with itself.
    exact = choice(q, ke, ve, ks, vs, scale)[0] == "cuda" or backend() == "cpu"
    want = on_cpu(reference, q, ke, ve, ks, vs, scale) if exact else reference(q, ke, ve, ks, vs, scale)
    assert maxerr((out, lse), want) <= TOL


def test_reference_merges_with_other_tiers_exactly():
    # The lse makes a tier's partial mergeable: two halves merge to the whole.
    from veloxquant.kernels.partials import merge_partials

    ks, vs = KIVI2
    q, ke, ve = make(1, 4, 2, 1, 64, 128, ks, vs)
    half = lambda enc, n, g: {k: a[:, :, : n // (g if k != "codes" else 1)] for k, a in enc.items()}
    rest = lambda enc, n, g: {k: a[:, :, n // (g if k != "codes" else 1) :] for k, a in enc.items()}
    a = on_cpu(reference, q, half(ke, 64, 32), half(ve, 64, 1), ks, vs, 0.125)
    b = on_cpu(reference, q, rest(ke, 64, 32), rest(ve, 64, 1), ks, vs, 0.125)
    whole = on_cpu(reference, q, ke, ve, ks, vs, 0.125)
    assert maxerr((on_cpu(merge_partials, [a, b]),), (whole[0],)) <= 1e-5


def test_dispatch_never_selects_a_kernel_off_cuda():
    q, ke, ve = make(1, 8, 2, 1, 128, 64, *KIVI2)
    impl, why = choice(q, ke, ve, *KIVI2, scale=0.1)
    if backend() != "cuda":
        assert impl == "reference" and why
    os.environ["VELOXQUANT_KERNELS"] = "off"
    try:
        assert choice(q, ke, ve, *KIVI2, scale=0.1)[0] == "reference"
    finally:
        del os.environ["VELOXQUANT_KERNELS"]


def test_unsupported_calls_are_named():
    from veloxquant.kernels import cuda

    q, ke, ve = make(1, 6, 3, 1, 64, 33, spec(3, 32, "token"), spec(5, 64, "token"))
    assert "bits" in cuda.unsupported(q, ke, ve, spec(3, 32, "token"), spec(5, 64, "token"))
    q, ke, ve = make(1, 4, 1, 9, 64, 32, *KIVI2)
    assert "queries" in cuda.unsupported(q, ke, ve, *KIVI2)
    q, ke, ve = make(1, 4, 1, 1, 96, 32, spec(4, 32, "channel"), spec(4, 32, "token"))
    assert "head_dim" in cuda.unsupported(q, ke, ve, spec(4, 32, "channel"), spec(4, 32, "token"))


def test_kernel_layout_fits_every_supported_config():
    from veloxquant.kernels import cuda

    for D in (64, 128, 256):
        for bits in (2, 4, 8):
            for g in (32, 64, 128):
                for kax, vax in (("channel", "token"), ("token", "token"), ("channel", "channel")):
                    if "token" in (kax, vax) and g > D:
                        continue
                    kspec, vspec = (bits, g, kax), (bits, g, vax)
                    for R in (1, 2, 4):
                        ch = cuda.choose_chunk(D, R, kspec, vspec)
                        assert ch % 16 == 0 and (kax == "token" or ch % g == 0)
                        assert cuda.smem_bytes(ch, D, R, *kspec, *vspec) <= cuda.SMEM_MAX
                    for L in (g, 1000 // g * g, 131072):
                        p = cuda.plan(1, 32, 1, D, 8, L, mx.float16, kspec, vspec, 0.1)
                        nsub = -(-p.nc // p.ns)
                        assert p.nc == -(-L // p.ch) and (p.ns - 1) * nsub < p.nc  # no idle block


def test_mma_kernel_scope_and_default():
    from veloxquant.kernels import mma

    kivi = ((4, 32, "channel"), (4, 32, "token"))
    assert mma.mma_supported(32, 1, 128, 8, 32768, *kivi) == ""
    assert "rows" in mma.mma_supported(32, 2, 128, 8, 32768, *kivi)  # 8 rows per kv head
    assert "per-channel" in mma.mma_supported(8, 1, 128, 2, 512, (4, 32, "token"), (4, 32, "token"))


def test_bank_model_pads_rows_that_lanes_read_on_one_bank():
    from veloxquant.kernels import tc

    # 128/4-bit values: lanes (g, tig) read 8 bytes at row 2*tig, column 8*g; with
    # 64-byte rows four rows of a half-warp share banks (4 wavefronts per half).
    rows = lambda rs: [(2 * (lane % 4)) * rs + (lane // 4) * 8 for lane in range(32)]
    assert tc._wavefronts(rows(64), 8) == 8 and tc._wavefronts(rows(80), 8) == 2
    assert tc.row_strides(128, 4, 4) == (64, 80)  # keys already conflict-free, values padded
    assert tc._wavefronts([16 * lane for lane in range(32)], 16) == 4  # contiguous: the ideal


# ---------------------------------------------------------------- CUDA only
S = spec
GPU_CASES = [  # (B, Hq, Hkv, Lq, D, L, kspec, vspec, qdtype)
    (1, 32, 8, 1, 128, 4096, *KIVI2, mx.float16),
    (1, 32, 8, 1, 128, 32768, S(4, 32, "channel"), S(4, 32, "token"), mx.float16),
    (1, 32, 8, 1, 128, 8192, S(8, 32, "channel"), S(8, 32, "token"), mx.bfloat16),
    (1, 9, 3, 1, 64, 4000, S(2, 32, "channel"), S(2, 32, "token"), mx.float16),
    (1, 4, 1, 1, 256, 16384, S(4, 64, "channel"), S(4, 64, "token"), mx.float16),
    (2, 8, 2, 4, 128, 1056, S(4, 32, "token"), S(2, 32, "token"), mx.float32),
    (1, 8, 8, 1, 64, 96, S(2, 32, "channel"), S(8, 32, "channel"), mx.float16),
    (1, 12, 4, 8, 128, 640, S(4, 128, "channel"), S(4, 128, "channel"), mx.bfloat16),
    (1, 16, 2, 1, 256, 2048, S(2, 64, "token"), S(4, 32, "token"), mx.float16),
    (1, 4, 4, 2, 64, 77, S(4, 64, "token"), S(8, 64, "token"), mx.float16),
    # more shapes the tensor-core kernel (attend_mma) takes
    (1, 8, 2, 1, 128, 2048, S(4, 32, "channel"), S(4, 16, "token"), mx.float32),
    (1, 4, 4, 1, 64, 512, S(8, 16, "channel"), S(2, 16, "token"), mx.float16),
    (1, 4, 1, 1, 256, 1024, S(8, 32, "channel"), S(8, 16, "token"), mx.float16),
    (1, 4, 2, 2, 128, 640, S(2, 64, "channel"), S(4, 32, "token"), mx.bfloat16),
    (2, 6, 2, 1, 64, 4096, S(4, 32, "channel"), S(4, 32, "token"), mx.float16),
    # attend_tc: up to 16 rows (9 and 16: both mma row halves), a last half stage (L % 32 = 16)
    (1, 32, 8, 4, 128, 2048, S(4, 32, "channel"), S(4, 32, "token"), mx.float16),
    (1, 9, 3, 3, 64, 1024, S(2, 32, "channel"), S(8, 32, "token"), mx.float32),
    (1, 8, 2, 1, 128, 1040, S(4, 16, "channel"), S(2, 32, "token"), mx.float16),
]


def _kernel(impl, monkeypatch) -> str:
    """The cuda impl to ask for: "tc" is attend_tc with its merge in the launch, "tc2" in a reduce launch."""
    if impl in ("tc", "tc2"):
        from veloxquant.kernels import tc

        monkeypatch.setattr(tc, "_FOLD", "1" if impl == "tc" else "0")
        return "tc"
    return impl


def _skip_unless_taken(impl, Hq, Lq, D, Hkv, L, ks, vs):
    from veloxquant.kernels import mma, tc
    from veloxquant.kernels.reference import spec_fields

    why = tc.supported if impl in ("tc", "tc2") else mma.mma_supported if impl == "mma" else None
    if why and why(Hq, Lq, D, Hkv, L, spec_fields(ks), spec_fields(vs)):
        pytest.skip(f"not a call the {impl} kernel takes")


_WANT = {}


def _record(name, err):
    path = os.environ.get("VELOXQUANT_PARITY_OUT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"case": name, "max_abs_err": err}) + "\n")


@pytest.mark.parametrize("impl", ["v1", "mma", "tc", "tc2"])
@pytest.mark.parametrize(
    "case",
    GPU_CASES,
    ids=lambda c: (
        f"B{c[0]}-H{c[1]}/{c[2]}-Lq{c[3]}-D{c[4]}-L{c[5]}-"
        f"{c[6]['bits']}{c[6]['axis'][0]}{c[6]['group']}-{c[7]['bits']}{c[7]['axis'][0]}{c[7]['group']}"
    ),
)
@pytest.mark.gpu
@pytest.mark.skipif(backend() != "cuda", reason="needs MLX's CUDA backend")
def test_cuda_kernel_matches_reference(case, impl, monkeypatch):
    from veloxquant.kernels import cuda

    B, Hq, Hkv, Lq, D, L, ks, vs, qdt = case
    _skip_unless_taken(impl, Hq, Lq, D, Hkv, L, ks, vs)
    q, ke, ve = make(B, Hq, Hkv, Lq, D, L, ks, vs, qdt)
    scale = D**-0.5
    assert cuda.unsupported(q, ke, ve, ks, vs) == ""
    got = cuda.affine_partial_attention(q, ke, ve, ks, vs, scale, impl=_kernel(impl, monkeypatch))
    key = (B, Hq, Hkv, Lq, D, L, str(ks), str(vs), str(qdt))
    if key not in _WANT:  # the CPU reference of the big cases is slow: once per case
        _WANT.clear()
        _WANT[key] = on_cpu(reference, q, ke, ve, ks, vs, scale)
    err = maxerr(got, _WANT[key])
    _record(
        f"[{impl}] B{B} Hq{Hq}/Hkv{Hkv} Lq{Lq} D{D} L{L} K{ks['bits']}{ks['axis'][0]}{ks['group']} "
        f"V{vs['bits']}{vs['axis'][0]}{vs['group']} q{qdt}",
        err,
    )
    assert err <= TOL


@pytest.mark.parametrize("vgroup", [64, 128])
@pytest.mark.gpu
@pytest.mark.skipif(backend() != "cuda", reason="needs MLX's CUDA backend")
def test_cuda_kernel_reads_sliced_views_and_every_chunk(vgroup, monkeypatch):
    # A tier's storage is often a view into a longer buffer. With one kv head
    # the view stays row-contiguous (no copy) and starts at an offset that
    # breaks 16-byte (vgroup 64) or 4-byte (vgroup 128) alignment of the value
    # metadata; the kernel's staging must still be exact.
    from veloxquant.kernels import cuda

    ks, vs = S(4, 32, "channel"), S(4, vgroup, "token")
    L = 2080
    q, ke, _ = make(1, 4, 1, 1, 128, L + 96, ks, vs)
    _, _, ve = make(1, 4, 1, 1, 128, L + 97, vs, vs, seed=1)
    ke = {n: a[:, :, (96 if n == "codes" else 3) :] for n, a in ke.items()}
    ve = {n: a[:, :, 97:] for n, a in ve.items()}
    want = on_cpu(reference, q, ke, ve, ks, vs, 0.09)
    for ch in (64, 128, 256):
        err = maxerr(cuda.affine_partial_attention(q, ke, ve, ks, vs, 0.09, chunk=ch), want)
        _record(f"sliced views (V group {vgroup}), chunk {ch}", err)
        assert err <= TOL
    for impl in ("mma", "tc", "tc2"):
        err = maxerr(cuda.affine_partial_attention(q, ke, ve, ks, vs, 0.09, impl=_kernel(impl, monkeypatch)), want)
        _record(f"[{impl}] sliced views (V group {vgroup})", err)
        assert err <= TOL


@pytest.mark.gpu
@pytest.mark.skipif(backend() != "cuda", reason="needs MLX's CUDA backend")
def test_dispatch_on_cuda_uses_the_kernel_once_verified():
    from veloxquant.kernels import table

    q, ke, ve = make(1, 8, 2, 1, 128, 256, *KIVI2)
    impl, why = choice(q, ke, ve, *KIVI2, scale=0.1)
    assert impl == ("cuda" if table.verified("v1", "cuda") else "reference"), why


def _dense_tier(B, Hkv, W, D, dtype, seed, cap=0):
    """(k, v) of a 16-bit tier; with `cap`, a view of the first W tokens of a longer buffer (strided)."""
    kk, kv = mx.random.split(mx.random.key(100 + seed))
    n = cap or W
    k = (2.0 * mx.random.normal((B, Hkv, n, D), key=kk) + 0.5).astype(dtype)
    v = mx.random.normal((B, Hkv, n, D), key=kv).astype(dtype)
    return (k[:, :, :W], v[:, :, :W]) if cap else (k, v)


TAIL_CASES = [  # (B, Hq, Hkv, Lq, D, L, kspec, vspec, q dtype, [(W, cap), ...])
    (1, 8, 2, 1, 128, 256, *KIVI2, mx.float16, [(17, 0)]),
    (2, 9, 3, 1, 64, 64, S(4, 32, "channel"), S(4, 32, "token"), mx.float16, [(4, 0), (40, 64)]),
    (1, 4, 1, 1, 256, 128, S(8, 64, "channel"), S(8, 64, "token"), mx.bfloat16, [(300, 320)]),
    (1, 8, 2, 2, 128, 96, S(4, 32, "token"), S(4, 32, "token"), mx.float32, [(33, 0), (1, 0)]),
    (1, 32, 8, 1, 128, 4096, S(4, 32, "channel"), S(4, 32, "token"), mx.float16, [(4, 0), (63, 256)]),
]


@pytest.mark.parametrize("impl", ["v1", "mma", "tc", "tc2"])
@pytest.mark.parametrize("case", TAIL_CASES, ids=lambda c: f"H{c[1]}/{c[2]}-Lq{c[3]}-D{c[4]}-L{c[5]}-tail{c[9]}")
@pytest.mark.gpu
@pytest.mark.skipif(backend() != "cuda", reason="needs MLX's CUDA backend")
def test_cuda_reduce_folds_dense_tiers(case, impl, monkeypatch):
    """reduce_tail (or attend_tc's tail blocks and merge, "tc"): the coded tier's partials plus
    exact attention over 16-bit tiers (contiguous or strided views), written in q's dtype."""
    from veloxquant.kernels import cuda
    from veloxquant.kernels.partials import merge_partials
    from veloxquant.kernels.tail import tail_unsupported

    B, Hq, Hkv, Lq, D, L, ks, vs, qdt, dense = case
    _skip_unless_taken(impl, Hq, Lq, D, Hkv, L, ks, vs)
    q, ke, ve = make(B, Hq, Hkv, Lq, D, L, ks, vs, qdt)
    tail = [_dense_tier(B, Hkv, W, D, qdt, i, cap) for i, (W, cap) in enumerate(dense)]
    scale = D**-0.5
    assert tail_unsupported(tuple(q.shape), tail) == ""
    got = cuda.launcher(
        tuple(q.shape), q.dtype, tuple(ke["codes"].shape), ks, vs, scale, impl=_kernel(impl, monkeypatch)
    )(q, ke, ve, tail)
    assert got.dtype == qdt and got.shape == q.shape
    k = mx.concatenate([k for k, _ in tail], axis=2)
    v = mx.concatenate([v for _, v in tail], axis=2)
    want = on_cpu(lambda: merge_partials([reference(q, ke, ve, ks, vs, scale), partial_attention(q, k, v, scale)]))
    got = got.astype(mx.float32)
    rounding = {mx.float16: 2.0**-11, mx.bfloat16: 2.0**-8, mx.float32: 0.0}[qdt]  # half an ulp, relative
    err = float(mx.abs(got - want).max())
    _record(f"[{impl}+tail] B{B} Hq{Hq}/Hkv{Hkv} Lq{Lq} D{D} L{L} tail {dense} q{qdt}", err)
    assert bool(mx.all(mx.abs(got - want) <= TOL + rounding * mx.abs(want)))


DEQUANT_CASES = [  # (spec, D, L, output dtype, view): view = a token slice of a longer tier
    (S(2, 32, "channel"), 128, 4096, mx.float16, False),
    (S(2, 32, "token"), 128, 4096, mx.float16, False),
    (S(4, 32, "channel"), 64, 96, mx.bfloat16, False),
    (S(8, 64, "token"), 256, 100, mx.float32, False),
    (S(4, 16, "token"), 64, 77, mx.float16, True),
]


@pytest.mark.parametrize(
    "case", DEQUANT_CASES, ids=lambda c: f"{c[0]['bits']}{c[0]['axis'][0]}{c[0]['group']}-D{c[1]}-L{c[2]}-{c[3]}"
)
@pytest.mark.gpu
@pytest.mark.skipif(backend() != "cuda", reason="needs MLX's CUDA backend")
def test_cuda_dequant_matches_affine_decode(case):
    """The dequant kernel (prefill's decode of a coded tier) against Affine.decode on the CPU."""
    from veloxquant.kernels import dequant

    sp, D, L, dtype, view = case
    x = 2.0 * mx.random.normal((2, 3, L + (5 if view else 0), D), key=mx.random.key(7)) + 0.5
    enc = Affine(**sp).encode(x)
    if view:
        enc = {n: a[:, :, 5:] for n, a in enc.items()}
    assert dequant.dequant_unsupported(enc, sp, dtype) == ""
    got = dequant.dequantize(enc, sp, dtype)
    want = on_cpu(Affine(**sp).decode, enc, dtype)
    assert got.dtype == dtype and got.shape == want.shape
    diff = mx.abs(got.astype(mx.float32) - want.astype(mx.float32))
    ulp = {mx.float16: 2.0**-10, mx.bfloat16: 2.0**-7, mx.float32: 2.0**-23}[dtype]
    _record(f"[dequant] {sp} D{D} L{L} {dtype}{' view' if view else ''}", float(diff.max()))
    assert bool(mx.all(diff <= ulp * mx.abs(want.astype(mx.float32)) + 1e-7))  # at most one rounding step
    # Placed at an offset of a longer buffer (prefill writes the other tiers around it): same values.
    placed = dequant.dequantize(enc, sp, dtype, L + 7, 3)
    assert placed.shape == (2, 3, L + 7, D)
    assert bool(mx.array_equal(placed[:, :, 3 : 3 + L], got))


def test_dequant_kernel_only_on_cuda():
    from veloxquant.kernels import dispatch

    if backend() != "cuda":
        assert dispatch.dequantizer() is None
    os.environ["VELOXQUANT_KERNELS"] = "off"
    try:
        assert dispatch.dequantizer() is None
    finally:
        del os.environ["VELOXQUANT_KERNELS"]


def test_dequant_refuses_a_place_outside_the_buffer():
    from veloxquant.kernels import dequant

    sp = S(4, 32, "token")
    enc = Affine(**sp).encode(mx.zeros((1, 2, 8, 64)))
    with pytest.raises(ValueError, match="do not fit at 5 of 10"):
        dequant.dequantize(enc, sp, mx.float16, 10, 5)


HIDE_CASES = [  # (Hq, Hkv, D, L, hidden, chunk, tail W): Gemma-3's sliding layers, SmolLM2's heads
    (4, 1, 256, 416, 17, 0, 128),
    (4, 1, 256, 544, 31, 0, 0),
    (9, 3, 64, 512, 300, 64, 0),  # whole chunks hidden: their weights are 0, not NaN
    (8, 2, 128, 256, 255, 0, 33),  # one visible coded token
]


@pytest.mark.parametrize("case", HIDE_CASES, ids=lambda c: f"H{c[0]}/{c[1]}-D{c[2]}-L{c[3]}-hide{c[4]}-tail{c[6]}")
@pytest.mark.gpu
@pytest.mark.skipif(backend() != "cuda", reason="needs MLX's CUDA backend")
def test_cuda_kernel_hides_the_tiers_front(case):
    """`hidden`: a sliding window's expired tokens at the coded tier's front are left out by count."""
    from veloxquant.kernels import cuda
    from veloxquant.kernels.partials import merge_partials

    Hq, Hkv, D, L, hidden, chunk, W = case
    ks, vs = KIVI2
    q, ke, ve = make(1, Hq, Hkv, 1, D, L, ks, vs)
    scale = D**-0.5
    part = on_cpu(reference, q, ke, ve, ks, vs, scale, hidden)
    if W:
        tail = [_dense_tier(1, Hkv, W, D, mx.float16, 0)]
        got = cuda.launcher(tuple(q.shape), q.dtype, tuple(ke["codes"].shape), ks, vs, scale, hides=True)(
            q, ke, ve, tail, hidden
        ).astype(mx.float32)
        want = on_cpu(lambda: merge_partials([part, partial_attention(q, *tail[0], scale)]))
        err = float(mx.abs(got - want).max())
        ok = bool(mx.all(mx.abs(got - want) <= TOL + 2.0**-11 * mx.abs(want)))
    else:
        got = cuda.affine_partial_attention(q, ke, ve, ks, vs, scale, chunk=chunk or None, hidden=hidden)
        err = maxerr(got, part)
        ok = err <= TOL and not any(bool(mx.any(mx.isnan(x))) for x in got)
    _record(f"[v1 hidden {hidden}] Hq{Hq}/Hkv{Hkv} D{D} L{L} chunk {chunk} tail {W}", err)
    assert ok, err


def test_reference_hides_the_tiers_front():
    ks, vs = KIVI2
    q, ke, ve = make(1, 8, 2, 1, 128, 96, ks, vs)
    k, v = Affine(**ks).decode(ke, mx.float32), Affine(**vs).decode(ve, mx.float32)
    want = on_cpu(partial_attention, q, k[:, :, 17:], v[:, :, 17:], 0.1)
    assert maxerr(on_cpu(reference, q, ke, ve, ks, vs, 0.1, 17), want) < 1e-5


SPAN_CASES = [  # (B, Hq, Hkv, D, L, row spans, chunk): a ragged batch's rows over one tier
    (3, 8, 2, 128, 256, [(0, 256), (0, 96), (0, 0)], 0),  # a full row, a short row, a row holding none
    (2, 9, 3, 64, 512, [(0, 64), (0, 512)], 64),  # the short row's later chunks skipped
    (4, 4, 1, 256, 160, [(0, 160), (0, 32), (5, 128), (0, 160)], 0),  # a hidden front with an early end
]


def _spans(rows) -> mx.array:
    return mx.array(rows, dtype=mx.int32)


def _span_err(got, want) -> float:
    """Largest difference of (out, lse), a row's lse -inf on both sides counting 0 (NaN anywhere: inf)."""
    (o1, l1), (o2, l2) = got, want
    both = mx.isneginf(l1) & mx.isneginf(l2)
    dl = mx.where(both, 0.0, mx.abs(l1 - l2))
    errs = [mx.abs(o1.astype(mx.float32) - o2), dl]
    return max(float("inf") if bool(mx.any(mx.isnan(e))) else float(e.max()) for e in errs)


def _per_row(q, ke, ve, ks, vs, scale, rows):
    """Each row's partial attention over its own visible tokens, decoded (a row seeing none: out 0, lse -inf)."""
    k, v = Affine(**ks).decode(ke, mx.float32), Affine(**vs).decode(ve, mx.float32)
    outs, lses = [], []
    for b, (lo, hi) in enumerate(rows):
        if hi <= lo:
            outs.append(mx.zeros(q[b : b + 1].shape, mx.float32))
            lses.append(mx.full(q[b : b + 1].shape[:3], -mx.inf))
            continue
        o, lse = partial_attention(q[b : b + 1], k[b : b + 1, :, lo:hi], v[b : b + 1, :, lo:hi], scale)
        outs.append(o)
        lses.append(lse)
    return mx.concatenate(outs), mx.concatenate(lses)


@pytest.mark.parametrize("case", SPAN_CASES[:2])
def test_reference_and_qmm_take_each_rows_span(case):
    """hidden as an int32 [B, 2] array: row b sees only its own tokens [lo, hi); the MLX-ops reference and
    MLX's own kernels (kernels/mlx_affine.py) answer what attention over each row's slice answers."""
    from veloxquant.kernels import mlx_affine

    B, Hq, Hkv, D, L, rows, _ = case
    ks, vs = KIVI2
    q, ke, ve = make(B, Hq, Hkv, 1, D, L, ks, vs)
    want = on_cpu(_per_row, q, ke, ve, ks, vs, 0.1, rows)
    for fn in (reference, mlx_affine.partial_attention):
        got = on_cpu(fn, q, ke, ve, ks, vs, 0.1, _spans(rows))
        assert _span_err(got, want) < 1e-4


@pytest.mark.parametrize("case", SPAN_CASES, ids=lambda c: f"B{c[0]}-H{c[1]}/{c[2]}-D{c[3]}-L{c[4]}-chunk{c[6]}")
@pytest.mark.gpu
@pytest.mark.skipif(backend() != "cuda", reason="needs MLX's CUDA backend")
def test_cuda_kernel_takes_each_rows_span(case):
    """A ragged batch's rows (runtime/batch_chain.py) in one launch: each row's visible span an input;
    chunks past a row's end are skipped and weigh 0, a row seeing none answers out 0, lse -inf."""
    from veloxquant.kernels import cuda

    B, Hq, Hkv, D, L, rows, chunk = case
    ks, vs = KIVI2
    q, ke, ve = make(B, Hq, Hkv, 1, D, L, ks, vs)
    scale = D**-0.5
    want = on_cpu(_per_row, q, ke, ve, ks, vs, scale, rows)
    got = cuda.affine_partial_attention(q, ke, ve, ks, vs, scale, chunk=chunk or None, hidden=_spans(rows))
    err = _span_err(got, want)
    _record(f"[v1 spans] B{B} Hq{Hq}/Hkv{Hkv} D{D} L{L} chunk {chunk} spans {rows}", err)
    assert err <= TOL, err
