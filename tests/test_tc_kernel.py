"""attend_tc (issue 18): off the GPU its scope, launch geometry (shared memory,
one wave, every 32-token stage walked by exactly one warp), when it merges in
its own launch, and -- where nvcc is installed -- that it compiles for sm_90
without spills. Its parity runs on the H200 (tests/test_kernels.py, impls "tc"
and "tc2"); the one-launch path's ordering and view handling are gpu tests here."""

import re

import mlx.core as mx
import pytest

from veloxquant.kernels import backend, tc, tc_launch

SPECS = [
    ((b, g, "channel"), (b, gv, "token")) for b in (2, 4, 8) for g, gv in ((32, 32), (16, 16), (64, 32), (128, 64))
]


def _stages_walked(L: int, ns: int) -> list:
    """The kernel's partition (blocks of spb stages, NW warps of spw each), stage indices in walk order."""
    nst = -(-L // tc.ST)
    spb = -(-nst // ns)
    out = []
    for bx in range(ns):
        b0, b1 = bx * spb, min(bx * spb + spb, nst)
        spw = -(-(b1 - b0) // tc.NW) if b1 > b0 else 0
        for w in range(tc.NW):
            s0 = min(b0 + w * spw, b1)
            out += range(s0, min(s0 + spw, b1))
    return out


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("specs", SPECS, ids=lambda s: f"{s[0][0]}b-gk{s[0][1]}-gv{s[1][1]}")
def test_plan_fits_shared_memory_one_wave_and_covers_every_stage(D, specs):
    kspec, vspec = specs
    for B, Hq, Lq, Hkv, L in (
        (1, 32, 1, 8, 32768),
        (1, 9, 1, 3, 32768),
        (1, 4, 2, 1, 131072),
        (2, 8, 1, 2, 1040),
        (1, 32, 4, 8, 128),
    ):
        rows = Hq // Hkv * Lq
        if L % kspec[1] or tc.supported(Hq, Lq, D, Hkv, L, kspec, vspec):
            continue
        for qdtype in ("float16", "float32"):  # float32 queries also hold their fp16 remainders
            p = tc.plan(B, Hq, Lq, D, Hkv, L, qdtype, kspec, vspec, 0.1)
            static = tc.static_bytes(D, rows, qdtype)
            assert 2 <= p.nst <= 4 and p.smem + static <= tc.SMEM_BLOCK_MAX
            assert p.bps * (p.smem + static + 1024) <= tc.SMEM_PER_SM
            assert p.smem >= tc.NW * p.nst * tc.stage_bytes(D, kspec[0], kspec[1], vspec[0], vspec[1])
            assert p.smem >= tc.end_bytes(D, rows, p.ns)  # partials, a tail tile, the merge's weights
            assert p.ns * B * Hkv <= max(p.bps * 132, B * Hkv)  # one wave
            assert sorted(_stages_walked(L, p.ns)) == list(range(-(-L // tc.ST)))  # each stage once


def test_scope_names_what_it_refuses():
    kivi = ((4, 32, "channel"), (4, 32, "token"))
    assert tc.supported(32, 1, 128, 8, 4096, *kivi) == ""
    assert tc.supported(32, 4, 128, 8, 4096, *kivi) == ""  # 16 rows: both mma row halves
    assert "rows" in tc.supported(32, 5, 128, 8, 4096, *kivi)
    assert "rows" in tc.supported(4, 3, 256, 1, 4096, *kivi)  # > 8 rows at D = 256 would spill
    assert "per-channel" in tc.supported(32, 1, 128, 8, 4096, (4, 32, "token"), (4, 32, "token"))
    assert "tier length" in tc.supported(32, 1, 128, 8, 4104, *kivi)


def test_nvcc_renders_the_tc_kernel_as_mlx_would():
    from veloxquant.kernels import nvcc_check

    src = nvcc_check.tc_unit(1, 32, 1, 128, 8, 32768, (4, 32, "channel"), (4, 32, "token"))
    assert "#define VQ_LAUNCH_BOUNDS 128, 3" in src and "constexpr int NST=3;" in src
    assert "const __grid_constant__ Shape kc_shape" in src and "vq_warp_rows" in src


@pytest.mark.slow
@pytest.mark.skipif(not __import__("shutil").which("nvcc"), reason="needs nvcc")
@pytest.mark.parametrize(
    "unit,shape,Lq,bits,qtype",
    [
        ("tc", "32/8/128", 1, 4, "float16"),
        ("tc", "32/8/128", 4, 4, "float16"),
        ("tc", "9/3/64", 3, 2, "float32"),
        ("tc", "4/1/256", 1, 8, "bfloat16"),
    ],
)
def test_pipelined_kernels_compile_for_sm90_without_spills(unit, shape, Lq, bits, qtype):
    from veloxquant.kernels import nvcc_check

    Hq, Hkv, D = (int(x) for x in shape.split("/"))
    unit = nvcc_check.tc_unit(1, Hq, Lq, D, Hkv, 32768, (bits, 32, "channel"), (bits, 32, "token"), qtype)
    report = nvcc_check.compile_unit(unit)
    assert " 0 bytes spill stores" in report
    if unit == "tc":  # the plan's shared-memory budget counts what ptxas allocates statically
        static = int(re.search(r"(\d+) bytes smem", report).group(1))
        assert static <= tc.static_bytes(D, Hq // Hkv * Lq, qtype)


def test_the_merge_folds_into_the_launch_only_while_one_block_can_read_it_quickly():
    kivi = ((4, 32, "channel"), (4, 32, "token"))
    for shape, folded in (
        ((1, 32, 1, 128, 8, 32768), True),
        ((1, 9, 1, 64, 3, 32768), True),
        ((1, 4, 1, 256, 1, 32768), False),
    ):  # 264 partials of 4 x 256 floats: 1 MiB
        B, Hq, Lq, D, Hkv, L = shape
        p = tc.plan(B, Hq, Lq, D, Hkv, L, "float16", *kivi, 0.1)
        rows = Hq // Hkv * Lq
        assert tc.folds(B, Hkv, rows, D, p.ns) is folded
        assert folded == (rows * p.ns * D * 4 <= tc.FOLD_MAX_BYTES)
    assert not tc.folds(tc.COUNTERS, 2, 4, 128, 1)  # more kv heads than counters


def _codes(B, Hq, Hkv, Lq, D, L, bits=4, seed=0, qdtype=mx.float16):
    from veloxquant.stages.store import Affine

    kq, kk, kv = mx.random.split(mx.random.key(seed), 3)
    q = mx.random.normal((B, Hq, Lq, D), key=kq).astype(qdtype)
    ks, vs = {"bits": bits, "group": 32, "axis": "channel"}, {"bits": bits, "group": 32, "axis": "token"}
    ke = Affine(**ks).encode(mx.random.normal((B, Hkv, L, D), key=kk))
    ve = Affine(**vs).encode(mx.random.normal((B, Hkv, L, D), key=kv))
    return q, ke, ve, ks, vs


def _run(q, ke, ve, ks, vs, tail=None, fold=True):
    from veloxquant.kernels.reference import spec_fields

    run = tc_launch.launcher(
        tuple(q.shape),
        q.dtype,
        tuple(ke["codes"].shape),
        spec_fields(ks),
        spec_fields(vs),
        q.shape[-1] ** -0.5,
        fold=fold,
    )
    return run(q, ke, ve, tail)


gpu = pytest.mark.skipif(backend() != "cuda", reason="needs MLX's CUDA backend")


@pytest.mark.gpu
@gpu
def test_folded_launches_queued_together_answer_as_one_by_one():
    """Independent folded calls in one graph share the counters: their ordering input must
    keep them apart (else two launches count on one counter and merge too early)."""
    calls = []
    for i, (Hq, Hkv, D, L, W) in enumerate(
        [
            (32, 8, 128, 8192, 0),
            (9, 3, 64, 4096, 40),
            (32, 8, 128, 8192, 100),
            (4, 1, 256, 2048, 0),
            (8, 2, 128, 1024, 17),
            (32, 8, 128, 16384, 0),
        ]
    ):
        q, ke, ve, ks, vs = _codes(1, Hq, Hkv, 1, D, L, seed=i)
        tail = [(mx.random.normal((1, Hkv, W, D)).astype(mx.float16),) * 2] if W else None
        mx.eval(q, ke, ve, *(tail or []))
        calls.append((q, ke, ve, ks, vs, tail))
    alone = []
    for c in calls:
        out = _run(*c)
        mx.eval(out)
        alone.append(out)
    together = [_run(*c) for c in calls]
    mx.eval(together)
    for a, b in zip(alone, together):
        for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
            assert mx.array_equal(x, y)
    assert int(tc_launch._Order.work[: tc.COUNTERS].sum()) == 0  # every launch left its counters at zero
    from veloxquant.kernels.reference import spec_fields

    ns = tc.plan(1, 32, 1, 128, 8, 16384, mx.float16, *(spec_fields(s) for s in calls[-1][3:5]), 128**-0.5).ns
    assert tc_launch.held_bytes() >= 4 * (tc.COUNTERS + 32 * ns * 130)  # the largest call's pm, pl, pacc


@pytest.mark.gpu
@gpu
def test_the_one_launch_path_reads_views_in_place():
    # q as the model hands it (a transposed view), codes as token slices of longer buffers
    q, ke, ve, ks, vs = _codes(1, 8, 2, 4, 128, 2048 + 64)
    qv = mx.swapaxes(mx.swapaxes(q, 1, 2) + 0, 1, 2)  # same values, strides of [B, Lq, Hq, D]
    ke = {n: a[:, :, (64 if n == "codes" else 2) :] for n, a in ke.items()}
    ve = {n: a[:, :, 64:] for n, a in ve.items()}
    want = _run(q, {n: a + 0 for n, a in ke.items()}, {n: a + 0 for n, a in ve.items()}, ks, vs, fold=False)
    for fold in (True, False):
        got = _run(qv, ke, ve, ks, vs, fold=fold)
        assert float(mx.abs(got[0] - want[0]).max()) <= 1e-5 and float(mx.abs(got[1] - want[1]).max()) <= 1e-5


@pytest.mark.gpu
@gpu
def test_codes_whose_rows_are_not_contiguous_are_never_misread():
    q, ke, ve, ks, vs = _codes(1, 8, 2, 1, 128, 1024)
    c = ke["codes"]
    ke = dict(ke, codes=mx.swapaxes(mx.swapaxes(c, 2, 3) + 0, 2, 3))  # same values, column-major rows
    want = _run(q, dict(ke, codes=c), ve, ks, vs, fold=False)[0]
    for fold in (True, False):
        out, lse = _run(q, ke, ve, ks, vs, fold=fold)
        # refused (NaN) or read right (MLX may hand the kernel a contiguous copy): never a misread
        assert bool(mx.all(mx.isnan(out))) or float(mx.abs(out - want).max()) <= 1e-5, fold
